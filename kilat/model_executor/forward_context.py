"""The per-step forward context read by attention layers.

The model runner wraps every ``model.forward`` in ``set_forward_context(...)``; each attention layer then
finds the step's :class:`~kilat.model_executor.attention.AttentionMetadata` and its own KV cache here, so
that model code never carries batching details in its signatures (the pattern of vLLM and nano-vllm).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from kilat.model_executor.attention.backends import AttentionBackend
    from kilat.model_executor.attention.metadata import AttentionMetadata
    from kilat.model_executor.attention.plans import StepPlans


@dataclass
class ForwardContext:
    """Everything an attention layer needs for one forward step.

    Attributes:
        attn_metadata: the step's common attention metadata (built once per step).
        kv_caches: one tensor per layer in the layout of the model's ``kv_spec``
            (:mod:`kilat.model_executor.attention.kv_cache`): ``[2, num_blocks, block_size, num_kv_heads, head_dim]``
            in the cache's storage dtype (index 0 keys, 1 values), or an MLA latent cache; layer ``i`` reads and
            writes ``kv_caches[i]``.
        backend: the attention backend to run; ``None`` is the torch reference (see :attr:`attn_backend`).
        fused_kernels: whether RMSNorm, SiLU-and-mul and rotary run as fused Triton kernels
            (:mod:`kilat.model_executor.layers.triton_ops`) instead of their torch formulas.
        kv_scales: for an int8/fp8 cache, one float32 ``[2, num_blocks, block_size, num_kv_heads]`` tensor per
            layer (:mod:`kilat.model_executor.attention.kv_cache`); ``None`` for a cache in the model dtype.
        group_metadata: with several KV-cache groups (:mod:`kilat.core.kv_cache_groups`), each group's metadata
            (its own block table and slot mapping; :attr:`attn_metadata` is group 0's), else ``None``.
        layer_groups: with ``group_metadata``, the group of each KV cache index.
        aux_hidden_state_layers: the decoder layers whose input hidden states (residual stream included) the step
            keeps for a speculative-decoding proposer (EAGLE-3), in vLLM's numbering: ``i`` is the input of layer
            ``i`` (0 the embeddings, ``i > 0`` the output of layer ``i - 1``); empty: none.
        aux_hidden_states: where the model puts them, one ``[T, hidden]`` tensor per entry of
            :attr:`aux_hidden_state_layers` in increasing layer order, filled during the forward.
    """

    attn_metadata: AttentionMetadata
    kv_caches: list[torch.Tensor]
    backend: AttentionBackend | None = None
    fused_kernels: bool = False
    kv_scales: list[torch.Tensor] | None = None
    group_metadata: list[AttentionMetadata] | None = None
    layer_groups: Sequence[int] | None = None
    aux_hidden_state_layers: frozenset[int] = frozenset()
    aux_hidden_states: list[torch.Tensor] = field(default_factory=list)
    _backend_metadata: Any = field(default=None, init=False, repr=False)
    _group_backend_metadata: dict[int, Any] = field(default_factory=dict, init=False, repr=False)
    _step_plans: StepPlans | None = field(default=None, init=False, repr=False)

    @property
    def attn_backend(self) -> AttentionBackend:
        """The backend to run: :attr:`backend`, or the torch reference."""
        if self.backend is not None:
            return self.backend
        from kilat.model_executor.attention.backends import get_attention_backend

        return get_attention_backend("torch")

    @property
    def backend_metadata(self) -> Any:
        """The backend's step metadata, built from :attr:`attn_metadata` by its ``build_metadata`` when the first
        layer asks; every later layer of the step reads the same object."""
        if self._backend_metadata is None:
            self._backend_metadata = self.attn_backend.build_metadata(self.attn_metadata)
        return self._backend_metadata

    def metadata_for(self, layer_idx: int) -> tuple[AttentionMetadata, Any]:
        """The common and backend metadata of the KV cache ``layer_idx`` reads: its KV-cache group's (each built
        once per step), or the step's only ones."""
        if self.group_metadata is None or self.layer_groups is None:
            return self.attn_metadata, self.backend_metadata
        group = self.layer_groups[layer_idx]
        if group not in self._group_backend_metadata:
            self._group_backend_metadata[group] = self.attn_backend.build_metadata(self.group_metadata[group])
        return self.group_metadata[group], self._group_backend_metadata[group]

    @property
    def step_plans(self) -> StepPlans:
        """The step's host plans of the torch attention path (:class:`~kilat.model_executor.attention.plans.
        StepPlans`), for layers that attend in torch whatever the backend (multi-head latent attention): the
        backend's own metadata when it is these plans (the torch backend), else built once when the first layer
        asks."""
        from kilat.model_executor.attention.plans import StepPlans

        if self._step_plans is None:
            metadata = self.backend_metadata if self.attn_backend.name == "torch" else None
            self._step_plans = metadata if isinstance(metadata, StepPlans) else StepPlans(self.attn_metadata)
        return self._step_plans


_current: ForwardContext | None = None


@contextmanager
def set_forward_context(ctx: ForwardContext) -> Iterator[ForwardContext]:
    """Make ``ctx`` the current forward context for the duration of the ``with`` block (re-entrant)."""
    global _current
    previous = _current
    _current = ctx
    try:
        yield ctx
    finally:
        _current = previous


def get_forward_context() -> ForwardContext:
    """Return the current forward context.

    Raises:
        RuntimeError: when called outside ``set_forward_context``.
    """
    if _current is None:
        raise RuntimeError("no forward context is set; wrap model.forward in set_forward_context(...)")
    return _current


def fused_kernels_enabled() -> bool:
    """Whether the current forward step asked for fused Triton kernels (``False`` outside any step)."""
    return _current is not None and _current.fused_kernels
