"""What the completions and chat endpoints share: model check, request start, stream merging, streamed
deltas, usage, errors, and Server-Sent Events (https://platform.openai.com/docs/api-reference/streaming)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from kilat.engine.async_llm import AsyncLLM, RequestStream
from kilat.engine.core_client import EngineDeadError
from kilat.engine.detokenizer import TextDelta
from kilat.engine.input_processor import PromptType, prompt_with
from kilat.engine.tokenizer import TokenBytes
from kilat.outputs import CompletionOutput, RequestError, RequestOutput
from kilat.sampling_params import SamplingParams

MIN_LOGPROB = -9999.0
"""JSON has no infinity: log-probabilities below this are sent as this value (as vLLM does)."""


class APIError(Exception):
    """An error for the client, rendered as OpenAI's ``{"error": {...}}`` with an HTTP status.

    Args:
        status: HTTP status code (400, 401, 404, 413, 500, 503).
        message: human-readable explanation.
        type: OpenAI error type (``invalid_request_error``, ``authentication_error``, ``server_error``).
        param: the request field at fault, if known.
        code: a short machine-readable code, if any.
        headers: extra response headers (``Allow`` on a 405, ``WWW-Authenticate`` on a 401).
    """

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers

    def body(self) -> dict[str, Any]:
        """The JSON body."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(error: ValueError, fields: set[str]) -> APIError:
    """A 400 for a ``ValueError`` from validation; ``param`` is the field its message starts with (the
    prompt is ``messages`` in a chat request)."""
    message = str(error)
    match = re.match(r"[a-z_]+", message)
    word = match.group(0) if match else ""
    if word in ("prompt", "prompt_token_ids"):
        word = "prompt" if "prompt" in fields else "messages"
    param = word if word in fields else None
    return APIError(400, message, param=param)


def engine_unavailable(reason: str) -> APIError:
    """A 503 for a request the engine cannot serve now (its core died, or is restarting): clients may retry
    after ``Retry-After`` seconds."""
    return APIError(503, f"the engine is not running: {reason}", "server_error", headers={"Retry-After": "5"})


def request_failed(error: RequestError) -> APIError:
    """The error for a request the engine ended with finish reason ``abort`` and ``error``: 400 naming
    ``structured_outputs`` when its constraint is at fault (``error.client_error``), else 500."""
    if error.client_error:
        return APIError(400, error.message, param="structured_outputs")
    return APIError(500, f"the engine failed this request: {error.message}", "server_error")


def clamp_logprob(value: float) -> float:
    """A JSON-safe log-probability."""
    return max(value, MIN_LOGPROB)


def sse(data: dict[str, Any] | str) -> str:
    """One Server-Sent Event carrying ``data`` (a JSON object, or the literal ``[DONE]``)."""
    return f"data: {data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)}\n\n"


def usage(outputs: list[RequestOutput], count_completions: bool = True) -> dict[str, Any]:
    """OpenAI ``usage`` over every prompt and every choice (tokens); ``count_completions=False`` when the
    generated tokens are not returned (prompt scoring)."""
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    completion = sum(len(c.token_ids) for o in outputs for c in o.outputs) if count_completions else 0
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(o.num_cached_tokens for o in outputs)}}


class ChoiceStream:
    """What one choice has sent so far in a streamed response.

    Args:
        stop: the request's stop strings (text that might grow into one is held back).
    """

    def __init__(self, stop: list[str]):
        self._text = TextDelta(stop)
        self.num_sent_tokens = 0
        self.finished = False

    def next(self, completion: CompletionOutput) -> tuple[str, range] | None:
        """The next chunk's text and the token positions it covers, or ``None`` when there is nothing to
        send. The chunk that carries the finish reason is returned exactly once, and nothing after it."""
        if self.finished:
            return None
        done = completion.finish_reason is not None
        text = self._text.next(completion.text, done)
        if not text and not done:
            return None
        tokens = range(self.num_sent_tokens, len(completion.token_ids))
        self.num_sent_tokens = len(completion.token_ids)
        self.finished = done
        return text, tokens


class OpenAIServing:
    """Base of the endpoint handlers.

    Args:
        engine: the running engine.
        served_model_names: names clients may use in ``model``; the first is reported back.
    """

    prefix = "cmpl"
    """Response id prefix."""

    def __init__(self, engine: AsyncLLM, served_model_names: list[str]):
        self.engine = engine
        self.served_model_names = served_model_names
        self.token_bytes = TokenBytes(engine.tokenizer)

    def check_model(self, model: str | None) -> str:
        """The model name to report; ``None`` means the default.

        Raises:
            APIError: 404 for a model this server does not serve.
        """
        if model is None:
            return self.served_model_names[0]
        if model not in self.served_model_names:
            raise APIError(404, f"The model `{model}` does not exist; this server serves "
                                f"{self.served_model_names}", param="model", code="model_not_found")
        return model

    def new_id(self) -> str:
        """A response id such as ``cmpl-<32 hex digits>``."""
        return f"{self.prefix}-{uuid.uuid4().hex}"

    async def start(self, response_id: str, prompts: list[PromptType], params: SamplingParams,
                    add_special_tokens: bool, fields: set[str], cache_salt: str | None = None,
                    priority: int = 0) -> list[RequestStream]:
        """Queue one engine request per prompt (each with ``priority`` and ``cache_salt``, vLLM's request fields:
        its rank under the ``priority`` scheduling policy, and a salt so that its prefix-cache
        blocks are shared only with requests of the same salt), all validated before any is queued.

        Raises:
            APIError: 400 for an invalid prompt or parameter (the message names it and its limit),
                503 when the engine is not running.
        """
        try:
            return await self.engine.add_requests(
                [(f"{response_id}-{i}", prompt_with(p, cache_salt=cache_salt, priority=priority or None))
                 for i, p in enumerate(prompts)], params,
                add_special_tokens)
        except EngineDeadError as e:
            raise engine_unavailable(str(e)) from e
        except ValueError as e:
            raise bad_request(e, fields) from e

    @staticmethod
    async def merge(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Yield ``(prompt index, latest output)`` whenever any stream updates, until all finish.

        Closing it early (``aclose``, or a cancelled consumer) aborts the requests still running.

        Raises:
            APIError: 400 when the request's constraint failed to compile (or took too long), 500 when the
                engine failed a request otherwise, 503 when it died.
        """
        queue: asyncio.Queue[tuple[int, RequestOutput | None, BaseException | None]] = asyncio.Queue()

        async def pump(index: int, stream: RequestStream) -> None:
            try:
                async for output in stream:
                    queue.put_nowait((index, output, None))
            except Exception as e:  # reported by the consumer, never lost with the task
                queue.put_nowait((index, None, e))
                return
            queue.put_nowait((index, None, None))

        tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
        try:
            remaining = len(tasks)
            while remaining:
                index, output, error = await queue.get()
                if isinstance(error, EngineDeadError):
                    raise engine_unavailable(f"it stopped ({error})") from error
                if error is not None:
                    raise APIError(500, f"internal error: {type(error).__name__}", "server_error") from error
                if output is None:
                    remaining -= 1
                    continue
                if streams[index].error is not None:
                    raise request_failed(streams[index].error)
                yield index, output
        finally:
            for task in tasks:
                task.cancel()
            for stream in streams:
                stream.close()

    async def final_outputs(self, streams: list[RequestStream]) -> list[RequestOutput]:
        """Wait until every request finishes; return their final outputs in prompt order."""
        finals: dict[int, RequestOutput] = {}
        async with contextlib.aclosing(self.merge(streams)) as updates:
            async for index, output in updates:
                finals[index] = output
        return [finals[i] for i in range(len(streams))]


@dataclass
class EventStream:
    """A streamed response: its Server-Sent Event lines and the engine requests behind them.

    The server calls :meth:`close` when the response ends for any reason (done, client gone, error), which
    aborts whatever is still running, whether or not ``events`` was ever iterated.
    """

    events: AsyncIterator[str]
    streams: list[RequestStream]

    def close(self) -> None:
        """Abort the requests that did not finish."""
        for stream in self.streams:
            stream.close()


def created() -> int:
    """Seconds since the epoch, as OpenAI's ``created``."""
    return int(time.time())


def kv_transfer_fields(outputs: list[RequestOutput]) -> dict[str, Any]:
    """``{"kv_transfer_params": ...}`` for a response whose (first) request got them from the KV connector (a
    prefill instance's answer, vLLM's response field); ``{}`` otherwise."""
    params = outputs[0].kv_transfer_params if outputs else None
    return {} if params is None else {"kv_transfer_params": params}
