"""Linear layers, whole or split across tensor-parallel ranks (Shoeybi et al., 2019, "Megatron-LM"), each
applying its weight through a quantization method (:mod:`kilat.model_executor.layers.quantization`).

- :class:`Linear`: the whole weight on every rank.
- :class:`ColumnParallelLinear`: one or several linears of the same input stacked along the output
  (``gate_up_proj``); each rank holds a slice of every one's output rows, and its output is its slice.
- :class:`QKVParallelLinear`: the query, key and value projections, split by heads; key/value heads are
  replicated when there are fewer than ranks.
- :class:`RowParallelLinear`: the input split; each rank multiplies its slice and the outputs are summed
  (all-reduce), so a column-parallel layer followed by a row-parallel one needs one collective.

With one rank (the default) all four hold whole weights and run no collective. Checkpoint tensors are whole;
each rank narrows them to its slice while loading, one tensor at a time.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from kilat.distributed.parallel_state import get_tp_group, tensor_model_parallel_all_reduce
from kilat.model_executor.layers.quantization import QuantizationConfig, UnquantizedLinearMethod


def divide(numerator: int, denominator: int, what: str) -> int:
    """``numerator // denominator`` when it divides evenly.

    Raises:
        ValueError: it does not; the message names ``tensor_parallel_size`` and ``what`` is split.
    """
    if numerator % denominator:
        raise ValueError(f"tensor_parallel_size ({denominator}) must divide {what} ({numerator})")
    return numerator // denominator


class Linear(nn.Module):
    """``y = x @ weight.T + bias`` with uninitialized parameters (weights come from the loader); the whole
    weight on every tensor-parallel rank (vLLM's ``ReplicatedLinear``).

    What the layer holds and how it multiplies is its ``quant_method``'s: the config's method for this
    layer, or :class:`UnquantizedLinearMethod` (dense, oneDNN-packed on CPU bfloat16) without one.

    Args:
        input_size, output_size: this rank's feature sizes.
        bias: whether to hold a bias (always in ``dtype``).
        dtype: parameter and activation dtype (default: torch's default dtype).
        quant_config: the model's quantization, or ``None``.
        prefix: the layer's parameter-name prefix (``model.layers.0.self_attn.o_proj``), for per-layer choices.
        output_sizes: the stacked shards' sizes on this rank (:class:`ColumnParallelLinear`); default
            ``[output_size]``.

    Attributes:
        tp_rank, tp_size: this process's tensor-parallel rank and the number of ranks.

    Shapes: ``x [..., input_size] -> [..., output_size]``.
    """

    def __init__(self, input_size: int, output_size: int, bias: bool = False, dtype: torch.dtype | None = None,
                 quant_config: QuantizationConfig | None = None, prefix: str = "", *,
                 output_sizes: list[int] | None = None) -> None:
        super().__init__()
        group = get_tp_group()
        self.tp_rank, self.tp_size = group.rank, group.world_size
        self.input_size = input_size
        self.output_size = output_size
        self.output_sizes = list(output_sizes or [output_size])
        self.prefix = prefix
        self.quant_method = (quant_config.get_linear_method(self, prefix) if quant_config is not None
                             else UnquantizedLinearMethod())
        self.quant_method.create_weights(self, dtype)
        self.bias = nn.Parameter(torch.empty(output_size, dtype=dtype), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [..., input_size] -> [..., output_size]``."""
        return self.quant_method.apply(self, x)

    def load_weight(self, name: str, tensor: Any, shard: int | None = None) -> None:
        """Load checkpoint tensor ``name`` (``"weight"``, ``"bias"``, or a method's own, e.g. ``"qweight"``),
        into rows ``shard`` of a stacked layer when given, through the quantization method; a split layer first
        narrows the whole tensor to this rank's slice (:meth:`narrow`).

        Raises:
            ValueError: an unknown name or a shape mismatch.
        """
        self.quant_method.load_weight(self, name, self.narrow(name, tensor, shard), shard)

    def narrow(self, name: str, tensor: Any, shard: int | None) -> Any:
        """This rank's part of checkpoint tensor ``name`` (of shard ``shard``): the whole tensor here."""
        return tensor

    def process_weights_after_loading(self) -> None:
        """Let the quantization method derive its inference-time weights (packing, quantizing)."""
        self.quant_method.process_weights_after_loading(self)

    def extra_repr(self) -> str:
        split = f", tp {self.tp_rank}/{self.tp_size}" if self.tp_size > 1 else ""
        return (f"input_size={self.input_size}, output_size={self.output_size}, bias={self.bias is not None}, "
                f"method={self.quant_method.describe()}{split}")


def _dense_dims(name: str) -> tuple[int | None, int | None]:
    """The (output, input) dimensions of a dense checkpoint tensor: ``weight [out, in]``, ``bias [out]``.

    Raises:
        ValueError: another name (only dense checkpoints are split; ``QuantizationConfig.supports_tensor_parallel``
            refuses the others before loading).
    """
    if name == "weight":
        return 0, 1
    if name == "bias":
        return 0, None
    raise ValueError(f"cannot split checkpoint tensor {name!r} across tensor-parallel ranks")


class ColumnParallelLinear(Linear):
    """Linears of the same input stacked along the output (``gate_up_proj``: one matmul instead of several),
    each one's output rows split across the tensor-parallel ranks (vLLM's ``ColumnParallelLinear`` and
    ``MergedColumnParallelLinear``). Checkpoints keep the linears separate: :meth:`load_weight` copies each
    shard's slice into its rows.

    Args:
        input_size: input features.
        output_sizes: whole output features of each shard, in stacking order.
        bias, dtype, quant_config, prefix: as :class:`Linear`.
        shard_slices: ``(first row, rows)`` of each shard's checkpoint tensor that this rank holds; default an
            even split, rank ``r`` holding rows ``[r * n / tp_size, (r + 1) * n / tp_size)``.

    Attributes:
        checkpoint_sizes: ``output_sizes``: each shard's rows in a checkpoint (whole, not this rank's).

    Raises:
        ValueError: ``tensor_parallel_size`` does not divide a shard's output size.

    Shapes: ``x [..., input_size] -> [..., sum of this rank's rows]``.
    """

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False,
                 dtype: torch.dtype | None = None, quant_config: QuantizationConfig | None = None,
                 prefix: str = "", shard_slices: list[tuple[int, int]] | None = None) -> None:
        group = get_tp_group()
        if shard_slices is None:
            shard_slices = [(group.rank * size, size) for size in
                            (divide(n, group.world_size, f"the output size of {prefix or 'a layer'}")
                             for n in output_sizes)]
        self.shard_slices = shard_slices
        self.checkpoint_sizes = list(output_sizes)
        local = [size for _, size in shard_slices]
        super().__init__(input_size, sum(local), bias, dtype, quant_config, prefix, output_sizes=local)

    def narrow(self, name: str, tensor: Any, shard: int | None) -> Any:
        """Rows ``shard_slices[shard]`` of a whole ``weight`` or ``bias``."""
        if self.tp_size == 1:
            return tensor
        out_dim, _ = _dense_dims(name)
        start, size = self.shard_slices[shard or 0]
        return tensor.narrow(out_dim, start, size)


class QKVParallelLinear(ColumnParallelLinear):
    """The query, key and value projections stacked (``qkv_proj``) and split by heads: each rank holds
    ``num_heads / tp_size`` query heads and ``max(1, num_kv_heads / tp_size)`` key/value heads. With fewer
    key/value heads than ranks, each is replicated on ``tp_size / num_kv_heads`` ranks, those whose query
    heads read it (grouped-query attention's groups never straddle ranks).

    Args:
        hidden_size: input features.
        head_dim: features per head.
        num_heads, num_kv_heads: the model's query and key/value heads.
        bias, dtype, quant_config, prefix: as :class:`Linear`.

    Attributes:
        num_heads, num_kv_heads: this rank's query and key/value heads.

    Raises:
        ValueError: ``tensor_parallel_size`` divides neither the query heads nor (nor is divided by) the
            key/value heads.

    Shapes: ``x [..., hidden_size] -> [..., (num_heads + 2 * num_kv_heads) * head_dim]`` (this rank's heads).
    """

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool = False,
                 dtype: torch.dtype | None = None, quant_config: QuantizationConfig | None = None,
                 prefix: str = "") -> None:
        group = get_tp_group()
        tp, rank = group.world_size, group.rank
        self.num_heads = divide(num_heads, tp, "num_attention_heads")
        if num_kv_heads % tp and tp % num_kv_heads:
            raise ValueError(f"tensor_parallel_size ({tp}) must divide num_key_value_heads ({num_kv_heads}) or be "
                             f"a multiple of it")
        self.num_kv_heads = max(1, num_kv_heads // tp)
        first_kv = rank * self.num_kv_heads if num_kv_heads >= tp else rank // (tp // num_kv_heads)
        q = (rank * self.num_heads * head_dim, self.num_heads * head_dim)
        kv = (first_kv * head_dim, self.num_kv_heads * head_dim)
        super().__init__(hidden_size, [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim],
                         bias, dtype, quant_config, prefix, shard_slices=[q, kv, kv])


class RowParallelLinear(Linear):
    """A linear whose input features are split across the tensor-parallel ranks: each rank multiplies its slice
    of ``x`` (the output of a column-parallel layer) by its columns of the weight, and the partial outputs
    are summed over the ranks (vLLM's ``RowParallelLinear``). The bias is added once: rank 0 holds it, the
    others hold zeros.

    Args:
        input_size: whole input features (split evenly).
        output_size: output features.
        bias, dtype, quant_config, prefix: as :class:`Linear`.

    Raises:
        ValueError: ``tensor_parallel_size`` does not divide ``input_size``.

    Shapes: ``x [..., input_size / tp_size] -> [..., output_size]`` (the same on every rank).
    """

    def __init__(self, input_size: int, output_size: int, bias: bool = False, dtype: torch.dtype | None = None,
                 quant_config: QuantizationConfig | None = None, prefix: str = "") -> None:
        group = get_tp_group()
        local = divide(input_size, group.world_size, f"the input size of {prefix or 'a layer'}")
        super().__init__(local, output_size, bias, dtype, quant_config, prefix)

    def narrow(self, name: str, tensor: Any, shard: int | None) -> Any:
        """Columns ``[rank * in, (rank + 1) * in)`` of a whole ``weight``; the ``bias`` on rank 0, zeros elsewhere."""
        if self.tp_size == 1:
            return tensor
        _, in_dim = _dense_dims(name)
        if in_dim is None:
            return tensor if self.tp_rank == 0 else torch.zeros_like(tensor)
        return tensor.narrow(in_dim, self.tp_rank * self.input_size, self.input_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's ``x [..., input_size]`` -> the summed ``[..., output_size]``."""
        return tensor_model_parallel_all_reduce(self.quant_method.apply(self, x))
