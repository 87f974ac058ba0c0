"""Random (dummy) weights, for benchmarking shapes whose checkpoints are not available."""

from __future__ import annotations

import torch
from torch import nn

# HF config dicts of named presets (published model shapes).
DUMMY_PRESETS: dict[str, dict] = {
    "smollm2-135m": {
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 49152,
        "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9,
        "num_key_value_heads": 3, "head_dim": 64, "max_position_embeddings": 8192, "rms_norm_eps": 1e-5,
        "rope_theta": 100000.0, "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2,
    },
    "llama-3-8b": {
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 128256,
        "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
        "num_key_value_heads": 8, "head_dim": 128, "max_position_embeddings": 8192, "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0, "tie_word_embeddings": False, "bos_token_id": 128000, "eos_token_id": 128001,
    },
    "llama-3-70b": {
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 128256,
        "hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80, "num_attention_heads": 64,
        "num_key_value_heads": 8, "head_dim": 128, "max_position_embeddings": 8192, "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0, "tie_word_embeddings": False, "bos_token_id": 128000, "eos_token_id": 128001,
    },
}
# Presets whose tokenizer is available offline (a model name for ``resolve_model_source``).
PRESET_TOKENIZERS = {"smollm2-135m": "smollm2-135m-instruct"}


@torch.no_grad()
def init_dummy_weights(model: nn.Module, seed: int = 0, std: float = 0.02) -> None:
    """Fill ``model``'s parameters with seeded random values: norm weights 1, everything else N(0, std).

    A small ``std`` keeps activations and logits finite through any depth.
    """
    generator = None
    for name, param in model.named_parameters():
        if generator is None:
            generator = torch.Generator(device=param.device).manual_seed(seed)
        if "norm" in name:
            param.fill_(1.0)
        else:
            param.normal_(0.0, std, generator=generator)
