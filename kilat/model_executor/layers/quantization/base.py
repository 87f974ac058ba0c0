"""The quantization seam: a method object per linear layer, chosen by a per-model quantization config.

Follows vLLM's quantize methods (``QuantizationConfig.get_quant_method`` → ``LinearMethodBase`` with
``create_weights`` / ``process_weights_after_loading`` / ``apply``). A :class:`LinearMethod` instance belongs to
one layer and keeps that layer's derived state (packed weights); the layer keeps only what the checkpoint
loads into.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import fields
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn

if TYPE_CHECKING:
    from kilat.model_executor.layers.fused_moe.quantized import ExpertQuantMethod
    from kilat.model_executor.layers.linear import Linear
    from kilat.model_executor.layers.quantization.kernels import QuantWeight


def check_bool_option(name: str, value: object) -> None:
    """Refuse a non-boolean ``quantization_config.<name>`` (JSON ``true``/``false``).

    Raises:
        ValueError: naming the option and the value.
    """
    if not isinstance(value, bool):
        raise ValueError(f"quantization_config.{name} must be true or false, got {value!r}")


class LinearMethod(ABC):
    """How one linear layer holds, loads and applies its weight.

    The default :meth:`create_weights` and :meth:`load_weight` hold a dense ``weight [out, in]`` parameter in
    the layer's dtype (methods that quantize at load time keep them and convert in
    :meth:`process_weights_after_loading`); a method whose checkpoint stores something else overrides both.
    """

    def create_weights(self, layer: Linear, dtype: torch.dtype | None) -> None:
        """Register the parameters the checkpoint loads into on ``layer`` (default: dense ``weight``)."""
        layer.weight = nn.Parameter(torch.empty(layer.output_size, layer.input_size, dtype=dtype),
                                    requires_grad=False)

    def load_weight(self, layer: Linear, name: str, tensor: Any, shard: int | None) -> None:
        """Copy the checkpoint tensor ``name`` (``"weight"``, ``"bias"``, ...) into ``layer``, or into rows
        ``shard`` of a fused layer (``layer.output_sizes[shard]`` rows).

        Raises:
            ValueError: no such parameter or a shape mismatch (names the shapes).
        """
        param = getattr(layer, name, None)
        if not isinstance(param, torch.Tensor):
            raise ValueError(f"{type(layer).__name__} has no parameter {name!r}")
        target = param.data
        if shard is not None:
            start = sum(layer.output_sizes[:shard])
            target = target[start:start + layer.output_sizes[shard]]
        if target.shape != tensor.shape:
            where = f"shard {shard} of {name}" if shard is not None else name
            raise ValueError(f"{where}: expected shape {tuple(target.shape)}, got {tuple(tensor.shape)}")
        target.copy_(tensor)

    def process_weights_after_loading(self, layer: Linear) -> None:  # noqa: B027 - optional hook
        """Derive the inference-time weights once every checkpoint tensor is loaded (default: nothing)."""

    @abstractmethod
    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        """``x [..., in] -> x @ W.T + bias [..., out]`` in ``x``'s dtype."""

    def packed_weight(self) -> QuantWeight | None:
        """The layer's whole weight as one packed :class:`QuantWeight` when :meth:`apply` is exactly
        ``kernels.quant_linear(x, weight, layer.bias)`` (what fused kernels may call in its place), else ``None``."""
        return None

    def describe(self) -> str:
        """A short name for start-up logs, e.g. ``"int4 g32"``."""
        return type(self).__name__


class QuantizationConfig(ABC):
    """One quantization method's settings for a model (a dataclass validated on construction in subclasses).

    Attributes:
        name: the registry name (``--quantization``).
        online: whether it quantizes a 16/32-bit checkpoint at load time (``int8``, ``int4``, ``fp8``);
            otherwise it needs a checkpoint stored in its format.
    """

    name: ClassVar[str]
    online: ClassVar[bool] = False

    @classmethod
    def from_options(cls, options: dict[str, Any]) -> QuantizationConfig:
        """Build from user options (``quantization_config`` engine argument) merged over a checkpoint's own
        ``quantization_config``; the default accepts exactly the dataclass's fields.

        Raises:
            ValueError: an unknown key or an invalid value, named.
        """
        names = {f.name for f in fields(cls)}  # type: ignore[arg-type]
        unknown = sorted(set(options) - names)
        if unknown:
            raise ValueError(f"quantization_config: unknown key(s) {unknown} for quantization {cls.name!r}; "
                             f"known: {sorted(names)}")
        return cls(**options)

    @classmethod
    def from_checkpoint(cls, checkpoint: dict[str, Any], options: dict[str, Any]) -> QuantizationConfig:
        """Build from a checkpoint's own ``quantization_config`` (config.json) and the user's ``options``; the
        default merges the options over the checkpoint's settings and calls :meth:`from_options`.

        Raises:
            ValueError: as :meth:`from_options`, or an option the checkpoint's format does not allow.
        """
        return cls.from_options({**checkpoint, **options})

    @property
    def supports_tensor_parallel(self) -> bool:
        """Whether layers under this method can be split across tensor-parallel ranks: those that load a dense
        checkpoint (``weight``, ``bias``) and quantize each rank's slice at load (:attr:`online`) can; methods
        that read their own stored format (GGUF blocks, AWQ/GPTQ packs, fp8 checkpoints) cannot yet."""
        return self.online

    def verify(self, dtype: torch.dtype, device: str) -> None:  # noqa: B027 - optional hook
        """Refuse a model dtype or device the method cannot run in (``ValueError`` naming the field)."""

    @abstractmethod
    def get_linear_method(self, layer: Linear, prefix: str) -> LinearMethod:
        """The method object for the linear layer named ``prefix`` (e.g. ``model.layers.0.mlp.down_proj``)."""

    def get_moe_method(self, prefix: str) -> ExpertQuantMethod | None:
        """The method object for the MoE experts named ``prefix`` (``model.layers.0.mlp.experts``;
        :mod:`kilat.model_executor.layers.fused_moe.quantized`), or ``None`` to leave them unquantized. The default
        refuses: only the online methods quantize experts.

        Raises:
            ValueError: this method has no quantized experts.
        """
        raise ValueError(f"{prefix}: quantization {self.name!r} does not support Mixture-of-Experts layers (the "
                         f"online methods 'int8', 'int4' and 'fp8' do; or run the model unquantized)")
