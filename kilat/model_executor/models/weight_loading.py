"""Checkpoint tensors into a model's parameters, driven by what each model declares: its packed modules
(vLLM's ``packed_modules_mapping``: a fused layer → the checkpoint projections stacked in it, in order)."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn

from kilat.model_executor.layers import ColumnParallelLinear, Linear
from kilat.model_executor.layers.fused_moe import FusedMoE

PackedModules = dict[str, list[str]]
"""Fused layer name → the checkpoint layer names stacked in it, in stacking order."""

LLAMA_PACKED_MODULES: PackedModules = {"qkv_proj": ["q_proj", "k_proj", "v_proj"],
                                       "gate_up_proj": ["gate_proj", "up_proj"]}
"""The Llama family's fused layers (its checkpoints keep the projections separate)."""


def shard_names(prefix: str, num_shards: int, packed: PackedModules = LLAMA_PACKED_MODULES) -> list[str]:
    """The checkpoint layer names of linear layer ``prefix``: itself, or a fused layer's shards (``...qkv_proj``
    → ``...q_proj``, ``...k_proj``, ``...v_proj``).

    Raises:
        ValueError: a fused layer of ``num_shards`` shards that ``packed`` does not declare.
    """
    if num_shards == 1:
        return [prefix]
    parent, _, fused = prefix.rpartition(".")
    names = packed.get(fused)
    if names is None or len(names) != num_shards:
        raise ValueError(f"{prefix}: no packed-module declaration for {num_shards} shards")
    return [f"{parent}.{name}" for name in names]


def load_weights(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]], packed: PackedModules,
                 skip: Callable[[str], bool], tied_lm_head: bool) -> None:
    """Copy HF-named checkpoint tensors into ``model``'s (fused) parameters.

    A checkpoint projection named in ``packed`` goes into its shard of the fused layer; a fused layer's whole tensor
    (a checkpoint that stores it fused, e.g. Phi-3's ``qkv_proj``) is split into its shards by their whole sizes
    (dense tensors only). A linear layer's tensors go through its quantization method (``Linear.load_weight``, which
    narrows them to this tensor-parallel rank's slice); the embedding table goes to
    ``model.model.embed_tokens.load_weight`` (dense, or a quantized ``QuantWeight`` that a tied ``lm_head`` then
    shares); a parameter with a ``weight_loader`` attribute is given the tensor; others are copied into it. Names
    for which ``skip`` is true (rotary buffers, other pipeline stages' modules) and, with ``tied_lm_head``,
    ``lm_head.weight`` are ignored. Tensors under a :class:`FusedMoE` module (``...experts.3.gate_proj.weight``) go
    to its ``load_checkpoint_tensor``, which stacks each expert's projections.

    Raises:
        ValueError: on a checkpoint name with no parameter, a shape mismatch, a fused tensor that is not dense,
            or a parameter (shard) that the checkpoint does not provide.
    """
    stacked = {name: (fused, i) for fused, names in packed.items() for i, name in enumerate(names)}
    params = dict(model.named_parameters(remove_duplicate=False))
    linears = {name: m for name, m in model.named_modules() if isinstance(m, Linear)}
    moes = {name: m for name, m in model.named_modules() if isinstance(m, FusedMoE)}
    expected = {(f"{name}.{param}", key) for name, moe in moes.items() for param, key in moe.shard_keys()}
    for name in params:
        module_name = name.rpartition(".")[0]
        if (tied_lm_head and name == "lm_head.weight") or module_name in moes:
            continue
        shards = range(len(linears[module_name].output_sizes)) if module_name in linears else [None]
        expected.update((name, None if len(shards) == 1 else shard) for shard in shards)

    loaded, unexpected = set(), []

    def load_linear(linear: Linear, target: str, attr: str, tensor: torch.Tensor, shard: int | None) -> None:
        if shard is None and len(linear.output_sizes) > 1:  # stored fused: split it into its shards
            if not isinstance(linear, ColumnParallelLinear) or not isinstance(tensor, torch.Tensor) \
                    or attr not in ("weight", "bias"):
                raise ValueError(f"{target}: the checkpoint stores this layer fused ({attr}, {type(tensor).__name__}); "
                                 f"kilat splits only a dense weight or bias (quantized fused checkpoints, e.g. fp8, "
                                 f"AWQ, GPTQ or GGUF blocks of Phi-3, are not supported yet)")
            for i, part in enumerate(tensor.split(linear.checkpoint_sizes, dim=0)):
                linear.load_weight(attr, part, i)
                loaded.add((target, i))
            return
        linear.load_weight(attr, tensor, shard)
        loaded.add((target, shard))

    for name, tensor in weights:
        if skip(name) or (tied_lm_head and name == "lm_head.weight"):
            continue
        moe_name = _owner(name, moes)
        if moe_name is not None:
            keys = moes[moe_name].load_checkpoint_tensor(name[len(moe_name) + 1:], tensor)
            loaded.update((f"{moe_name}.{param}", key) for param, key in keys)
            continue
        module_name, _, attr = name.rpartition(".")
        parent, _, leaf = module_name.rpartition(".")
        shard = None
        if leaf in stacked:
            leaf, shard = stacked[leaf]
            module_name = f"{parent}.{leaf}"
        target = f"{module_name}.{attr}"
        if module_name in linears and target in params:
            load_linear(linears[module_name], target, attr, tensor, shard)
            continue
        if target == "model.embed_tokens.weight":
            model.model.embed_tokens.load_weight(tensor)
        elif target not in params or shard is not None:
            unexpected.append(name)
            continue
        elif (loader := getattr(params[target], "weight_loader", None)) is not None:
            loader(tensor)  # the parameter loads itself (e.g. this rank's heads of attention sinks)
        elif params[target].shape != tensor.shape:
            raise ValueError(f"{name}: expected shape {tuple(params[target].shape)}, got {tuple(tensor.shape)}")
        else:
            params[target].data.copy_(tensor)
        loaded.add((target, shard))

    lm_head = getattr(model, "lm_head", None)
    if tied_lm_head and lm_head is not None and model.model.embed_tokens.qweight is not None:
        lm_head.load_weight("weight", model.model.embed_tokens.qweight)  # shares the quantized table
    missing = sorted(f"{name}" + (f" (shard {shard})" if shard is not None else "")
                     for name, shard in expected - loaded)
    if unexpected or missing:
        raise ValueError(f"checkpoint does not match {type(model).__name__}: "
                         f"unexpected {unexpected[:10]}{' ...' if len(unexpected) > 10 else ''}, "
                         f"missing {missing[:10]}{' ...' if len(missing) > 10 else ''}")


def _owner(name: str, modules: dict[str, nn.Module]) -> str | None:
    """The name of the module in ``modules`` that checkpoint tensor ``name`` lies under, or ``None``."""
    parts = name.split(".")
    return next((prefix for i in range(len(parts) - 1, 0, -1) if (prefix := ".".join(parts[:i])) in modules), None)
