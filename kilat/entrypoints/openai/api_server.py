"""``kilat serve``: the OpenAI-compatible HTTP server (FastAPI + uvicorn) in front of :class:`AsyncLLM`.

Endpoints: ``/v1/models``, ``/v1/completions``, ``/v1/chat/completions``, ``/health``, ``/version``,
``/tokenize``, ``/detokenize`` and ``/metrics``. Every error is OpenAI's ``{"error": {...}}`` with a 4xx
status for client mistakes. A client that disconnects, streaming or not, aborts its engine requests.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import signal
from collections.abc import AsyncIterator, Awaitable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

import kilat
from kilat.config import EngineArgs
from kilat.engine.async_llm import AsyncLLM
from kilat.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from kilat.entrypoints.openai.serving import APIError, EventStream, bad_request
from kilat.entrypoints.openai.serving_chat import OpenAIServingChat
from kilat.entrypoints.openai.serving_completion import OpenAIServingCompletion
from kilat.entrypoints.openai.tool_calls import TOOL_CALL_PARSERS
from kilat.metrics.prometheus import PrometheusStatLogger

logger = logging.getLogger("kilat")

_PROTECTED_PREFIXES = ("/v1/", "/tokenize", "/detokenize")
"""Paths that need the API key when one is set; ``/health``, ``/version`` and ``/metrics`` stay open."""


@dataclass
class ServerConfig:
    """HTTP server settings.

    Attributes:
        host: address to bind; loopback unless told otherwise.
        port: TCP port, 0-65535 (0: any free port).
        served_model_name: names clients may pass as ``model``; default: the model path or
            ``"SmolLM2-135M-Instruct"`` for the embedded model.
        api_key: when set, ``Authorization: Bearer <api_key>`` is required on ``/v1/*``, ``/tokenize`` and
            ``/detokenize``.
        max_request_body_bytes: larger request bodies get 413 (bytes).
        trust_request_chat_template: accept a ``chat_template`` in chat requests (it runs on the server).
        tool_call_parser: how ``tool_choice: "auto"`` outputs are parsed for tool calls (``"hermes"``), or
            ``None`` (then ``auto`` is refused; ``required`` and named choices work without it).
        uvicorn_log_level: uvicorn's log level.
        disable_uvicorn_access_log: do not log one line per HTTP request.

    Raises:
        ValueError: an invalid value, named.
    """

    host: str = "127.0.0.1"
    port: int = 8000
    served_model_name: list[str] = field(default_factory=list)
    api_key: str | None = None
    max_request_body_bytes: int = 16 * 1024 * 1024
    trust_request_chat_template: bool = False
    tool_call_parser: str | None = None
    uvicorn_log_level: str = "info"
    disable_uvicorn_access_log: bool = False

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.max_request_body_bytes < 1:
            raise ValueError(f"max_request_body_bytes must be >= 1, got {self.max_request_body_bytes}")
        if self.api_key == "":
            raise ValueError("api_key must not be empty")
        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_CALL_PARSERS:
            raise ValueError(f"tool_call_parser must be one of {TOOL_CALL_PARSERS}, got {self.tool_call_parser!r}")


def default_model_name(model: str | None) -> str:
    """The name served for ``model`` when ``--served-model-name`` is not given."""
    return model if model is not None else "SmolLM2-135M-Instruct"


def _error_response(error: APIError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status)


async def _send_error(send: Send, error: APIError) -> None:
    response = _error_response(error)
    await send({"type": "http.response.start", "status": response.status_code, "headers": response.raw_headers})
    await send({"type": "http.response.body", "body": response.body})


class _GuardMiddleware:
    """Checks the API key and the body size before the app sees a request (413 for oversized bodies,
    whether announced by ``Content-Length`` or found while reading a chunked body)."""

    def __init__(self, app: ASGIApp, api_key: str | None, max_body: int):
        self.app = app
        self.api_key = api_key.encode() if api_key else None
        self.max_body = max_body

    def _authorized(self, header: bytes) -> bool:
        """``Authorization: Bearer <key>`` (the scheme is case-insensitive, RFC 7235)."""
        scheme, _, key = header.partition(b" ")
        return scheme.lower() == b"bearer" and hmac.compare_digest(key.strip(), self.api_key or b"")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        if self.api_key is not None and scope["path"].startswith(_PROTECTED_PREFIXES) and \
                not self._authorized(headers.get(b"authorization", b"")):
            await _send_error(send, APIError(401, "missing or invalid API key (Authorization: Bearer <key>)",
                                             "authentication_error", code="invalid_api_key"))
            return
        too_large = APIError(413, f"request body exceeds {self.max_body} bytes", code="request_too_large")
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body:
            await _send_error(send, too_large)
            return
        body = bytearray()
        more = scope["method"] in ("POST", "PUT", "PATCH")
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body += message.get("body", b"")
            more = message.get("more_body", False)
            if len(body) > self.max_body:
                await _send_error(send, too_large)
                return
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": bytes(body), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


async def _wait_for_disconnect(receive: Receive) -> None:
    """Return when the client has gone (the request body was already read)."""
    while (await receive())["type"] != "http.disconnect":
        pass


class _EventStreamResponse(StreamingResponse):
    """Server-Sent Events that stop, and abort their requests, as soon as the client disconnects."""

    media_type = "text/event-stream"

    def __init__(self, stream: EventStream):
        super().__init__(stream.events, headers={"Cache-Control": "no-cache"})
        self.stream = stream

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def send_events() -> None:
            with contextlib.suppress(OSError):  # the client went away mid-send
                await self.stream_response(send)

        tasks = [asyncio.create_task(send_events()), asyncio.create_task(_wait_for_disconnect(receive))]
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in tasks:
                task.cancel()
            for result in await asyncio.gather(*tasks, return_exceptions=True):
                if isinstance(result, Exception):
                    logger.error("event stream failed", exc_info=result)
            self.stream.close()
            await self.stream.events.aclose()  # type: ignore[attr-defined]


async def _respond(raw: Request, work: Awaitable[dict[str, Any] | EventStream]) -> Response:
    """Run a handler while watching for the client's disconnect, which cancels it (and so aborts its
    requests); turn its result into JSON or an event stream."""
    task = asyncio.ensure_future(work)
    listener = asyncio.create_task(_wait_for_disconnect(raw.receive))
    try:
        done, _ = await asyncio.wait([task, listener], return_when=asyncio.FIRST_COMPLETED)
    finally:
        listener.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    if task not in done:
        return Response(status_code=499)  # the client is gone; nobody reads this
    result = task.result()
    if isinstance(result, EventStream):
        return _EventStreamResponse(result)
    return JSONResponse(result)


def build_app(engine: AsyncLLM, config: ServerConfig, stat_logger: PrometheusStatLogger) -> FastAPI:
    """The FastAPI application serving ``engine``; its shutdown stops the engine-core process."""
    names = config.served_model_name or [default_model_name(engine.config.model.model)]
    completions = OpenAIServingCompletion(engine, names)
    chat = OpenAIServingChat(engine, names, config.trust_request_chat_template, config.tool_call_parser)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        engine.shutdown()

    app = FastAPI(title="kilat", version=kilat.__version__, lifespan=lifespan)
    app.add_middleware(_GuardMiddleware, api_key=config.api_key, max_body=config.max_request_body_bytes)

    @app.exception_handler(APIError)
    async def api_error(_: Request, e: APIError) -> JSONResponse:
        return _error_response(e)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, e: RequestValidationError) -> JSONResponse:
        problems = []
        param = None
        for err in e.errors():
            if err.get("type") == "json_invalid":
                problems.append(f"invalid JSON body: {err.get('ctx', {}).get('error', err.get('msg'))}")
                continue
            loc = [str(p) for p in err.get("loc", ()) if p != "body"]
            param = param or (loc[0] if loc else None)
            problems.append(f"{'.'.join(loc) or 'body'}: {err.get('msg')}")
        return _error_response(APIError(400, "; ".join(problems), param=param))

    @app.exception_handler(HTTPException)
    async def http_error(_: Request, e: HTTPException) -> JSONResponse:
        return _error_response(APIError(e.status_code, str(e.detail)))

    @app.exception_handler(Exception)
    async def internal_error(_: Request, e: Exception) -> JSONResponse:
        logger.exception("unhandled error")
        return _error_response(APIError(500, f"internal error: {type(e).__name__}", "server_error"))

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health() -> Response:
        return Response(status_code=200 if engine.is_running else 503)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": kilat.__version__}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(stat_logger.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [
            {"id": name, "object": "model", "created": 0, "owned_by": "kilat",
             "root": engine.config.model.model or names[0], "max_model_len": engine.max_model_len}
            for name in names]}

    @app.post("/v1/completions")
    async def create_completion(request: CompletionRequest, raw: Request) -> Response:
        return await _respond(raw, completions.create(request))

    @app.post("/v1/chat/completions")
    async def create_chat_completion(request: ChatCompletionRequest, raw: Request) -> Response:
        return await _respond(raw, chat.create(request))

    @app.post("/tokenize")
    async def tokenize(request: TokenizeRequest) -> dict[str, Any]:
        chat.check_model(request.model)
        to_ids = engine.input_processor.to_token_ids
        try:
            if (request.prompt is None) == (request.messages is None):
                raise ValueError("prompt or messages: exactly one must be given")
            if request.messages is not None:
                _, ids = await engine.in_tokenizer_thread(to_ids, await chat.render(request), False)
            else:
                _, ids = await engine.in_tokenizer_thread(to_ids, request.prompt, request.add_special_tokens)
        except ValueError as e:
            raise bad_request(e, set(TokenizeRequest.model_fields)) from e
        return {"count": len(ids), "max_model_len": engine.max_model_len, "tokens": ids}

    @app.post("/detokenize")
    async def detokenize(request: DetokenizeRequest) -> dict[str, Any]:
        chat.check_model(request.model)
        vocab = engine.input_processor.vocab_size
        bad = [t for t in request.tokens if not 0 <= t < vocab]
        if bad:
            raise APIError(400, f"tokens must be in [0, {vocab}), got {bad[:5]}", param="tokens")
        return {"prompt": engine.tokenizer.decode(request.tokens)}

    return app


def _exit_on_sigterm(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)


def run_server(engine_args: EngineArgs, config: ServerConfig) -> None:
    """Start the engine-core process, then serve HTTP until SIGINT or SIGTERM; both processes exit.

    Raises:
        ValueError: an invalid engine argument or model path, or ``skip_tokenizer_init`` (the OpenAI API
            takes text).
        kilat.engine.core_client.EngineDeadError: the model failed to load.
    """
    if engine_args.skip_tokenizer_init:
        raise ValueError("skip_tokenizer_init: kilat serve needs a tokenizer (the OpenAI API takes and returns "
                         "text); use it offline with token-id prompts")
    stat_logger = PrometheusStatLogger()
    # SIGTERM must unwind (and so stop the engine core), not kill outright: while the model loads, and when
    # uvicorn re-raises it after its graceful shutdown.
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    engine = AsyncLLM(engine_args, stat_logger)
    try:
        app = build_app(engine, config, stat_logger)
        logger.info("serving %s on http://%s:%d", config.served_model_name or
                    default_model_name(engine_args.model), config.host, config.port)
        uvicorn.run(app, host=config.host, port=config.port, log_level=config.uvicorn_log_level,
                    access_log=not config.disable_uvicorn_access_log, timeout_graceful_shutdown=5)
    finally:
        engine.shutdown()
