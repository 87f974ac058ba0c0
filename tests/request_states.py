"""The model runner's request states (:class:`CachedRequestState`) for tests of sampling, verification and
proposers, built as the runner builds them: from a request's first scheduling."""

from __future__ import annotations

from kilat.core.scheduler_output import NewRequestData
from kilat.model_executor.request_state import CachedRequestState
from kilat.sampling_params import SamplingParams


def make_state(rid: str, prompt: list[int], params: SamplingParams, eos_token_id: int | None = None,
               index: int = 0, output: list[int] | None = None) -> CachedRequestState:
    """A request state with ``output`` tokens already sampled (its KV computed up to the last one)."""
    state = CachedRequestState(NewRequestData(rid, prompt, params, eos_token_id, index, [[]], 0))
    state.append_tokens(list(output or []))
    state.num_computed_tokens = state.num_tokens - 1 if output else 0
    return state
