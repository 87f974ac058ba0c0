"""Model building blocks: linear layers whole or tensor-parallel (with their quantization methods), rotary
embedding, RMSNorm, SiLU-and-mul, the vocabulary-parallel embedding and LM head, the fused CPU decoder layer."""

from kilat.model_executor.layers.activation import gelu_tanh_and_mul, silu_and_mul
from kilat.model_executor.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from kilat.model_executor.layers.fused_decoder import FusedDecoderLayer, FusedStep, fused_step
from kilat.model_executor.layers.layernorm import GemmaRMSNorm, RMSNorm
from kilat.model_executor.layers.linear import ColumnParallelLinear, Linear, QKVParallelLinear, RowParallelLinear
from kilat.model_executor.layers.quantization import QuantizationConfig, can_pack
from kilat.model_executor.layers.rotary import RotaryEmbedding, apply_rotary, rope_inv_freq, rope_parameters
from kilat.model_executor.layers.weights import process_weights_after_loading

__all__ = [
    "ColumnParallelLinear",
    "FusedDecoderLayer",
    "FusedStep",
    "GemmaRMSNorm",
    "Linear",
    "ParallelLMHead",
    "QKVParallelLinear",
    "QuantizationConfig",
    "RMSNorm",
    "RotaryEmbedding",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "apply_rotary",
    "can_pack",
    "fused_step",
    "gelu_tanh_and_mul",
    "process_weights_after_loading",
    "rope_inv_freq",
    "rope_parameters",
    "silu_and_mul",
]
