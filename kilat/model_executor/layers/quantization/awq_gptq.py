"""AWQ and GPTQ checkpoints: integer weights packed in int32 words, with per-group scales and zero points.

Both formats are unpacked once at load into the affine group-quantized
:class:`~kilat.model_executor.layers.quantization.kernels.QuantWeight` (``q * scale + zero`` with
``scale = s`` and ``zero = -z * s``, exact in float32) and multiply through
:func:`~kilat.model_executor.layers.quantization.kernels.quant_linear`, the same kernels as ``int4``/``int8``.

Checkpoint tensors of a linear layer (``K`` input features, ``N`` outputs, group size ``G``, ``K`` when the
config says ``-1``; an int32 word holds ``32 / bits`` unsigned values, value ``i`` in bits ``[i*bits, (i+1)*bits)``):

- **AWQ** (AutoAWQ's ``GEMM`` version; ``quant_method: awq``, 4 bits, ``zero_point: true``): ``qweight`` int32
  ``[K, N/8]`` and ``qzeros`` int32 ``[K/G, N/8]`` packed along ``N``, value ``i`` of word ``c`` holding column
  ``8c + AWQ_ORDER[i]`` (order 0, 2, 4, 6, 1, 3, 5, 7); ``scales`` fp16 ``[K/G, N]``. ``w[n, k] = (q - z) * s``
  with ``q, z, s`` taken at ``[k, n]`` / ``[k // G, n]``.
- **GPTQ** (AutoGPTQ, GPTQModel, optimum; ``quant_method: gptq``, 4 or 8 bits): ``qweight`` int32
  ``[K / (32/bits), N]`` packed along ``K`` in order; ``qzeros`` int32 ``[K/G, N / (32/bits)]`` packed along
  ``N`` in order; ``scales`` fp16 ``[K/G, N]``; ``g_idx`` int32 ``[K]``, the group of each input feature. A
  ``checkpoint_format: gptq`` (v1, the default) checkpoint stores ``z - 1`` and readers add 1 back (so a stored
  all-ones value means ``z = 2**bits``, as in the reference kernels); ``gptq_v2`` stores ``z``.
  8-bit values ``0..255`` are stored by the kernels as ``q - 128`` (int8) with ``zero = (128 - z) * s``.

Act order (``desc_act``): ``g_idx`` is then not ``k // G`` but a permutation of it. The input features are
reordered at load so that each group is contiguous (a stable sort by ``g_idx``; every group must hold exactly
``G`` features, as GPTQ makes them), and :meth:`PackedIntLinearMethod.apply` gathers ``x``'s features in the
same order before the matmul: one gather per matmul, and the group-wise kernels stay usable. Shards of a fused
layer (``q``/``k``/``v``, ``gate``/``up``) normally share their input's order; runs of shards with different
orders are multiplied separately and concatenated.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn

from kilat.model_executor.layers.quantization import kernels
from kilat.model_executor.layers.quantization.base import LinearMethod, QuantizationConfig, check_bool_option
from kilat.model_executor.layers.quantization.unquantized import UnquantizedLinearMethod

if TYPE_CHECKING:
    from kilat.model_executor.layers.linear import Linear

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
"""AWQ's interleaving: value ``i`` of a packed word is column ``AWQ_ORDER[i]`` of its 8."""


def unpack_int32(packed: torch.Tensor, bits: int, dim: int, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """The unsigned ``bits``-bit values of int32 words, ``32 / bits`` per word, expanded along ``dim``.

    Args:
        packed: int32 words, any shape.
        bits: 4 or 8.
        dim: the dimension the values were packed along (its size is multiplied by ``32 / bits``).
        order: value ``i`` of a word is element ``order[i]`` of its run (AWQ's :data:`AWQ_ORDER`); ``None``:
            in order.

    Returns:
        int32 values in ``[0, 2**bits)``.
    """
    per_word = 32 // bits
    words = packed.movedim(dim, -1)
    values = torch.stack([(words >> (bits * i)) & ((1 << bits) - 1) for i in range(per_word)], dim=-1)
    if order is not None:
        values = values[..., sorted(range(per_word), key=order.__getitem__)]
    return values.flatten(-2).movedim(-1, dim)


class PackedIntLinearMethod(LinearMethod):
    """Holds an AWQ or GPTQ layer's checkpoint tensors, unpacks them after loading into
    :class:`~kilat.model_executor.layers.quantization.kernels.QuantWeight` (one per run of shards sharing an
    input order) and multiplies through :func:`~kilat.model_executor.layers.quantization.kernels.quant_linear`.

    Args:
        method: ``"awq"`` or ``"gptq"`` (the layout, see the module docstring).
        bits: 4, or 8 for GPTQ.
        group_size: ``G`` (dividing the input size), or -1 for one group per output channel.
        zero_offset: added to stored zero points (1 for GPTQ v1 checkpoints, else 0).

    Attributes:
        parts: after loading, ``(perm, weight)`` per run of shards: ``perm`` the input-feature order (int64
            ``[K]``, ``None`` for the identity) and ``weight`` the packed rows of those shards.
    """

    def __init__(self, method: str, bits: int, group_size: int, zero_offset: int) -> None:
        self.method = method
        self.bits = bits
        self.per_channel = group_size == -1
        self.group_size = group_size
        self.zero_offset = zero_offset
        self.parts: list[tuple[torch.Tensor | None, kernels.QuantWeight]] = []

    @property
    def pack(self) -> int:
        """Values per int32 word."""
        return 32 // self.bits

    def _packed_along_n(self, name: str) -> bool:
        return name == "qzeros" or (name == "qweight" and self.method == "awq")

    def create_weights(self, layer: Linear, dtype: torch.dtype | None) -> None:
        """Register ``qweight``, ``qzeros``, ``scales`` (float32, holding any 16-bit checkpoint scale exactly)
        and, for GPTQ, ``g_idx`` (int32 ``[shards, K]``, one row per shard of a fused layer)."""
        if self.per_channel:
            self.group_size = layer.input_size
        k, n, groups = layer.input_size, layer.output_size, layer.input_size // self.group_size
        shapes = {"qweight": (k, n // self.pack) if self.method == "awq" else (k // self.pack, n),
                  "qzeros": (groups, n // self.pack), "scales": (groups, n)}
        if self.method == "gptq":
            shapes["g_idx"] = (len(layer.output_sizes), k)
        for name, shape in shapes.items():
            held = torch.float32 if name == "scales" else torch.int32
            setattr(layer, name, nn.Parameter(torch.empty(shape, dtype=held), requires_grad=False))

    def load_weight(self, layer: Linear, name: str, tensor: Any, shard: int | None) -> None:
        """Copy ``qweight``/``qzeros``/``scales`` into the shard's columns (``g_idx`` into its row); ``bias``
        and unknown names go to :meth:`LinearMethod.load_weight`.

        Raises:
            ValueError: a shape or dtype that is not the format's (int32 words, float scales, integer g_idx).
        """
        if name not in ("qweight", "qzeros", "scales", "g_idx") or not hasattr(layer, name):
            super().load_weight(layer, name, tensor, shard)
            return
        where = f"{layer.prefix}.{name}" + (f" (shard {shard})" if shard is not None else "")
        ok = (tensor.dtype.is_floating_point if name == "scales"
              else tensor.dtype == torch.int32 or (name == "g_idx" and not tensor.dtype.is_floating_point))
        if not ok:
            raise ValueError(f"{where}: dtype {tensor.dtype} is not {self.method}'s "
                             f"({'float' if name == 'scales' else 'int32'})")
        param = getattr(layer, name).data
        if name == "g_idx":
            target = param[shard or 0]
        else:
            div = self.pack if self._packed_along_n(name) else 1
            start = sum(layer.output_sizes[:shard]) if shard is not None else 0
            target = param[:, start // div:(start + layer.output_sizes[shard or 0]) // div]
        if target.shape != tensor.shape:
            raise ValueError(f"{where}: expected shape {tuple(target.shape)}, got {tuple(tensor.shape)}")
        target.copy_(tensor)

    def process_weights_after_loading(self, layer: Linear) -> None:
        """Unpack into ``q [N, K]``, ``z`` and ``s [N, K/G]``, reorder act-order inputs, pack each run of shards
        for the kernels, and drop the checkpoint tensors.

        Raises:
            ValueError: a ``g_idx`` that is not a grouping of the inputs into groups of ``group_size``.
        """
        if self.parts:
            return
        order = AWQ_ORDER if self.method == "awq" else None
        q = unpack_int32(layer.qweight.data, self.bits, 1 if self.method == "awq" else 0, order).t()
        z = (unpack_int32(layer.qzeros.data, self.bits, 1, order) + self.zero_offset).t().float()
        s = layer.scales.data.t()
        perms = ([self._input_order(layer, i, g) for i, g in enumerate(layer.g_idx.data)] if self.method == "gptq"
                 else [None] * len(layer.output_sizes))
        runs: list[tuple[torch.Tensor | None, int, int]] = []  # (order, first row, end row) of shard runs
        start = 0
        for perm, size in zip(perms, layer.output_sizes, strict=True):
            if runs and _same_order(runs[-1][0], perm):
                runs[-1] = (perm, runs[-1][1], start + size)
            else:
                runs.append((perm, start, start + size))
            start += size
        self.parts = [(perm, self._pack(q[a:b], z[a:b], s[a:b], perm)) for perm, a, b in runs]
        for name in ("qweight", "qzeros", "scales", "g_idx"):
            if hasattr(layer, name):
                delattr(layer, name)

    def _pack(self, q: torch.Tensor, z: torch.Tensor, s: torch.Tensor, perm: torch.Tensor | None
              ) -> kernels.QuantWeight:
        """``(q - z) * s`` (``q [N, K]`` int32 in the checkpoint's input order, ``z``/``s`` float32 ``[N, K/G]``)
        as a :class:`~kilat.model_executor.layers.quantization.kernels.QuantWeight` whose inputs are in order
        ``perm``."""
        if perm is not None:
            q = q[:, perm]
        if self.bits == 4:
            return kernels.pack_weight(q.to(torch.uint8), s, -z * s, bits=4)
        return kernels.pack_weight((q - 128).to(torch.int8), s, (128 - z) * s, bits=8)

    def _input_order(self, layer: Linear, shard: int, g_idx: torch.Tensor) -> torch.Tensor | None:
        """The input order that makes ``g_idx``'s groups contiguous (``None``: already in order)."""
        k = layer.input_size
        expected = torch.arange(k, device=g_idx.device) // self.group_size
        if torch.equal(g_idx, expected.to(g_idx.dtype)):
            return None
        perm = torch.sort(g_idx.long(), stable=True).indices
        if not torch.equal(g_idx[perm].long(), expected):
            raise ValueError(f"{layer.prefix}.g_idx (shard {shard}): every group 0..{k // self.group_size - 1} must "
                             f"hold exactly group_size={self.group_size} input features")
        return perm

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        """``x [..., K]`` (bfloat16/float16/float32) ``-> [..., N]`` in ``x``'s dtype."""
        if not self.parts:
            raise RuntimeError(f"{layer.prefix}: weights are not processed after loading")
        if len(self.parts) == 1:
            perm, weight = self.parts[0]
            return kernels.quant_linear(x if perm is None else x.index_select(-1, perm), weight, layer.bias)
        y = torch.cat([kernels.quant_linear(x if perm is None else x.index_select(-1, perm), weight)
                       for perm, weight in self.parts], dim=-1)
        return y if layer.bias is None else y + layer.bias

    def packed_weight(self) -> kernels.QuantWeight | None:
        """The one part when no input reordering (act-order) precedes it, else ``None``."""
        if len(self.parts) == 1 and self.parts[0][0] is None:
            return self.parts[0][1]
        return None

    def describe(self) -> str:
        group = "per-channel" if self.per_channel else f"g{self.group_size}"
        act_order = " act-order" if any(perm is not None for perm, _ in self.parts) else ""
        return f"{self.method} {self.bits}-bit {group}{act_order}"


def _same_order(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    return (a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))


@dataclass
class PackedIntConfig(QuantizationConfig):
    """What AWQ and GPTQ configs share: settings read from the checkpoint's ``quantization_config``, which
    user options may only restate (the tensors fix the format).

    Attributes:
        bits: bits per weight.
        group_size: input features per scale/zero pair, ``-1`` for one group per output channel; otherwise a
            multiple of 16 (the kernels' granularity) that divides every quantized layer's input size.
    """

    ALIASES: ClassVar[dict[str, str]] = {}
    """Other names a checkpoint uses for a field (e.g. AutoAWQ's ``w_bit``)."""
    BITS: ClassVar[tuple[int, ...]] = (4,)

    bits: int = 4
    group_size: int = 128

    def __post_init__(self) -> None:
        if self.bits not in self.BITS:
            raise ValueError(f"quantization_config.bits must be one of {self.BITS} for {self.name!r} checkpoints, "
                             f"got {self.bits!r}")
        if not (self.group_size == -1 or (isinstance(self.group_size, int) and self.group_size > 0
                                          and self.group_size % 16 == 0)):
            raise ValueError(f"quantization_config.group_size must be -1 (per channel) or a positive multiple of 16, "
                             f"got {self.group_size!r}")

    @classmethod
    def from_checkpoint(cls, checkpoint: dict[str, Any], options: dict[str, Any]) -> QuantizationConfig:
        """Read the fields (and their aliases) from the checkpoint's ``quantization_config``, ignoring the
        quantizer's other metadata (``damp_percent``, ``meta``, ...) but refusing format keys kilat cannot read.

        Raises:
            ValueError: an unsupported format, an unknown option, or an option that differs from the
                checkpoint's value, naming ``quantization_config.<key>``.
        """
        known = {f.name for f in fields(cls)}
        values: dict[str, Any] = {}
        for key, value in checkpoint.items():
            key = cls.ALIASES.get(key, key)
            if key in known:
                if key in values and values[key] != value:
                    raise ValueError(f"quantization_config.{key}: the checkpoint gives both {values[key]!r} and "
                                     f"{value!r}")
                values[key] = value
        cls._refuse_format(checkpoint)
        config = cls.from_options(values)
        for key, value in options.items():
            field = cls.ALIASES.get(key, key)
            restated = cls.from_options({**values, field: value})
            if getattr(restated, field) != getattr(config, field):
                raise ValueError(f"quantization_config.{key}: {value!r} differs from the checkpoint's "
                                 f"{getattr(config, field)!r}; a {cls.name} checkpoint's settings are fixed by its "
                                 "tensors")
        return config

    @classmethod
    def _refuse_format(cls, checkpoint: dict[str, Any]) -> None:  # noqa: B027 - optional hook
        """Raise ``ValueError`` for checkpoint keys that announce a layout kilat does not read."""

    def _skipped(self, prefix: str) -> bool:
        """Whether the checkpoint keeps layer ``prefix`` unquantized (besides ``lm_head``)."""
        return False

    def _zero_offset(self) -> int:
        return 0

    def get_linear_method(self, layer: Linear, prefix: str) -> LinearMethod:
        """The packed method for the decoder's linears; ``lm_head`` (and skipped modules) stay dense.

        Raises:
            ValueError: a group size that does not divide the layer's input size, or sizes the packing cannot
                hold (outputs, or GPTQ's inputs, not a multiple of the values per int32 word).
        """
        if prefix == "lm_head" or self._skipped(prefix):
            return UnquantizedLinearMethod()
        group = layer.input_size if self.group_size == -1 else self.group_size
        if layer.input_size % group:
            raise ValueError(f"quantization_config.group_size {group} does not divide the input size "
                             f"{layer.input_size} of {prefix}")
        pack = 32 // self.bits
        sizes = [*layer.output_sizes, *([layer.input_size] if self.name == "gptq" else [])]
        if any(size % pack for size in sizes):
            raise ValueError(f"{prefix}: sizes {sizes} must be multiples of {pack} for {self.bits}-bit {self.name} "
                             "packing")
        return PackedIntLinearMethod(self.name, self.bits, self.group_size, self._zero_offset())


@dataclass
class AWQConfig(PackedIntConfig):
    """``quant_method: awq``: AutoAWQ's ``GEMM`` checkpoints (4-bit, asymmetric, group-wise).

    Attributes:
        zero_point: must be true (the GEMM format always stores zero points).
        version: AutoAWQ's kernel layout; only ``"gemm"`` (``GEMV`` and other layouts pack differently).
        modules_to_not_convert: module-name parts whose layers the checkpoint keeps unquantized.
    """

    name: ClassVar[str] = "awq"
    ALIASES: ClassVar[dict[str, str]] = {"w_bit": "bits", "q_group_size": "group_size"}

    zero_point: bool = True
    version: str = "gemm"
    modules_to_not_convert: list[str] | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.zero_point is not True:
            raise ValueError(f"quantization_config.zero_point must be true (AWQ GEMM checkpoints store zero "
                             f"points), got {self.zero_point!r}")
        if not isinstance(self.version, str) or self.version.lower() != "gemm":
            raise ValueError(f"quantization_config.version must be 'gemm', got {self.version!r}")
        self.version = "gemm"
        if self.modules_to_not_convert is not None and not (
                isinstance(self.modules_to_not_convert, list)
                and all(isinstance(m, str) for m in self.modules_to_not_convert)):
            raise ValueError("quantization_config.modules_to_not_convert must be a list of module names, "
                             f"got {self.modules_to_not_convert!r}")

    @classmethod
    def _refuse_format(cls, checkpoint: dict[str, Any]) -> None:
        backend = checkpoint.get("backend")
        if backend not in (None, "autoawq"):
            raise ValueError(f"quantization_config.backend must be 'autoawq' (its GEMM layout), got {backend!r}")

    def _skipped(self, prefix: str) -> bool:
        return any(module in prefix for module in self.modules_to_not_convert or [])


@dataclass
class GPTQConfig(PackedIntConfig):
    """``quant_method: gptq``: AutoGPTQ / GPTQModel / optimum checkpoints, 4 or 8 bits.

    Attributes:
        desc_act: act order (the checkpoint's ``g_idx`` says which inputs form each group either way).
        sym: symmetric quantization (the zero points are stored either way).
        checkpoint_format: ``"gptq"`` (v1: stored zero points are ``z - 1``) or ``"gptq_v2"`` (``z``);
            GPTQModel's ``format`` is an alias.
        lm_head: must be false (a quantized ``lm_head`` is not supported).
    """

    name: ClassVar[str] = "gptq"
    ALIASES: ClassVar[dict[str, str]] = {"format": "checkpoint_format"}
    BITS: ClassVar[tuple[int, ...]] = (4, 8)

    desc_act: bool = False
    sym: bool = True
    checkpoint_format: str = "gptq"
    lm_head: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        for key in ("desc_act", "sym"):
            check_bool_option(key, getattr(self, key))
        if self.checkpoint_format not in ("gptq", "gptq_v2"):
            raise ValueError("quantization_config.checkpoint_format must be 'gptq' or 'gptq_v2', "
                             f"got {self.checkpoint_format!r}")
        if self.lm_head is not False:
            raise ValueError(f"quantization_config.lm_head must be false (a quantized lm_head is not supported), "
                             f"got {self.lm_head!r}")

    @classmethod
    def _refuse_format(cls, checkpoint: dict[str, Any]) -> None:
        if checkpoint.get("is_marlin_format"):
            raise ValueError("quantization_config.is_marlin_format: Marlin-packed GPTQ checkpoints are not supported")
        if checkpoint.get("pack_dtype", "int32") != "int32":
            raise ValueError(f"quantization_config.pack_dtype must be 'int32', got {checkpoint['pack_dtype']!r}")
        if checkpoint.get("dynamic"):
            raise ValueError("quantization_config.dynamic: per-module overrides are not supported")

    def _zero_offset(self) -> int:
        return 1 if self.checkpoint_format == "gptq" else 0
