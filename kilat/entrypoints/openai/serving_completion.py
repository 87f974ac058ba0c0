"""``POST /v1/completions`` (https://platform.openai.com/docs/api-reference/completions)."""

from __future__ import annotations

import codecs
import contextlib
from collections.abc import AsyncIterator
from typing import Any

from kilat.engine.async_llm import RequestStream
from kilat.entrypoints.openai.protocol import CompletionRequest
from kilat.entrypoints.openai.serving import (
    APIError,
    ChoiceStream,
    EventStream,
    OpenAIServing,
    bad_request,
    clamp_logprob,
    created,
    kv_transfer_fields,
    sse,
    usage,
)
from kilat.outputs import PositionLogprobs, RequestOutput
from kilat.sampling_params import SamplingParams

_FIELDS = set(CompletionRequest.model_fields)


class _TextOffsets:
    """Character offsets of consecutive tokens in a choice's text, from the tokens' raw bytes: a token that
    ends inside a multi-byte character does not advance the offset until the character is complete."""

    def __init__(self) -> None:
        self.chars = 0
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def advance(self, token_bytes: bytes) -> int:
        """The offset of the next token (characters), given its bytes."""
        offset = self.chars
        self.chars += len(self._decoder.decode(token_bytes))
        return offset


class OpenAIServingCompletion(OpenAIServing):
    """Builds completion responses, whole or streamed."""

    def _logprobs(self, token_ids: list[int], entries: list[PositionLogprobs | None], num_top: int,
                  offsets_state: _TextOffsets) -> dict[str, Any]:
        """OpenAI's completions ``logprobs``: tokens, token_logprobs, top_logprobs, text_offset.

        ``entries[i]`` holds the chosen token ``token_ids[i]`` and the top tokens by rank (``None`` for a
        prompt's first token); offsets continue from ``offsets_state``.
        """
        tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
        for token_id, entry in zip(token_ids, entries, strict=True):
            chosen = entry.get(token_id) if entry is not None else None
            text = chosen.decoded_token if chosen is not None and chosen.decoded_token is not None \
                else self.engine.tokenizer.decode([token_id])
            tokens.append(text)
            token_logprobs.append(clamp_logprob(chosen.logprob) if chosen is not None else None)
            top_logprobs.append(None if entry is None else {
                lp.decoded_token: clamp_logprob(lp.logprob)
                for lp in sorted(entry.values(), key=lambda lp: lp.rank) if lp.rank <= num_top})
            offsets.append(offsets_state.advance(self.token_bytes(token_id)))
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
                "text_offset": offsets}

    def _echo_prefix(self, request: CompletionRequest, output: RequestOutput) -> str:
        if not request.echo:
            return ""
        return output.prompt if output.prompt is not None else self.engine.tokenizer.decode(output.prompt_token_ids)

    def _choice_logprobs(self, request: CompletionRequest, output: RequestOutput, index: int,
                         tokens: range, echo: bool, offsets: _TextOffsets) -> dict[str, Any] | None:
        """Logprobs of a choice's tokens in ``tokens``, preceded by the prompt's when ``echo``."""
        if request.logprobs is None:
            return None
        completion = output.outputs[index]
        ids = completion.token_ids[tokens.start:tokens.stop]
        entries: list[PositionLogprobs | None] = list((completion.logprobs or [])[tokens.start:tokens.stop])
        if echo:
            ids = output.prompt_token_ids + ids
            entries = [None, *(output.prompt_logprobs or [None] * len(output.prompt_token_ids))[1:], *entries]
        return self._logprobs(ids, entries, request.logprobs, offsets)

    async def create(self, request: CompletionRequest) -> dict[str, Any] | EventStream:
        """A whole response, or an :class:`EventStream` when ``stream``.

        Raises:
            APIError: 400 for invalid input, 404 for an unknown model, 500/503 for engine failures.
        """
        model = self.check_model(request.model)
        try:
            prompts = request.prompts()
            params = request.to_sampling_params()
            if request.kv_transfer_params is not None and len(prompts) > 1:
                raise ValueError(f"kv_transfer_params takes one prompt per request, got {len(prompts)}")
        except ValueError as e:
            raise bad_request(e, _FIELDS) from e
        response_id = self.new_id()
        streams = await self.start(response_id, prompts, params, True, _FIELDS, request.cache_salt,
                                   request.priority)
        if request.stream:
            return EventStream(self._stream(request, model, response_id, streams, params), streams)
        outputs = await self.final_outputs(streams)
        choices = []
        for p, output in enumerate(outputs):
            prefix = self._echo_prefix(request, output)
            for c in output.outputs:
                generated = range(0 if request.scores_only else len(c.token_ids))
                choices.append({
                    "index": p * params.n + c.index,
                    "text": prefix + ("" if request.scores_only else c.text),
                    "logprobs": self._choice_logprobs(request, output, c.index, generated, request.echo,
                                                      _TextOffsets()),
                    "finish_reason": c.finish_reason, "stop_reason": c.stop_reason})
        return {"id": response_id, "object": "text_completion", "created": created(), "model": model,
                "choices": choices, "usage": usage(outputs, not request.scores_only),
                **kv_transfer_fields(outputs)}

    async def _stream(self, request: CompletionRequest, model: str, response_id: str,
                      streams: list[RequestStream], params: SamplingParams) -> AsyncIterator[str]:
        """SSE chunks: per choice, text deltas, then one chunk with its finish reason; then usage, [DONE]."""
        base: dict[str, Any] = {"id": response_id, "object": "text_completion", "created": created(),
                                "model": model}
        if request.include_usage:
            base["usage"] = None
        n = params.n
        states = [[ChoiceStream(params.stop) for _ in range(n)] for _ in streams]
        offsets = [[_TextOffsets() for _ in range(n)] for _ in streams]
        finals: dict[int, RequestOutput] = {}
        try:
            async with contextlib.aclosing(self.merge(streams)) as updates:
                async for p, output in updates:
                    finals[p] = output
                    for c in output.outputs:
                        state = states[p][c.index]
                        echo = request.echo and state.num_sent_tokens == 0
                        step = state.next(c)
                        if step is None:
                            continue
                        text, tokens = step
                        if request.scores_only:
                            text, tokens = "", range(0)
                        prefix = self._echo_prefix(request, output) if echo else ""
                        logprobs = self._choice_logprobs(request, output, c.index, tokens, echo, offsets[p][c.index])
                        yield sse({**base, "choices": [{
                            "index": p * n + c.index, "text": prefix + text, "logprobs": logprobs,
                            "finish_reason": c.finish_reason if state.finished else None,
                            "stop_reason": c.stop_reason if state.finished else None}]})
        except APIError as e:
            yield sse(e.body())
            yield sse("[DONE]")
            return
        if request.include_usage:
            yield sse({**base, "choices": [], "usage": usage([finals[i] for i in sorted(finals)],
                                                             not request.scores_only)})
        yield sse("[DONE]")
