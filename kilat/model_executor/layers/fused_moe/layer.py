"""The experts of a Mixture-of-Experts layer as one module: stacked expert weights, routing and the fused
expert computation (vLLM's ``FusedMoE``)."""

from __future__ import annotations

import re

import torch
from torch import nn

from kilat.distributed.parallel_state import get_tp_group, tensor_model_parallel_all_reduce
from kilat.model_executor.layers.fused_moe.experts import SILU, GatedActivation, fused_experts
from kilat.model_executor.layers.fused_moe.quantized import ExpertQuantMethod
from kilat.model_executor.layers.fused_moe.routing import select_experts
from kilat.model_executor.layers.linear import divide
from kilat.model_executor.layers.quantization import QuantizationConfig

ExpertNames = dict[str, tuple[str, int | None]]
"""Checkpoint projection name of one expert → (parameter, shard): ``"gate_proj"`` → ``("w13_weight", 0)``."""

DEFAULT_EXPERT_NAMES: ExpertNames = {"gate_proj": ("w13_weight", 0), "up_proj": ("w13_weight", 1),
                                     "down_proj": ("w2_weight", None)}
"""``experts.{e}.gate_proj/up_proj/down_proj`` (Qwen-MoE, OLMoE, DeepSeek)."""

MIXTRAL_EXPERT_NAMES: ExpertNames = {"w1": ("w13_weight", 0), "w3": ("w13_weight", 1), "w2": ("w2_weight", None)}
"""Mixtral's ``experts.{e}.w1`` (gate), ``w3`` (up), ``w2`` (down)."""

_PER_EXPERT = re.compile(r"(\d+)\.(\w+)\.weight")


class FusedMoE(nn.Module):
    """The routed experts of one MoE layer: each token goes through its ``top_k`` experts' gated MLPs
    (Shazeer et al., 2017; Fedus et al., 2022), summed with the router's weights.

    Weights are stacked along a leading expert dimension: ``w13_weight [E, 2 * I, H]`` (gate rows then up rows)
    and ``w2_weight [E, H, I]``, with ``has_bias`` also ``w13_bias [E, 2 * I]`` and ``w2_bias [E, H]``, in the model
    dtype; with a quantization config, its :meth:`~kilat.model_executor.layers.quantization.QuantizationConfig.
    get_moe_method` (:mod:`.quantized`) holds the weights quantized after loading. Under tensor parallelism each
    rank holds ``I / tp_size`` of every expert's intermediate features and the partial outputs are summed
    (all-reduce), as in a dense MLP (``w2_bias`` on rank 0 only).
    Routing is :func:`~.routing.select_experts`, the computation :func:`~.experts.fused_experts`.

    Args:
        num_experts: routed experts ``E``.
        top_k: experts per token (``num_experts_per_tok``).
        hidden_size: ``H``.
        intermediate_size: each expert's whole ``I`` (``moe_intermediate_size``).
        renormalize: divide the chosen weights by their sum (``norm_topk_prob``).
        dtype: parameter dtype.
        quant_config: the model's quantization (its ``get_moe_method`` quantizes the experts), or ``None``.
        prefix: the module's name (``model.layers.0.mlp.experts``), for errors.
        expert_names: the checkpoint's per-expert projection names (:data:`DEFAULT_EXPERT_NAMES`).
        scoring_func, num_expert_group, topk_group, routed_scaling_factor: as :func:`~.routing.select_experts`.
        e_score_correction_bias: hold a float32 ``e_score_correction_bias [E]`` (DeepSeek-V3) read from the
            checkpoint.
        activation: the experts' gated activation (GPT-OSS: ``GatedActivation("swigluoai", alpha, limit)``).
        has_bias: the expert projections have biases (GPT-OSS).

    Raises:
        ValueError: a quantization method without quantized experts, expert sizes it cannot group, or
            ``tensor_parallel_size`` not dividing ``intermediate_size``.

    Shapes: ``forward(x [T, H], router_logits [T, E]) -> [T, H]``.
    """

    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int, renormalize: bool,
                 dtype: torch.dtype | None = None, quant_config: QuantizationConfig | None = None, prefix: str = "",
                 expert_names: ExpertNames = DEFAULT_EXPERT_NAMES, *, scoring_func: str = "softmax",
                 num_expert_group: int | None = None, topk_group: int | None = None,
                 routed_scaling_factor: float = 1.0, e_score_correction_bias: bool = False,
                 activation: GatedActivation = SILU, has_bias: bool = False) -> None:
        super().__init__()
        group = get_tp_group()
        self.tp_rank, self.tp_size = group.rank, group.world_size
        self.num_experts, self.top_k, self.renormalize = num_experts, top_k, renormalize
        self.intermediate_size = divide(intermediate_size, self.tp_size, f"the intermediate size of {prefix or 'MoE'}")
        self.prefix, self.expert_names = prefix, expert_names
        self.scoring_func, self.routed_scaling_factor = scoring_func, routed_scaling_factor
        self.num_expert_group, self.topk_group = num_expert_group, topk_group
        self.activation = activation
        self.quant_method: ExpertQuantMethod | None = None
        if quant_config is not None:
            self.quant_method = quant_config.get_moe_method(prefix or "MoE experts")
        if self.quant_method is not None:
            self.quant_method.check_sizes(hidden_size, self.intermediate_size, prefix or "MoE experts")
        self.w13_weight = nn.Parameter(torch.empty(num_experts, 2 * self.intermediate_size, hidden_size, dtype=dtype),
                                       requires_grad=False)
        self.w2_weight = nn.Parameter(torch.empty(num_experts, hidden_size, self.intermediate_size, dtype=dtype),
                                      requires_grad=False)
        self.e_score_correction_bias = nn.Parameter(torch.empty(num_experts, dtype=torch.float32),
                                                    requires_grad=False) if e_score_correction_bias else None
        self.w13_bias = nn.Parameter(torch.empty(num_experts, 2 * self.intermediate_size, dtype=dtype),
                                     requires_grad=False) if has_bias else None
        self.w2_bias = nn.Parameter(torch.empty(num_experts, hidden_size, dtype=dtype),
                                    requires_grad=False) if has_bias else None

    def forward(self, x: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        """Route ``x [T, H]`` by ``router_logits [T, E]`` and return the weighted expert sum ``[T, H]`` (summed over
        the tensor-parallel ranks)."""
        topk_weights, topk_ids = select_experts(
            router_logits, self.top_k, self.renormalize, self.scoring_func, self.num_expert_group, self.topk_group,
            self.e_score_correction_bias, self.routed_scaling_factor)
        if self.quant_method is None:
            out = fused_experts(x, self.w13_weight, self.w2_weight, topk_weights, topk_ids, self.activation,
                                self.w13_bias, self.w2_bias)
        else:
            out = self.quant_method.apply(x, topk_weights, topk_ids, self.activation, self.w13_bias, self.w2_bias)
        return tensor_model_parallel_all_reduce(out) if self.tp_size > 1 else out

    def process_weights_after_loading(self) -> None:
        """Quantize the loaded experts (with a quantization config; else nothing)."""
        if self.quant_method is not None:
            self.quant_method.process_weights_after_loading(self)

    def shard_keys(self) -> set[tuple[str, tuple[int, int | None]]]:
        """Every (parameter, (expert, shard)) a per-expert checkpoint must provide."""
        names = list(self.expert_names.values())
        if self.w13_bias is not None:
            names += [("w13_bias", 0), ("w13_bias", 1), ("w2_bias", None)]
        keys = set()
        for param, shard in names:
            keys.update((param, (e, shard)) for e in range(self.num_experts))
        if self.e_score_correction_bias is not None:
            keys.add(("e_score_correction_bias", (0, None)))
        return keys

    def load_checkpoint_tensor(self, name: str, tensor: torch.Tensor) -> list[tuple[str, tuple[int, int | None]]]:
        """Load checkpoint tensor ``name`` (relative to this module: ``"3.gate_proj.weight"`` for one expert,
        ``"gate_up_proj"`` / ``"down_proj"`` for the stacked ``[E, 2 * I, H]`` / ``[E, H, I]`` layout that
        transformers 5 uses in memory, ``"gate_up_proj_bias"`` / ``"down_proj_bias"`` ``[E, 2 * I]`` / ``[E, H]``
        (gate before up in both), or ``"e_score_correction_bias"``), narrowed to this rank's slice.

        Returns:
            The :meth:`shard_keys` it filled.

        Raises:
            ValueError: an unknown name, an expert out of range, or a shape mismatch.
        """
        whole = {"gate_up_proj": "w13_weight", "down_proj": "w2_weight"}
        if self.w13_bias is not None:
            whole |= {"gate_up_proj_bias": "w13_bias", "down_proj_bias": "w2_bias"}
        if name in whole:  # all experts stacked: load each one's shards
            param = whole[name]
            keys = []
            for e in range(self.num_experts):
                if param in ("w13_weight", "w13_bias"):
                    gate, up = tensor[e].chunk(2, dim=0)
                    keys += [self._load(param, e, 0, gate), self._load(param, e, 1, up)]
                else:
                    keys.append(self._load(param, e, None, tensor[e]))
            return keys
        if name == "e_score_correction_bias" and self.e_score_correction_bias is not None:
            self._copy(self.e_score_correction_bias, tensor, name)
            return [("e_score_correction_bias", (0, None))]
        match = _PER_EXPERT.fullmatch(name)
        if match is None or match.group(2) not in self.expert_names or int(match.group(1)) >= self.num_experts:
            raise ValueError(f"{self.prefix}.{name}: not an expert tensor of this layer ({self.num_experts} experts, "
                             f"projections {sorted(self.expert_names)})")
        param, shard = self.expert_names[match.group(2)]
        return [self._load(param, int(match.group(1)), shard, tensor)]

    def _load(self, param: str, expert: int, shard: int | None, tensor: torch.Tensor
              ) -> tuple[str, tuple[int, int | None]]:
        """Copy one expert's projection (whole checkpoint shape) into its rows or columns of ``param``."""
        size = self.intermediate_size
        if param in ("w13_weight", "w13_bias"):  # [I, ...] rows of this rank -> rows [shard * I, (shard + 1) * I)
            target = getattr(self, param)[expert, shard * size:(shard + 1) * size]
            part = tensor.narrow(0, self.tp_rank * size, size) if self.tp_size > 1 else tensor
        elif param == "w2_weight":  # [H, I] columns of this rank
            target = self.w2_weight[expert]
            part = tensor.narrow(1, self.tp_rank * size, size) if self.tp_size > 1 else tensor
        else:  # w2_bias [H]: added once, by rank 0
            target = self.w2_bias[expert]
            part = tensor if self.tp_rank == 0 else torch.zeros_like(tensor)
        self._copy(target, part, f"{self.prefix} expert {expert} {param}")
        return param, (expert, shard)

    @staticmethod
    def _copy(target: torch.Tensor, tensor: torch.Tensor, what: str) -> None:
        if target.shape != tensor.shape:
            raise ValueError(f"{what}: expected shape {tuple(target.shape)}, got {tuple(tensor.shape)}")
        target.data.copy_(tensor)

    def extra_repr(self) -> str:
        split = f", tp {self.tp_rank}/{self.tp_size}" if self.tp_size > 1 else ""
        quant = f", quant={self.quant_method.describe()}" if self.quant_method is not None else ""
        return (f"num_experts={self.num_experts}, top_k={self.top_k}, intermediate_size={self.intermediate_size}, "
                f"renormalize={self.renormalize}, scoring_func={self.scoring_func}, "
                f"activation={self.activation.name}, bias={self.w13_bias is not None}{split}{quant}")
