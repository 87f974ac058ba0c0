"""Rotary position embedding (RoFormer, Su et al., 2021) with HF-exact frequency scaling.

Inverse frequencies come from transformers' ``ROPE_INIT_FUNCTIONS`` (``linear``, ``dynamic``, ``yarn``,
``llama3``, ...) so every scaling variant matches HF bit for bit; cos/sin are precomputed once for all
positions up to ``max_position_embeddings``, in the layout of HF's ``rotate_half`` (two halves, not
interleaved pairs).
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import PretrainedConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from kilat.model_executor.forward_context import fused_kernels_enabled
from kilat.model_executor.layers.cpu_kernels import cpu_layer_ops

LAYER_TYPES = ("full_attention", "sliding_attention")
"""The ``config.layer_types`` values a config may key its RoPE parameters by (transformers 5, Gemma 3)."""


def _keyed_by_layer_type(config: PretrainedConfig) -> bool:
    """Whether ``config.rope_parameters`` holds one set of parameters per layer type (transformers 5)."""
    params = getattr(config, "rope_parameters", None) or {}
    return any(t in params for t in LAYER_TYPES)


def rope_per_layer_type(config: PretrainedConfig) -> bool:
    """Whether the config gives its sliding-window layers their own RoPE: ``rope_parameters`` keyed by layer type
    (transformers 5) or ``rope_local_base_freq`` (Gemma 3 in transformers 4)."""
    return _keyed_by_layer_type(config) or getattr(config, "rope_local_base_freq", None) is not None


def rope_parameters(config: PretrainedConfig, layer_type: str | None = None) -> dict:
    """The config's RoPE parameters (``rope_parameters`` in transformers 5, ``rope_scaling`` before).

    Args:
        layer_type: for a config with RoPE per layer type (:func:`rope_per_layer_type`), the type whose parameters
            to return, ``"full_attention"`` (also for ``None``) or ``"sliding_attention"``; ignored otherwise.
    """
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if _keyed_by_layer_type(config):
        params = params.get(layer_type or "full_attention") or {}
    elif layer_type == "sliding_attention" and getattr(config, "rope_local_base_freq", None) is not None:
        params = {"rope_type": "default", "rope_theta": config.rope_local_base_freq}
    params = dict(params)
    params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    params.setdefault("rope_type", params.get("type", "default"))
    return params


def rope_inv_freq(config: PretrainedConfig, head_dim: int, layer_type: str | None = None
                  ) -> tuple[torch.Tensor, float]:
    """Inverse frequencies, float32 ``[head_dim // 2]``, and the cos/sin scale (``attention_factor``).

    ``default`` RoPE uses ``1 / theta ** (2i / head_dim)``; other types call transformers'
    ``ROPE_INIT_FUNCTIONS[rope_type](config)``. ``dynamic`` NTK scaling is exact up to
    ``max_position_embeddings`` (where HF leaves the frequencies unscaled). ``layer_type``: as
    :func:`rope_parameters`.

    Raises:
        ValueError: for a ``rope_type`` transformers does not know.
    """
    params = rope_parameters(config, layer_type)
    rope_type = params["rope_type"]
    if rope_type == "default":
        exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim
        return 1.0 / (params["rope_theta"] ** exponents), 1.0
    if rope_type not in ROPE_INIT_FUNCTIONS:
        raise ValueError(f"unsupported rope_type {rope_type!r}; known: default, {sorted(ROPE_INIT_FUNCTIONS)}")
    kwargs = {"layer_type": layer_type or "full_attention"} if _keyed_by_layer_type(config) else {}
    device = torch.get_default_device()  # a model built under ``with torch.device("cuda")`` needs them there
    with torch.device("cpu"):  # transformers' functions compute on the CPU whatever the surrounding default
        inv_freq, attention_factor = ROPE_INIT_FUNCTIONS[rope_type](config, torch.device("cpu"), **kwargs)
    return inv_freq.to(device=device, dtype=torch.float32), float(attention_factor)


class RotaryEmbedding(nn.Module):
    """Precomputed cos/sin table; ``forward(positions)`` gathers it once per step for all layers.

    Args:
        head_dim: rotated dimension (the whole head).
        max_position: table length; positions must be ``< max_position``.
        inv_freq: float32 ``[head_dim // 2]`` inverse frequencies.
        attention_scaling: multiplies cos and sin (YaRN's mscale; 1.0 otherwise).
        dtype: table dtype (the model dtype, as HF casts cos/sin to the activations' dtype).
    """

    def __init__(self, head_dim: int, max_position: int, inv_freq: torch.Tensor, attention_scaling: float = 1.0,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        half = head_dim // 2
        freqs = torch.arange(max_position, dtype=torch.float32)[:, None] * inv_freq.to(torch.float32)[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = emb.cos() * attention_scaling
        sin = emb.sin() * attention_scaling
        # rotate_half(x) * sin == roll(x, half) * [-sin_lo, sin_hi]: fold the sign into the table.
        sin[:, :half] = -sin[:, :half]
        self.head_dim = head_dim
        self.cos_sin_cache = nn.Buffer(torch.cat((cos, sin), dim=-1).to(dtype), persistent=False)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Return ``(cos, sin)``, each ``[T, 1, head_dim]`` for int64 ``positions [T]`` (sin sign-folded)."""
        cos_sin = self.cos_sin_cache.index_select(0, positions)[:, None, :]
        return cos_sin[..., :self.head_dim], cos_sin[..., self.head_dim:]

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, max_position={self.cos_sin_cache.shape[0]}"


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [T, num_heads, head_dim]`` by the ``(cos, sin)`` of :meth:`RotaryEmbedding.forward`.

    Equals HF's ``x * cos + rotate_half(x) * sin``: ``rotate_half`` is a roll by ``head_dim // 2`` with the
    sign already folded into ``sin``. On CPU one C++ op (rounding as HF: each product, then their sum, to
    ``x``'s dtype; ``x`` may be a strided view); one Triton kernel when the step asks for fused kernels and
    ``head_dim`` is a power of two.
    """
    if (ops := cpu_layer_ops(x)) is not None:
        return ops.rotary(x, cos, sin)
    head_dim = x.shape[-1]
    if fused_kernels_enabled() and head_dim & (head_dim - 1) == 0:
        from kilat.model_executor.layers import triton_ops

        return triton_ops.apply_rotary(x, cos, sin)
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, dims=-1), sin)
