"""Post-load weight processing for all layers."""

from __future__ import annotations

from torch import nn


def process_weights_after_loading(model: nn.Module) -> None:
    """Let every layer derive its inference-time weights once the checkpoint is loaded.

    Calls ``process_weights_after_loading()`` on each submodule that defines it (vLLM's convention), each module
    after its own submodules (so a decoder layer sees its linears' final weights):
    :class:`~kilat.model_executor.layers.linear.Linear` lets its quantization method pack or quantize,
    :class:`~kilat.model_executor.layers.layernorm.RMSNorm` builds its C++ kernels on CPU (or caches its doubled
    weight where they are not used), a Llama decoder layer binds its fused CPU decode kernel.
    """
    seen: set[int] = set()

    def visit(module: nn.Module) -> None:
        if id(module) in seen:
            return
        seen.add(id(module))
        for child in module.children():
            visit(child)
        hook = getattr(module, "process_weights_after_loading", None)
        if hook is not None:
            hook()

    visit(model)
