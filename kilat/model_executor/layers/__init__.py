"""Model building blocks: linear, rotary embedding, RMSNorm, SiLU-and-mul, embedding."""

from kilat.model_executor.layers.activation import silu_and_mul
from kilat.model_executor.layers.embedding import VocabEmbedding
from kilat.model_executor.layers.layernorm import RMSNorm
from kilat.model_executor.layers.linear import FusedLinear, Linear, can_pack, pack_linear_weights
from kilat.model_executor.layers.rotary import RotaryEmbedding, apply_rotary, rope_inv_freq, rope_parameters

__all__ = [
    "FusedLinear",
    "Linear",
    "RMSNorm",
    "RotaryEmbedding",
    "VocabEmbedding",
    "apply_rotary",
    "can_pack",
    "pack_linear_weights",
    "rope_inv_freq",
    "rope_parameters",
    "silu_and_mul",
]
