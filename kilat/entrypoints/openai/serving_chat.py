"""``POST /v1/chat/completions`` (https://platform.openai.com/docs/api-reference/chat)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

from kilat.engine.async_llm import AsyncLLM, RequestStream
from kilat.entrypoints.openai.protocol import ChatCompletionRequest, TokenizeRequest
from kilat.entrypoints.openai.serving import (
    APIError,
    ChoiceStream,
    EventStream,
    OpenAIServing,
    bad_request,
    clamp_logprob,
    created,
    sse,
    usage,
)
from kilat.outputs import CompletionOutput, Logprob, RequestOutput
from kilat.sampling_params import SamplingParams

_FIELDS = set(ChatCompletionRequest.model_fields)


class OpenAIServingChat(OpenAIServing):
    """Renders the conversation with the model's chat template and builds chat responses.

    Args:
        engine: the running engine.
        served_model_names: names clients may use in ``model``.
        trust_request_chat_template: accept a ``chat_template`` in the request body (it runs on the server).
    """

    prefix = "chatcmpl"

    def __init__(self, engine: AsyncLLM, served_model_names: list[str], trust_request_chat_template: bool = False):
        super().__init__(engine, served_model_names)
        self.trust_request_chat_template = trust_request_chat_template

    def _token_logprob(self, token_id: int, lp: Logprob) -> dict[str, Any]:
        return {"token": lp.decoded_token or "", "logprob": clamp_logprob(lp.logprob),
                "bytes": list(self.token_bytes(token_id))}

    def _logprobs(self, completion: CompletionOutput, tokens: range, num_top: int) -> dict[str, Any] | None:
        """OpenAI's chat ``logprobs``: per token its text, logprob, raw bytes and the top ``num_top``."""
        if completion.logprobs is None:
            return None
        content = []
        for i in tokens:
            entry = completion.logprobs[i]
            token_id = completion.token_ids[i]
            item = self._token_logprob(token_id, entry[token_id])
            item["top_logprobs"] = [self._token_logprob(tid, lp)
                                    for tid, lp in sorted(entry.items(), key=lambda kv: kv[1].rank)
                                    if lp.rank <= num_top]
            content.append(item)
        return {"content": content}

    async def render(self, request: ChatCompletionRequest | TokenizeRequest) -> str:
        """The conversation rendered by the model's chat template (in the tokenizer thread).

        Raises:
            ValueError: malformed messages, a failing template, or a request template that is not trusted.
        """
        template = getattr(request, "chat_template", None)
        if template is not None and not self.trust_request_chat_template:
            raise ValueError("chat_template in the request is not allowed; start the server with "
                             "--trust-request-chat-template to allow it")
        messages = [m.to_template_dict() for m in request.messages or []]
        return await self.engine.in_tokenizer_thread(
            self.engine.input_processor.apply_chat_template, messages, request.add_generation_prompt,
            getattr(request, "continue_final_message", False), template,
            **(getattr(request, "chat_template_kwargs", None) or {}))

    async def create(self, request: ChatCompletionRequest) -> dict[str, Any] | EventStream:
        """A whole response, or an :class:`EventStream` when ``stream``.

        Raises:
            APIError: 400 for invalid input, 404 for an unknown model, 500/503 for engine failures.
        """
        model = self.check_model(request.model)
        try:
            params = request.to_sampling_params()
            prompt = await self.render(request)
        except ValueError as e:
            raise bad_request(e, _FIELDS) from e
        response_id = self.new_id()
        streams = await self.start(response_id, [prompt], params, False, _FIELDS)
        if request.stream:
            return EventStream(self._stream(request, model, response_id, streams[0], params), streams)
        (output,) = await self.final_outputs(streams)
        num_top = request.top_logprobs or 0
        choices = [{"index": c.index, "message": {"role": "assistant", "content": c.text},
                    "logprobs": self._logprobs(c, range(len(c.token_ids)), num_top),
                    "finish_reason": c.finish_reason, "stop_reason": c.stop_reason} for c in output.outputs]
        return {"id": response_id, "object": "chat.completion", "created": created(), "model": model,
                "choices": choices, "usage": usage([output])}

    async def _stream(self, request: ChatCompletionRequest, model: str, response_id: str, stream: RequestStream,
                      params: SamplingParams) -> AsyncIterator[str]:
        """SSE chunks: a role chunk per choice, content deltas, one chunk per choice with its finish reason,
        then usage (when asked) and ``[DONE]``."""
        base: dict[str, Any] = {"id": response_id, "object": "chat.completion.chunk", "created": created(),
                                "model": model}
        if request.include_usage:
            base["usage"] = None
        num_top = request.top_logprobs or 0
        for i in range(params.n):
            yield sse({**base, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                            "logprobs": None, "finish_reason": None}]})
        states = [ChoiceStream(params.stop) for _ in range(params.n)]
        final: RequestOutput | None = None
        try:
            async with contextlib.aclosing(self.merge([stream])) as updates:
                async for _, output in updates:
                    final = output
                    for c in output.outputs:
                        state = states[c.index]
                        step = state.next(c)
                        if step is None:
                            continue
                        text, tokens = step
                        done = state.finished
                        yield sse({**base, "choices": [{
                            "index": c.index, "delta": {"content": text} if text or not done else {},
                            "logprobs": self._logprobs(c, tokens, num_top),
                            "finish_reason": c.finish_reason if done else None,
                            "stop_reason": c.stop_reason if done else None}]})
        except APIError as e:
            yield sse(e.body())
            yield sse("[DONE]")
            return
        if request.include_usage and final is not None:
            yield sse({**base, "choices": [], "usage": usage([final])})
        yield sse("[DONE]")
