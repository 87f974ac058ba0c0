"""The unquantized linear method: a dense weight, packed for kilat's CPU kernels or oneDNN in bfloat16."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from kilat.model_executor.layers.quantization import kernels
from kilat.model_executor.layers.quantization.base import LinearMethod
from kilat.model_executor.native import cpu_flags

if TYPE_CHECKING:
    from kilat.model_executor.layers.linear import Linear


def can_pack(dtype: torch.dtype, device: torch.device | str) -> bool:
    """Whether :class:`UnquantizedLinearMethod` packs: CPU, bfloat16, and kilat's 16-bit kernels or oneDNN bf16
    support."""
    if torch.device(device).type != "cpu" or dtype != torch.bfloat16:
        return False
    return _bf16_kernels() or (torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported())


def _bf16_kernels() -> bool:
    """Whether dense bfloat16 weights go to kilat's 16-bit kernels (the ``avx512_bf16`` build's ``vdpbf16ps`` or the
    ``avx2`` build's float32 FMAs on exactly widened weights): built, and not on a CPU with AMX, whose tiles oneDNN's
    bfloat16 GEMM uses (kilat has no AMX code yet; at prefill sizes AMX outruns ``vdpbf16ps`` several times over). On
    AVX2 CPUs torch has no fast bfloat16 matmul: ``F.linear`` in bfloat16 ran 21-31x slower than the 16-bit kernels
    there at one row and 8-12x from 8 rows (docs/benchmarks.md)."""
    ops = kernels.native_ops()
    return ops is not None and ops.has_dense16() and "amx_bf16" not in cpu_flags()


class UnquantizedLinearMethod(LinearMethod):
    """``F.linear`` on the checkpoint's weight in the model dtype.

    On CPU in bfloat16 the weight is replaced after loading by a packed copy: with kilat's 16-bit kernels (the
    ``avx512_bf16`` build on a CPU without AMX, or the ``avx2`` build) a 16-bit
    :class:`~kilat.model_executor.layers.quantization.kernels.QuantWeight`
    (:func:`~kilat.model_executor.layers.quantization.kernels.pack_bf16`), multiplied with ``vdpbf16ps`` (or FMAs on
    AVX2) at every batch size and fused into the decoder-layer op like the quantized weights (a batch-1 decode step
    reads the weights near the memory bandwidth, docs/benchmarks.md); otherwise a oneDNN-blocked copy (the layout
    ``torch.compile``'s CPU backend uses, ~1.3x faster than ``F.linear`` on row-major weights), ``layer.weight``
    then an opaque ``torch._mkldnn`` tensor. A weight shared with another module (tied ``lm_head``) gets its own
    packed copy.

    Attributes:
        packed: whether the weight was packed (either way).
    """

    def __init__(self) -> None:
        self.packed = False
        self._weight: kernels.QuantWeight | None = None

    def process_weights_after_loading(self, layer: Linear) -> None:
        """Pack on CPU bfloat16 (no-op elsewhere, or when already packed)."""
        if self.packed or not can_pack(layer.weight.dtype, layer.weight.device):
            return
        if _bf16_kernels():
            self._weight = kernels.pack_bf16(layer.weight.detach())
            del layer.weight
        else:
            packed = torch.ops.mkldnn._reorder_linear_weight(layer.weight.detach())
            layer.weight = nn.Parameter(packed, requires_grad=False)
        self.packed = True

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        """``x [..., in] -> [..., out]`` in the weight dtype."""
        if self._weight is not None:
            return kernels.quant_linear(x, self._weight, layer.bias)
        if self.packed:
            return torch.ops.mkldnn._linear_pointwise(x, layer.weight, layer.bias, "none", [], "")
        return F.linear(x, layer.weight, layer.bias)

    def packed_weight(self) -> kernels.QuantWeight | None:
        """The 16-bit packed weight (:func:`~kilat.model_executor.layers.quantization.kernels.pack_bf16`), else
        ``None``."""
        return self._weight

    def describe(self) -> str:
        if self._weight is not None:
            return "dense, packed for kilat's 16-bit kernels"
        return "dense, oneDNN-packed" if self.packed else "dense"
