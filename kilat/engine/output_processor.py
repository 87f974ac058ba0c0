"""Core outputs → :class:`RequestOutput`: detokenization, stop strings, logprob text, ``n > 1`` fan-in."""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Any

from kilat.core.engine_core import EngineCoreOutput
from kilat.core.request import EngineCoreRequest
from kilat.engine.detokenizer import IncrementalDetokenizer
from kilat.outputs import CompletionOutput, PositionLogprobs, RequestMetrics, RequestOutput
from kilat.sampling_params import SamplingParams


@dataclass
class _RequestState:
    output: RequestOutput
    detokenizers: list[IncrementalDetokenizer]
    num_unfinished: int
    core_ids: list[str] = field(default_factory=list)


def _update_metrics(output: RequestOutput, co: EngineCoreOutput, num_new_tokens: int, now: float,
                    finished: bool) -> None:
    """Take (a copy of) the core's timings when it sends them, with the first token and at finish; in
    between, and for a request ended by a stop string here, time the ``num_new_tokens`` tokens kept of
    ``co`` as they arrive (``now``, seconds since the epoch)."""
    if co.metrics is not None:
        output.metrics = replace(co.metrics)
        return
    metrics = output.metrics
    assert metrics is not None
    if num_new_tokens:
        if metrics.first_token_time is None:
            metrics.first_token_time = now
        metrics.last_token_time = now
        metrics.num_generation_tokens += num_new_tokens
    if finished and metrics.finished_time is None:
        metrics.finished_time = now


class OutputProcessor:
    """Keeps the user-visible state of every request in flight.

    Args:
        tokenizer: a transformers tokenizer (for text and logprob tokens), or ``None`` (``skip_tokenizer_init``:
            completions carry token ids and empty text).
    """

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self._states: dict[str, _RequestState] = {}
        self._core_to_parent: dict[str, tuple[str, int]] = {}

    def __len__(self) -> int:
        return len(self._states)

    def add_request(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                    params: SamplingParams, core_requests: list[EngineCoreRequest]) -> None:
        """Start tracking a request and its ``n`` core requests.

        Raises:
            ValueError: the request id is already in flight.
        """
        if request_id in self._states:
            raise ValueError(f"request_id {request_id!r} is already in use")
        completions = [CompletionOutput(index=i, text="", token_ids=[],
                                        logprobs=[] if params.logprobs is not None else None)
                       for i in range(params.n)]
        output = RequestOutput(request_id, prompt, prompt_token_ids, completions, finished=False,
                               metrics=RequestMetrics(core_requests[0].arrival_time,
                                                      num_prompt_tokens=len(prompt_token_ids)))
        detoks = [IncrementalDetokenizer(self.tokenizer, params, prompt_token_ids)
                  for _ in range(params.n)] if self.tokenizer is not None else []
        self._states[request_id] = _RequestState(output, detoks, params.n,
                                                 [r.request_id for r in core_requests])
        for r in core_requests:
            self._core_to_parent[r.request_id] = (request_id, r.index)

    def abort_request(self, request_id: str) -> list[str]:
        """Stop tracking a request; returns its core ids (for the engine core to abort)."""
        state = self._states.pop(request_id, None)
        if state is None:
            return []
        for cid in state.core_ids:
            self._core_to_parent.pop(cid, None)
        return state.core_ids

    def _decode_logprobs(self, entries: list[PositionLogprobs]) -> list[PositionLogprobs]:
        if self.tokenizer is None:
            return entries
        for entry in entries:
            for tid, lp in entry.items():
                lp.decoded_token = self.tokenizer.decode([tid])
        return entries

    def process_outputs(self, core_outputs: list[EngineCoreOutput]) -> tuple[list[RequestOutput], list[str]]:
        """Apply one step's core outputs.

        Returns the updated requests (finished ones leave the processor) and the core ids whose stop
        string matched, which the caller must abort in the engine core.
        """
        updated: dict[str, RequestOutput] = {}
        to_abort: list[str] = []
        now = time.time()
        for co in core_outputs:
            parent = self._core_to_parent.get(co.request_id)
            if parent is None:
                continue
            state = self._states[parent[0]]
            completion = state.output.outputs[parent[1]]
            stop_terminated = co.finish_reason == "stop"
            detok = state.detokenizers[parent[1]] if state.detokenizers else None
            new_token_ids, new_logprobs = co.new_token_ids, co.new_logprobs
            stop_str = None
            if detok is not None:
                num_before = detok.num_tokens
                stop_str = detok.add_tokens(new_token_ids, stop_terminated)
                completion.text = detok.output_text
                # several tokens at once (speculative decoding): none after the one completing a stop string
                new_token_ids = new_token_ids[:detok.num_tokens - num_before]
                new_logprobs = new_logprobs[:len(new_token_ids)] if new_logprobs is not None else None
            completion.token_ids.extend(new_token_ids)
            if new_logprobs is not None and completion.logprobs is not None:
                completion.logprobs.extend(self._decode_logprobs(new_logprobs))
            if co.prompt_logprobs is not None and state.output.prompt_logprobs is None:
                self._decode_logprobs(co.prompt_logprobs[1:])
                state.output.prompt_logprobs = co.prompt_logprobs
            state.output.num_cached_tokens = co.num_cached_tokens
            if co.kv_transfer_params is not None:
                state.output.kv_transfer_params = co.kv_transfer_params
            finish_reason, stop_reason = co.finish_reason, co.stop_reason
            if stop_str is not None:
                if finish_reason is None:
                    to_abort.append(co.request_id)
                finish_reason, stop_reason = "stop", stop_str
            if parent[1] == 0:
                _update_metrics(state.output, co, len(new_token_ids), now, finish_reason is not None)
            if finish_reason is not None:
                completion.finish_reason = finish_reason
                completion.stop_reason = stop_reason
                completion.error = co.error
                state.num_unfinished -= 1
                self._core_to_parent.pop(co.request_id, None)
            updated[parent[0]] = state.output
        for rid, output in updated.items():
            if self._states[rid].num_unfinished == 0:
                output.finished = True
                del self._states[rid]
        return list(updated.values()), to_abort
