"""``POST /v1/completions`` (https://platform.openai.com/docs/api-reference/completions)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from kilat.entrypoints.openai.protocol import CompletionRequest
from kilat.entrypoints.openai.serving import (
    APIError,
    ChoiceStream,
    OpenAIServing,
    bad_request,
    clamp_logprob,
    created,
    sse,
    usage,
)
from kilat.outputs import PositionLogprobs, RequestOutput
from kilat.sampling_params import SamplingParams

_FIELDS = set(CompletionRequest.model_fields)


class OpenAIServingCompletion(OpenAIServing):
    """Builds completion responses, whole or streamed."""

    prefix = "cmpl"

    def _logprobs(self, token_ids: list[int], entries: list[PositionLogprobs | None], num_top: int,
                  text_offset: int) -> dict[str, Any]:
        """OpenAI's completions ``logprobs``: tokens, token_logprobs, top_logprobs, text_offset.

        ``entries[i]`` holds the chosen token ``token_ids[i]`` and the top tokens by rank (``None`` for a
        prompt's first token); offsets count characters from ``text_offset``.
        """
        tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
        for token_id, entry in zip(token_ids, entries, strict=False):
            chosen = entry.get(token_id) if entry is not None else None
            text = chosen.decoded_token if chosen is not None and chosen.decoded_token is not None \
                else self.engine.tokenizer.decode([token_id])
            tokens.append(text)
            token_logprobs.append(clamp_logprob(chosen.logprob) if chosen is not None else None)
            top_logprobs.append(None if entry is None else {
                lp.decoded_token: clamp_logprob(lp.logprob)
                for lp in sorted(entry.values(), key=lambda lp: lp.rank) if lp.rank <= num_top})
            offsets.append(text_offset)
            text_offset += len(text)
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
                "text_offset": offsets}

    def _echo_prefix(self, request: CompletionRequest, output: RequestOutput) -> str:
        if not request.echo:
            return ""
        return output.prompt if output.prompt is not None else self.engine.tokenizer.decode(output.prompt_token_ids)

    def _choice_logprobs(self, request: CompletionRequest, output: RequestOutput, index: int,
                         tokens: range, echo: bool) -> dict[str, Any] | None:
        """Logprobs of a choice's tokens in ``tokens``, preceded by the prompt's when ``echo``."""
        if request.logprobs is None:
            return None
        completion = output.outputs[index]
        ids = completion.token_ids[tokens.start:tokens.stop]
        entries: list[PositionLogprobs | None] = list((completion.logprobs or [])[tokens.start:tokens.stop])
        if echo:
            prompt_entries = [None] + list((output.prompt_logprobs or [None])[1:])
            ids = output.prompt_token_ids + ids
            entries = prompt_entries + entries
        return self._logprobs(ids, entries, request.logprobs, 0)

    async def create(self, request: CompletionRequest) -> dict[str, Any] | AsyncIterator[str]:
        """A whole response, or an async iterator of SSE lines when ``stream``.

        Raises:
            APIError: 400 for invalid input, 404 for an unknown model, 500/503 for engine failures.
        """
        model = self.check_model(request.model)
        try:
            prompts = request.prompts()
            params = request.to_sampling_params()
        except ValueError as e:
            raise bad_request(e, _FIELDS) from e
        response_id = self.new_id()
        streams = self.start(response_id, prompts, params, True, _FIELDS)
        if request.stream:
            return self._stream(request, model, response_id, streams, params)
        outputs = await self.final_outputs(streams)
        choices = []
        for p, output in enumerate(outputs):
            prefix = self._echo_prefix(request, output)
            for c in output.outputs:
                logprobs = self._choice_logprobs(request, output, c.index, range(len(c.token_ids)), request.echo)
                choices.append({"index": p * params.n + c.index, "text": prefix + c.text, "logprobs": logprobs,
                                "finish_reason": c.finish_reason, "stop_reason": c.stop_reason})
        return {"id": response_id, "object": "text_completion", "created": created(), "model": model,
                "choices": choices, "usage": usage(outputs)}

    async def _stream(self, request: CompletionRequest, model: str, response_id: str, streams: list[Any],
                      params: SamplingParams) -> AsyncIterator[str]:
        """SSE chunks: per choice, text deltas, then one chunk with its finish reason; then usage, [DONE]."""
        base = {"id": response_id, "object": "text_completion", "created": created(), "model": model}
        if request.include_usage:
            base["usage"] = None
        n = params.n
        states = [[ChoiceStream(params.stop) for _ in range(n)] for _ in streams]
        finals: dict[int, RequestOutput] = {}
        try:
            async for p, output in self.merge(streams):
                finals[p] = output
                for c in output.outputs:
                    state = states[p][c.index]
                    first = state.num_sent_tokens == 0 and not state.finished
                    step = state.next(c)
                    if step is None:
                        continue
                    text, tokens = step
                    echo = request.echo and first
                    prefix = self._echo_prefix(request, output) if echo else ""
                    choice = {"index": p * n + c.index, "text": prefix + text,
                              "logprobs": self._choice_logprobs(request, output, c.index, tokens, echo),
                              "finish_reason": c.finish_reason if state.finished else None,
                              "stop_reason": c.stop_reason if state.finished else None}
                    yield sse({**base, "choices": [choice]})
        except APIError as e:
            yield sse(e.body())
            yield sse("[DONE]")
            return
        if request.include_usage:
            yield sse({**base, "choices": [], "usage": usage([finals[i] for i in sorted(finals)])})
        yield sse("[DONE]")
