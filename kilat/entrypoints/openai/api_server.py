"""``kilat serve``: the OpenAI-compatible HTTP server (FastAPI + uvicorn) in front of :class:`AsyncLLM`.

Endpoints: ``/v1/models``, ``/v1/completions``, ``/v1/chat/completions``, ``/health``, ``/version``,
``/tokenize``, ``/detokenize``, ``/metrics`` and the live dashboard at ``/dashboard`` (``dashboard.py``). Every
error is OpenAI's ``{"error": {...}}`` with a 4xx status for client mistakes. A client that disconnects, streaming
or not, aborts its engine requests.

``python -m kilat.entrypoints.openai.api_server [flags]`` is ``kilat serve [flags]`` (vLLM's command).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import hmac
import json
import logging
import math
import re
import signal
import socket
import sys
from collections.abc import AsyncIterator, Awaitable
from contextlib import asynccontextmanager
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

import kilat
from kilat.child_process import exit_now
from kilat.config import EngineArgs
from kilat.engine.async_llm import AsyncLLM
from kilat.engine.core_client import EngineDeadError
from kilat.entrypoints.openai.dashboard import DASHBOARD_PATH, dashboard_router
from kilat.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    ErrorResponse,
    TokenizeRequest,
)
from kilat.entrypoints.openai.server_config import ServerConfig
from kilat.entrypoints.openai.serving import APIError, EventStream, bad_request, engine_unavailable
from kilat.entrypoints.openai.serving_chat import OpenAIServingChat
from kilat.entrypoints.openai.serving_completion import OpenAIServingCompletion
from kilat.entrypoints.openai.tool_calls import plan_tools
from kilat.metrics.prometheus import PrometheusStatLogger

logger = logging.getLogger("kilat")

_PROTECTED_PREFIXES = ("/v1/", "/tokenize", "/detokenize", DASHBOARD_PATH)
"""Paths that need the API key when one is set; ``/health``, ``/version`` and ``/metrics`` stay open."""


def default_model_name(model: str | None) -> str:
    """The name served for ``model`` when ``--served-model-name`` is not given."""
    return model if model is not None else "SmolLM2-135M-Instruct"


def _error_response(error: APIError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers)


async def _send_error(send: Send, error: APIError) -> None:
    response = _error_response(error)
    await send({"type": "http.response.start", "status": response.status_code, "headers": response.raw_headers})
    await send({"type": "http.response.body", "body": response.body})


_MAYBE_NON_FINITE = re.compile(rb"NaN|Infinity|[eE]\+?[0-9]{3}|[0-9]{309}")
"""Bytes without a match cannot hold a number that Python's ``json`` reads as ``inf`` or ``nan``."""


def _non_finite_number(body: bytes) -> APIError | None:
    """A 400 naming the first field that holds ``NaN``, ``Infinity``, ``-Infinity`` or a number beyond the
    float range (``1e400``): Python's ``json`` reads them as ``nan``/``inf``, but ``NaN`` and ``Infinity``
    are not JSON (RFC 8259) and no field may be infinite. ``None`` when there is none, or when the body is
    not valid JSON or nests too deeply for ``json`` (reported by the app as a 400).

    One ``json.loads`` pass (C speed) finds out whether such a number exists, its hooks seeing only the
    constants and the floats; the Python walk that names the field runs only when one does. Blocking (up
    to a few seconds for a 16 MiB body): run it off the event loop."""
    if not _MAYBE_NON_FINITE.search(body):
        return None
    found = False

    def constant(text: str) -> float:
        nonlocal found
        found = True
        return float(text)

    def number(text: str) -> float:
        nonlocal found
        value = float(text)
        found = found or not math.isfinite(value)
        return value

    try:
        value = json.loads(body, parse_constant=constant, parse_float=number)
    except (ValueError, RecursionError):
        return None
    if not found:
        return None
    stack: list[tuple[tuple[str | int, ...], Any]] = [((), value)]
    while stack:
        path, item = stack.pop()
        if isinstance(item, float) and not math.isfinite(item):
            name = ".".join(str(p) for p in path) or "body"
            param = path[0] if path and isinstance(path[0], str) else None
            return APIError(400, f"{name}: {item} is not a finite number (JSON has no NaN or Infinity, "
                                 f"RFC 8259)", param=param)
        if isinstance(item, dict):
            stack.extend(((*path, k), v) for k, v in reversed(item.items()))
        elif isinstance(item, list):
            stack.extend(((*path, i), v) for i, v in reversed(list(enumerate(item))))
    return None


def _is_json(content_type: bytes) -> bool:
    """``application/json`` or ``application/*+json`` (parameters such as ``charset`` ignored)."""
    media = content_type.split(b";")[0].strip().lower()
    return media == b"application/json" or (media.startswith(b"application/") and media.endswith(b"+json"))


class GuardMiddleware:
    """Checks the API key and the body size before the app sees a request (413 for oversized bodies,
    whether announced by ``Content-Length`` or found while reading a chunked body), refuses non-finite JSON
    numbers with a 400, and reads every request body as JSON whatever its ``Content-Type`` (missing,
    ``text/plain``, or curl's form default), as the OpenAI API takes only JSON bodies."""

    def __init__(self, app: ASGIApp, api_key: str | None, max_body: int):
        self.app = app
        self.api_key = api_key.encode() if api_key else None
        self.max_body = max_body

    def _authorized(self, header: bytes, basic: bool) -> bool:
        """``Authorization: Bearer <key>`` (the scheme is case-insensitive, RFC 7235), or when ``basic`` also
        ``Basic <base64 of user:key>`` (any user name; what a browser sends after its password prompt). A
        malformed header is not authorized."""
        scheme, _, credentials = header.partition(b" ")
        scheme = scheme.lower()
        if scheme == b"bearer":
            key = credentials.strip()
        elif scheme == b"basic" and basic:
            try:
                key = base64.b64decode(credentials.strip(), validate=True).partition(b":")[2]
            except binascii.Error:
                return False
        else:
            return False
        return hmac.compare_digest(key, self.api_key or b"")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        dashboard = scope["path"].startswith(DASHBOARD_PATH)
        if self.api_key is not None and scope["path"].startswith(_PROTECTED_PREFIXES) and \
                not self._authorized(headers.get(b"authorization", b""), basic=dashboard):
            # a browser prompts for a password on a Basic challenge: the dashboard takes the key as one
            how = ("Authorization: Bearer <key>, or Basic with the key as password" if dashboard
                   else "Authorization: Bearer <key>")
            await _send_error(send, APIError(401, f"missing or invalid API key ({how})", "authentication_error",
                                             code="invalid_api_key",
                                             headers={"WWW-Authenticate": 'Basic realm="kilat"' if dashboard
                                                      else "Bearer"}))
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
        if body:
            error = await asyncio.to_thread(_non_finite_number, bytes(body))
            if error is not None:
                await _send_error(send, error)
                return
        if body and not _is_json(headers.get(b"content-type", b"")):
            scope = {**scope, "headers": [(k, v) for k, v in scope["headers"] if k != b"content-type"]
                     + [(b"content-type", b"application/json")]}
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": bytes(body), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


async def wait_for_disconnect(receive: Receive) -> None:
    """Return when the client has gone (the request body was already read)."""
    while (await receive())["type"] != "http.disconnect":
        pass


class DisconnectAwareResponse(StreamingResponse):
    """A streamed response that stops as soon as the client disconnects; :meth:`closed` then runs, whatever
    ended the stream (done, client gone, error)."""

    async def closed(self) -> None:
        """Release what the stream holds (subclasses)."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def send_body() -> None:
            with contextlib.suppress(OSError):  # the client went away mid-send
                await self.stream_response(send)

        tasks = [asyncio.create_task(send_body()), asyncio.create_task(wait_for_disconnect(receive))]
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in tasks:
                task.cancel()
            for result in await asyncio.gather(*tasks, return_exceptions=True):
                if isinstance(result, Exception):
                    logger.error("streamed response %s failed", type(self).__name__, exc_info=result)
            await self.closed()


class _EventStreamResponse(DisconnectAwareResponse):
    """Server-Sent Events that stop, and abort their requests, as soon as the client disconnects."""

    media_type = "text/event-stream"

    def __init__(self, stream: EventStream):
        super().__init__(stream.events, headers={"Cache-Control": "no-cache"})
        self.stream = stream

    async def closed(self) -> None:
        """Abort the requests still running."""
        self.stream.close()
        await self.stream.events.aclose()  # type: ignore[attr-defined]


async def run_unless_disconnected(receive: Receive, work: Awaitable[Any]) -> tuple[bool, asyncio.Future[Any]]:
    """Run ``work`` while watching for the client's disconnect (the request body must have been read), which
    cancels it. Returns whether it finished first, and its future (when the client left first: cancelled, or
    done if it finished at that very moment)."""
    task = asyncio.ensure_future(work)
    listener = asyncio.create_task(wait_for_disconnect(receive))
    try:
        done, _ = await asyncio.wait([task, listener], return_when=asyncio.FIRST_COMPLETED)
    finally:
        listener.cancel()
        if not task.done():
            task.cancel()
        await asyncio.gather(task, listener, return_exceptions=True)
    return task in done, task


async def _respond(raw: Request, work: Awaitable[dict[str, Any] | EventStream]) -> Response:
    """Run a handler while watching for the client's disconnect, which cancels it (and so aborts its
    requests); turn its result into JSON or an event stream."""
    finished, task = await run_unless_disconnected(raw.receive, work)
    if not finished:
        return Response(status_code=499)  # the client is gone; nobody reads this
    result = task.result()
    if isinstance(result, EventStream):
        return _EventStreamResponse(result)
    return JSONResponse(result)


_ERROR_DESCRIPTIONS = {400: "Invalid request: the message names the field and its limit",
                       401: "Missing or invalid API key", 404: "Unknown model", 413: "Request body too large",
                       500: "Internal error", 503: "The engine is not running"}


def _errors(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI ``responses`` for these error statuses, each with OpenAI's error body."""
    return {status: {"model": ErrorResponse, "description": _ERROR_DESCRIPTIONS[status]} for status in statuses}


def _openapi_schema(app: FastAPI) -> dict[str, Any]:
    """FastAPI's OpenAPI schema without its 422 responses: a request that fails validation gets a 400 with
    OpenAI's error body (declared on each endpoint)."""
    if app.openapi_schema is None:
        schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
        for operations in schema["paths"].values():
            for operation in operations.values():
                operation.get("responses", {}).pop("422", None)
        for name in ("HTTPValidationError", "ValidationError"):
            schema.get("components", {}).get("schemas", {}).pop(name, None)
        app.openapi_schema = schema
    return app.openapi_schema


def build_app(engine: AsyncLLM, config: ServerConfig, stat_logger: PrometheusStatLogger) -> FastAPI:
    """The FastAPI application serving ``engine``; its shutdown stops the engine-core process."""
    names = config.served_model_name or [default_model_name(engine.config.model.model)]
    completions = OpenAIServingCompletion(engine, names)
    chat = OpenAIServingChat(engine, names, config.trust_request_chat_template, config.tool_call_parser,
                             config.build_reasoning_parser())

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        engine.start_output_handler()  # watches the core from the start, so an idle core's death is seen
        yield
        await chat.close()  # a stuck request-template render must not outlive the server
        engine.shutdown()

    app = FastAPI(title="kilat", version=kilat.__version__, lifespan=lifespan)
    app.openapi = lambda: _openapi_schema(app)  # type: ignore[method-assign]
    app.add_middleware(GuardMiddleware, api_key=config.api_key, max_body=config.max_request_body_bytes)

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
        return _error_response(APIError(e.status_code, str(e.detail), headers=e.headers))

    @app.exception_handler(Exception)
    async def internal_error(_: Request, e: Exception) -> JSONResponse:
        logger.exception("unhandled error")
        return _error_response(APIError(500, f"internal error: {type(e).__name__}", "server_error"))

    @app.api_route("/health", methods=["GET", "HEAD"], response_class=Response,
                   responses={200: {"description": "The engine serves requests (empty body, as vLLM's)",
                                    "content": None}, **_errors(503)})
    async def health() -> Response:
        if engine.is_running:
            return Response(status_code=200)
        return _error_response(engine_unavailable(engine.dead_error or "engine core is not running"))

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": kilat.__version__}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(stat_logger.render(), media_type=CONTENT_TYPE_LATEST)

    spec = engine.config.speculative
    app.include_router(dashboard_router(stat_logger, names[0], spec.method if spec is not None else None))

    @app.get("/v1/models", responses=_errors(401))
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [
            {"id": name, "object": "model", "created": 0, "owned_by": "kilat",
             "root": engine.config.model.model or names[0], "max_model_len": engine.max_model_len}
            for name in names]}

    @app.post("/v1/completions", responses=_errors(400, 401, 404, 413, 500, 503))
    async def create_completion(request: CompletionRequest, raw: Request) -> Response:
        return await _respond(raw, completions.create(request))

    @app.post("/v1/chat/completions", responses=_errors(400, 401, 404, 413, 500, 503))
    async def create_chat_completion(request: ChatCompletionRequest, raw: Request) -> Response:
        return await _respond(raw, chat.create(request))

    @app.post("/tokenize", responses=_errors(400, 401, 404, 413))
    async def tokenize(request: TokenizeRequest) -> dict[str, Any]:
        chat.check_model(request.model)
        to_ids = engine.input_processor.to_token_ids
        try:
            if (request.prompt is None) == (request.messages is None):
                raise ValueError("prompt or messages: exactly one must be given")
            if request.messages is not None:
                plan = plan_tools(request.tools, "none", True, None)  # validated; rendered as chat renders them
                prompt = await chat.render(request, plan.tools if plan is not None else None)
                _, ids = await engine.in_tokenizer_thread(to_ids, prompt, False)
            else:
                _, ids = await engine.in_tokenizer_thread(to_ids, request.prompt, request.add_special_tokens)
        except ValueError as e:
            raise bad_request(e, set(TokenizeRequest.model_fields)) from e
        return {"count": len(ids), "max_model_len": engine.max_model_len, "tokens": ids}

    @app.post("/detokenize", responses=_errors(400, 401, 404, 413))
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


def bind_socket(host: str, port: int) -> socket.socket:
    """A TCP socket listening on ``host:port`` (IPv6 when ``host`` has a colon), created before the model
    loads so that a port in use fails at once.

    Raises:
        ValueError: the address cannot be bound (in use, not local, no permission), naming host and port.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        return socket.create_server((host, port), family=family, backlog=2048)
    except OSError as e:
        raise ValueError(f"cannot listen on {host}:{port} (--host/--port): {e.strerror or e}") from e


class UvicornServer(uvicorn.Server):
    """uvicorn's server that says where it serves once it really accepts connections."""

    def __init__(self, config: uvicorn.Config, message: str):
        super().__init__(config)
        self.message = message

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self.started:
            logger.info("%s", self.message)


def run_server(engine_args: EngineArgs, config: ServerConfig) -> None:
    """Listen on the port, start the engine-core process, then serve HTTP until SIGINT or SIGTERM; both
    processes exit.

    The port is bound before the model loads (a port in use fails at once). A dead engine core is restarted
    (``config.max_engine_core_restarts``); when it will not be, the server stops and this raises.

    Raises:
        ValueError: an invalid engine argument or model path, a port that cannot be bound, or
            ``skip_tokenizer_init`` (the OpenAI API takes text).
        kilat.engine.core_client.EngineDeadError: the model failed to load, or the engine core died and was
            not restarted.
    """
    if engine_args.skip_tokenizer_init:
        raise ValueError("skip_tokenizer_init: kilat serve needs a tokenizer (the OpenAI API takes and returns "
                         "text); use it offline with token-id prompts")
    stat_logger = PrometheusStatLogger(engine_args.data_parallel_size)
    # SIGTERM must unwind (and so stop the engine core), not kill outright: while the model loads, and when
    # uvicorn re-raises it after its graceful shutdown.
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    with bind_socket(config.host, config.port) as sock:
        server: UvicornServer | None = None

        def stop_serving(_: str) -> None:
            if server is not None:
                server.should_exit = True

        engine = AsyncLLM(engine_args, stat_logger, config.max_engine_core_restarts, on_engine_dead=stop_serving)
        try:
            app = build_app(engine, config, stat_logger)
            host, port = sock.getsockname()[:2]
            server = UvicornServer(uvicorn.Config(app, log_level=config.uvicorn_log_level,
                                            access_log=not config.disable_uvicorn_access_log,
                                            timeout_graceful_shutdown=5),
                             f"serving {config.served_model_name or default_model_name(engine_args.model)} on "
                             f"http://{host}:{port}")
            server.run(sockets=[sock])
        finally:
            engine.shutdown()
    if engine.dead_error is not None:
        raise EngineDeadError(engine.dead_error)


if __name__ == "__main__":
    from kilat.entrypoints.cli import main

    main(["serve", *sys.argv[1:]])
    exit_now(0)
