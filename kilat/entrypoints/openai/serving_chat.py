"""``POST /v1/chat/completions`` (https://platform.openai.com/docs/api-reference/chat)."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import AsyncIterator
from typing import Any

from kilat.core.reasoning import REASONING_KEY, reasoning_token_count
from kilat.engine.async_llm import AsyncLLM, RequestStream
from kilat.entrypoints.openai.chat_template_worker import ChatTemplateWorker, RendererUnavailable
from kilat.entrypoints.openai.protocol import ChatCompletionRequest, TokenizeRequest
from kilat.entrypoints.openai.reasoning import ReasoningParser, ReasoningStream
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
from kilat.entrypoints.openai.tool_calls import ToolPlan, plan_tools, tools_system_prompt
from kilat.outputs import CompletionOutput, Logprob, RequestOutput
from kilat.sampling_params import SamplingParams
from kilat.structured_outputs.limits import check_limits_for

_FIELDS = set(ChatCompletionRequest.model_fields)


class OpenAIServingChat(OpenAIServing):
    """Renders the conversation with the model's chat template and builds chat responses.

    Args:
        engine: the running engine.
        served_model_names: names clients may use in ``model``.
        trust_request_chat_template: accept a ``chat_template`` in the request body (it runs on the server).
        tool_call_parser: the parser of ``tool_choice: "auto"`` outputs (see :mod:`.tool_calls`), or ``None``.
        reasoning_parser: splits outputs into reasoning and answer (see :mod:`.reasoning`), or ``None``.
    """

    prefix = "chatcmpl"

    def __init__(self, engine: AsyncLLM, served_model_names: list[str], trust_request_chat_template: bool = False,
                 tool_call_parser: str | None = None, reasoning_parser: ReasoningParser | None = None):
        super().__init__(engine, served_model_names)
        self.trust_request_chat_template = trust_request_chat_template
        self.tool_call_parser = tool_call_parser
        self.reasoning_parser = reasoning_parser
        # the end tag's standalone token ids, for the engine's thinking phase and the usage count (kilat.core.reasoning)
        self._reasoning_end_ids = engine.tokenizer.encode(reasoning_parser.end, add_special_tokens=False) \
            if reasoning_parser is not None and engine.tokenizer is not None else []
        self._template_worker: ChatTemplateWorker | None = None

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

    async def render(self, request: ChatCompletionRequest | TokenizeRequest,
                     tools: list[dict[str, Any]] | None = None) -> str:
        """The conversation rendered by the chat template, with ``tools`` (function definitions): passed to
        a template that uses them, else described in a system message.

        The model's template renders in the tokenizer thread; a request's own ``chat_template`` (only with
        ``trust_request_chat_template``) in the :class:`ChatTemplateWorker` child, bounded in time and memory.

        Raises:
            ValueError: malformed messages, reserved ``chat_template_kwargs``, a failing, slow or oversized
                template, or a request template that is not trusted.
            APIError: a 503 when the request-template renderer cannot start or is busy.
        """
        template = request.chat_template
        if template is not None and not self.trust_request_chat_template:
            raise ValueError("chat_template in the request is not allowed; start the server with "
                             "--trust-request-chat-template to allow it")
        processor = self.engine.input_processor
        messages = [m.to_template_dict() for m in request.messages or []]
        template_tools = None
        if tools:
            if "tools" in str(template or processor.tokenizer.chat_template or ""):
                template_tools = [{"type": "function", "function": f} for f in tools]
            elif messages and messages[0]["role"] == "system":
                messages[0] = {**messages[0], "content": f"{messages[0]['content']}\n\n{tools_system_prompt(tools)}"}
            else:
                messages.insert(0, {"role": "system", "content": tools_system_prompt(tools)})
        args = (messages, request.add_generation_prompt, request.continue_final_message, template, template_tools,
                request.chat_template_kwargs)
        if template is None:
            return await self.engine.in_tokenizer_thread(processor.apply_chat_template, *args)
        if self._template_worker is None:  # pickles the tokenizer: in its thread, which nothing else then uses
            worker = await self.engine.in_tokenizer_thread(ChatTemplateWorker, processor.tokenizer,
                                                           processor.max_prompt_chars)
            self._template_worker = self._template_worker or worker
        try:
            return await self._template_worker.render(processor.chat_template_call(*args))
        except RendererUnavailable as e:
            raise APIError(503, str(e), "server_error", param="chat_template", headers={"Retry-After": "5"}) from e

    async def close(self) -> None:
        """Kill the request-template renderer process, if one runs."""
        if self._template_worker is not None:
            await self._template_worker.close()

    def _plan(self, request: ChatCompletionRequest, params: SamplingParams) -> tuple[ToolPlan | None, SamplingParams]:
        """The request's tool plan, and its sampling parameters with the plan's constraint.

        Raises:
            ValueError: invalid tools or tool_choice, or a constraining tool_choice with response_format.
        """
        plan = plan_tools(request.tools, request.tool_choice, request.parallel_tool_calls, self.tool_call_parser)
        constraint = plan.constraint() if plan is not None else None
        if constraint is None:
            return plan, params
        check_limits_for(constraint, "tools (the JSON schema of the calls they allow)")
        if params.structured_outputs is not None:
            raise ValueError("tool_choice 'required' or a named function cannot be combined with "
                             "response_format or structured_outputs")
        return plan, dataclasses.replace(params, structured_outputs=constraint)

    def _reasoning(self, request: ChatCompletionRequest) -> ReasoningParser | None:
        """The parser that splits this request's outputs, or ``None``."""
        parser = self.reasoning_parser
        return parser if parser is not None and parser.applies(request.chat_template_kwargs) else None

    def _with_reasoning(self, request: ChatCompletionRequest, params: SamplingParams) -> SamplingParams:
        """``params`` marked for the engine's thinking phase (:mod:`kilat.core.reasoning`: the end tag's ids and
        the thinking budget) when a reasoning parser splits this request.

        Raises:
            ValueError: a thinking budget without a reasoning parser, or an invalid one (naming the field).
        """
        budget = request.thinking_tokens
        parser = self._reasoning(request)
        if parser is None:
            if budget is not None:
                raise ValueError("thinking_token_budget needs a server started with --reasoning-parser (and a "
                                 "request it applies to)")
            return params
        spec = {"end_token_ids": self._reasoning_end_ids, "thinking_token_budget": budget}
        return dataclasses.replace(params, extra_args={**(params.extra_args or {}), REASONING_KEY: spec})

    def _usage(self, request: ChatCompletionRequest, outputs: list[RequestOutput]) -> dict[str, Any]:
        """:func:`usage`, with ``completion_tokens_details.reasoning_tokens`` (the output tokens before the end
        tag's ids, as the engine counts them) when a reasoning parser splits this request."""
        result = usage(outputs)
        if self._reasoning(request) is not None:
            result["completion_tokens_details"] = {"reasoning_tokens": sum(
                reasoning_token_count(c.token_ids, self._reasoning_end_ids) for o in outputs for c in o.outputs)}
        return result

    def _message(self, request: ChatCompletionRequest, plan: ToolPlan | None, completion: CompletionOutput
                 ) -> tuple[dict[str, Any], str | None]:
        """The assistant message of a finished choice (content, with a reasoning parser ``reasoning_content`` and
        ``reasoning``, and ``tool_calls``, parsed from the answer only) and its finish reason (``tool_calls`` when
        the model called tools)."""
        parser = self._reasoning(request)
        reasoning, answer = parser.split(completion.text) if parser is not None else (None, completion.text)
        content, calls = plan.extract(answer, self.tool_call_parser) if plan and answer is not None else (answer, [])
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if parser is not None:
            message |= {"reasoning_content": reasoning or None, "reasoning": reasoning or None}
        if not calls:
            return message, completion.finish_reason
        message["tool_calls"] = [c.to_openai() for c in calls]
        return message, "tool_calls" if completion.finish_reason == "stop" else completion.finish_reason

    async def create(self, request: ChatCompletionRequest) -> dict[str, Any] | EventStream:
        """A whole response, or an :class:`EventStream` when ``stream``.

        Raises:
            APIError: 400 for invalid input, 404 for an unknown model, 500/503 for engine failures.
        """
        model = self.check_model(request.model)
        try:
            plan, params = self._plan(request, self._with_reasoning(request, request.to_sampling_params()))
            prompt = await self.render(request, plan.tools if plan is not None and plan.choice != "none" else None)
        except ValueError as e:
            raise bad_request(e, _FIELDS) from e
        response_id = self.new_id()
        streams = await self.start(response_id, [prompt], params, False, _FIELDS, request.cache_salt,
                                   request.priority)
        if request.stream:
            if plan is not None and plan.choice != "none":
                return EventStream(self._stream_tools(request, model, response_id, streams[0], plan), streams)
            return EventStream(self._stream(request, model, response_id, streams[0], params), streams)
        (output,) = await self.final_outputs(streams)
        num_top = request.top_logprobs or 0
        choices = []
        for c in output.outputs:
            message, finish_reason = self._message(request, plan, c)
            choices.append({"index": c.index, "message": message,
                            "logprobs": self._logprobs(c, range(len(c.token_ids)), num_top),
                            "finish_reason": finish_reason, "stop_reason": c.stop_reason})
        return {"id": response_id, "object": "chat.completion", "created": created(), "model": model,
                "choices": choices, "usage": self._usage(request, [output]), **kv_transfer_fields([output])}

    async def _stream_tools(self, request: ChatCompletionRequest, model: str, response_id: str,
                            stream: RequestStream, plan: ToolPlan) -> AsyncIterator[str]:
        """SSE chunks of a request that may call tools: a role chunk per choice, then, once the output is
        complete (a call is known only when its JSON is whole), one chunk per choice with its content and
        ``tool_calls`` deltas and its finish reason; then usage (when asked) and ``[DONE]``."""
        base: dict[str, Any] = {"id": response_id, "object": "chat.completion.chunk", "created": created(),
                                "model": model}
        if request.include_usage:
            base["usage"] = None
        for i in range(request.n):
            yield sse({**base, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                            "logprobs": None, "finish_reason": None}]})
        try:
            (final,) = await self.final_outputs([stream])
        except APIError as e:
            yield sse(e.body())
            yield sse("[DONE]")
            return
        for c in final.outputs:
            message, finish_reason = self._message(request, plan, c)
            delta: dict[str, Any] = {k: message[k] for k in ("reasoning_content", "reasoning", "content")
                                     if message.get(k)}
            if "tool_calls" in message:
                delta["tool_calls"] = [{**call, "index": i} for i, call in enumerate(message["tool_calls"])]
            yield sse({**base, "choices": [{"index": c.index, "delta": delta, "logprobs": None,
                                            "finish_reason": finish_reason, "stop_reason": c.stop_reason}]})
        if request.include_usage:
            yield sse({**base, "choices": [], "usage": self._usage(request, [final])})
        yield sse("[DONE]")

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
        parser = self._reasoning(request)
        splits = [ReasoningStream(parser) for _ in range(params.n)] if parser is not None else None
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
                        delta = _delta(text, done, splits[c.index] if splits is not None else None)
                        if delta is None and not request.logprobs:  # text held back, no logprobs to send
                            continue
                        yield sse({**base, "choices": [{
                            "index": c.index, "delta": delta or {},
                            "logprobs": self._logprobs(c, tokens, num_top),
                            "finish_reason": c.finish_reason if done else None,
                            "stop_reason": c.stop_reason if done else None}]})
        except APIError as e:
            yield sse(e.body())
            yield sse("[DONE]")
            return
        if request.include_usage and final is not None:
            yield sse({**base, "choices": [], "usage": self._usage(request, [final])})
        yield sse("[DONE]")


def _delta(text: str, done: bool, split: ReasoningStream | None) -> dict[str, Any] | None:
    """A streamed chunk's ``delta`` for the choice's next ``text`` (``done``: its last): ``content``, or with a
    reasoning parser ``reasoning_content`` and ``reasoning`` and, past the end tag, ``content``; ``{}`` for the
    last chunk with nothing new, ``None`` for a chunk with nothing to send (text held back as a possible tag)."""
    if split is None:
        return {"content": text} if text or not done else {}
    reasoning, content = split.next(text, done)
    delta: dict[str, Any] = {"reasoning_content": reasoning, "reasoning": reasoning} if reasoning else {}
    if content:
        delta["content"] = content
    return delta if delta or done else None
