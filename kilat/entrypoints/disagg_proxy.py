"""``kilat proxy``: one OpenAI-compatible endpoint in front of separate prefill and decode instances
(disaggregated prefill/decode, as vLLM's ``disagg_proxy`` example).

Each ``POST /v1/completions`` or ``POST /v1/chat/completions`` request makes two upstream calls, to the next
prefill and the next decode instance (two independent round-robin counters):

1. **Prefill**: a copy of the body with ``max_tokens: 1`` (``max_completion_tokens``, ``min_tokens`` and
   ``best_of`` removed), ``stream: false`` (no ``stream_options``), ``n: 1`` and
   ``kv_transfer_params: {"do_remote_decode": true, "do_remote_prefill": false}``: the prefill instance computes
   the prompt's KV cache, keeps it for the decode instance and answers with a top-level ``kv_transfer_params``
   object saying where to fetch it.
2. **Decode**: the client's original body plus ``kv_transfer_params`` set to the object the prefill instance
   returned, passed on as is (the proxy does not look inside; with vLLM-style connectors it holds
   ``do_remote_prefill: true``, the remote host, port, engine and request ids). When the prefill answer has
   none (or ``null``) the original body goes unchanged and the decode instance computes the prompt itself. Its
   answer goes to the client: JSON as received, or, for ``"stream": true``, the Server-Sent Events byte for
   byte as they arrive.

Failures, in OpenAI's error format (``{"error": {"message", "type", "param", "code"}}``):

* a body that is not a JSON object: 400 (``BadRequestError``);
* ``--api-key`` set and ``Authorization: Bearer KEY`` missing or wrong on ``/v1/*``: 401; a body over 16 MiB
  (413) or with a non-finite number (400) is refused as ``kilat serve`` refuses it, by the same guard;
* an upstream instance's own error (non-2xx, e.g. its 400 for a bad request): that status and body, unchanged;
* an upstream instance that cannot be reached, or a prefill answer that is not a JSON object: 502
  (``BadGatewayError``); no answer within the timeout: 504 (``GatewayTimeoutError``); the message names the
  instance's URL and the cause.

Timeouts are in seconds: the whole prefill call must finish within ``timeout``; the decode call must connect,
and send each piece of its answer (for a non-streamed request, the whole answer), within ``timeout`` of the
last. A client that disconnects, before or while its answer streams, closes the upstream connection, so the
instance sees the disconnect and aborts the request.

``GET /v1/models`` is forwarded to the first decode instance; ``GET /health`` answers 200 ``{}`` while the
proxy runs (upstreams are not probed). The client's ``Authorization`` header is forwarded upstream.
"""

from __future__ import annotations

import copy
import itertools
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

import kilat
from kilat.entrypoints.openai.api_server import (
    DisconnectAwareResponse,
    GuardMiddleware,
    UvicornServer,
    bind_socket,
    run_unless_disconnected,
)
from kilat.entrypoints.openai.server_config import ServerConfig

logger = logging.getLogger("kilat")

COMPLETION_PATHS = ("/v1/completions", "/v1/chat/completions")
"""The endpoints that go through prefill then decode."""

PREFILL_KV_TRANSFER_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False}
"""The ``kv_transfer_params`` of every prefill call: compute the prompt and keep its KV cache for a remote
decode."""

_ERROR_TYPES = {400: "BadRequestError", 502: "BadGatewayError", 504: "GatewayTimeoutError"}


class UpstreamError(Exception):
    """An upstream instance that could not be reached, timed out or answered nonsense.

    Args:
        status: 502 (unreachable, or an answer that is not a JSON object) or 504 (timeout).
        message: the explanation for the client; names the instance's URL.
    """

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status
        self.message = message


def error_response(status: int, message: str) -> JSONResponse:
    """OpenAI's error body (``type`` is ``BadRequestError``, ``BadGatewayError`` or ``GatewayTimeoutError``,
    ``code`` the HTTP status), with that status."""
    return JSONResponse({"error": {"message": message, "type": _ERROR_TYPES.get(status, "APIError"), "param": None,
                                   "code": status}}, status_code=status)


def normalize_base_url(url: str, flag: str) -> str:
    """``url`` without a trailing ``/`` or ``/v1``: ``http://h:8100/v1/`` is ``http://h:8100``.

    Raises:
        ValueError: not an ``http://`` or ``https://`` URL with a host; the message names ``flag``.
    """
    base = url.strip().rstrip("/")
    base = base.removesuffix("/v1").rstrip("/")
    parts = urlsplit(base)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"{flag}: expected a base URL starting with http:// or https:// (such as "
                         f"http://127.0.0.1:8100), got {url!r}")
    return base


def _base_urls(urls: list[str], flag: str) -> list[str]:
    """The normalized URLs; at least one.

    Raises:
        ValueError: none, or an invalid one; the message names ``flag``.
    """
    if not urls:
        raise ValueError(f"{flag}: at least one base URL of a kilat serve instance is required")
    return [normalize_base_url(url, flag) for url in urls]


class RoundRobin:
    """Hands out ``urls`` in turn, from the first."""

    def __init__(self, urls: list[str]):
        self.urls = urls
        self._counter = itertools.count()

    def next(self) -> str:
        """The next URL."""
        return self.urls[next(self._counter) % len(self.urls)]


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """The prefill call's body: a copy of ``body`` that generates one token, unstreamed, once, and asks the
    instance to keep the KV cache for a remote decode (:data:`PREFILL_KV_TRANSFER_PARAMS`).
    ``max_completion_tokens``, ``min_tokens`` (which may exceed 1), ``best_of`` (must equal ``n``) and
    ``stream_options`` are removed."""
    prefill = copy.deepcopy(body)
    for key in ("max_completion_tokens", "min_tokens", "best_of", "stream_options"):
        prefill.pop(key, None)
    prefill.update(max_tokens=1, stream=False, n=1, kv_transfer_params=dict(PREFILL_KV_TRANSFER_PARAMS))
    return prefill


def decode_body(body: dict[str, Any], prefill_answer: dict[str, Any]) -> dict[str, Any]:
    """The decode call's body: the client's ``body`` with ``kv_transfer_params`` set to the prefill answer's
    top-level one, unread, or without any when the answer has none (or ``null``): a client's own
    ``kv_transfer_params`` never reach an instance (they could name any address for it to pull from)."""
    decode = {k: v for k, v in body.items() if k != "kv_transfer_params"}
    params = prefill_answer.get("kv_transfer_params")
    return decode if params is None else {**decode, "kv_transfer_params": params}


def _forwarded_headers(raw: Request) -> dict[str, str]:
    """The client's headers that go upstream: ``Authorization``."""
    auth = raw.headers.get("authorization")
    return {"Authorization": auth} if auth is not None else {}


def _passthrough(status: int, body: bytes, content_type: str | None) -> Response:
    """An upstream answer as received."""
    return Response(body, status_code=status, media_type=content_type or "application/json")


def _cause(error: BaseException) -> str:
    """A short description of a failed upstream call."""
    text = str(error)
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


async def _unless_disconnected(raw: Request, work: Awaitable[Response]) -> Response:
    """``work``'s response, or, when the client disconnects first, 499 after cancelling ``work`` (which closes
    its upstream connection, so the instance aborts the request). The request body must have been read."""
    finished, task = await run_unless_disconnected(raw.receive, work)
    if not finished:
        if not task.cancelled() and task.exception() is None and isinstance(stream := task.result(), _UpstreamStream):
            stream.upstream.close()  # finished just as the client left
        return Response(status_code=499)  # the client is gone; nobody reads this
    return task.result()


class _UpstreamStream(DisconnectAwareResponse):
    """A decode instance's streamed answer, relayed chunk by chunk as it arrives; the upstream response is
    closed when it ends, fails, or the client disconnects (whichever comes first)."""

    def __init__(self, upstream: aiohttp.ClientResponse, url: str):
        super().__init__(self._chunks(), status_code=upstream.status, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache"})
        self.upstream = upstream
        self.url = url

    async def _chunks(self) -> AsyncIterator[bytes]:
        try:
            async for chunk in self.upstream.content.iter_any():
                yield chunk
        except (aiohttp.ClientError, TimeoutError) as e:  # too late for a status: the stream just ends
            logger.warning("decode instance %s: stream broken off: %s", self.url, _cause(e))

    async def closed(self) -> None:
        """Drop the upstream connection: the decode instance aborts the request if it still runs."""
        self.upstream.close()
        await self.body_iterator.aclose()  # type: ignore[attr-defined]


class _Proxy:
    """The upstream side of the proxy: instance choice, the prefill and decode calls, and the shared
    ``aiohttp`` session (opened by :meth:`start`, closed by :meth:`stop`)."""

    def __init__(self, prefill_urls: list[str], decode_urls: list[str], timeout: float):
        self.prefills = RoundRobin(_base_urls(prefill_urls, "--prefill"))
        self.decodes = RoundRobin(_base_urls(decode_urls, "--decode"))
        if not timeout > 0:
            raise ValueError(f"--timeout: must be > 0 seconds, got {timeout}")
        self.timeout = timeout
        self.prefill_timeout = aiohttp.ClientTimeout(total=timeout)
        self.decode_timeout = aiohttp.ClientTimeout(total=None, sock_connect=timeout, sock_read=timeout)
        self._session: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        """Open the shared HTTP client session."""
        # No connection limit: each upstream connection serves one client request, which uvicorn bounds.
        self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))

    async def stop(self) -> None:
        """Close the shared HTTP client session (and its connections)."""
        if self._session is not None:
            await self._session.close()
            self._session = None

    @property
    def session(self) -> aiohttp.ClientSession:
        """The shared HTTP client session."""
        if self._session is None:
            raise RuntimeError("the proxy's HTTP client is not started (the app's lifespan did not run)")
        return self._session

    def _late(self, who: str) -> UpstreamError:
        return UpstreamError(504, f"{who}: no answer within {self.timeout:g} s")

    async def _call(self, method: str, url: str, who: str, raw: Request, limit: aiohttp.ClientTimeout,
                    body: dict[str, Any] | None = None) -> aiohttp.ClientResponse:
        """The response to ``method url`` (headers read, body not; the caller closes it).

        Raises:
            UpstreamError: 504 on a timeout, 502 when ``url`` cannot be reached.
        """
        try:
            return await self.session.request(method, url, json=body, headers=_forwarded_headers(raw), timeout=limit)
        except TimeoutError as e:
            raise self._late(who) from e
        except (aiohttp.ClientError, OSError) as e:
            raise UpstreamError(502, f"{who} cannot be reached: {_cause(e)}") from e

    async def _read(self, upstream: aiohttp.ClientResponse, who: str) -> bytes:
        """The whole body of ``upstream``.

        Raises:
            UpstreamError: 504 on a timeout, 502 when the answer breaks off.
        """
        try:
            return await upstream.read()
        except TimeoutError as e:
            raise self._late(who) from e
        except (aiohttp.ClientError, OSError) as e:
            raise UpstreamError(502, f"{who}: the answer broke off: {_cause(e)}") from e

    async def prefill(self, path: str, body: dict[str, Any], raw: Request) -> dict[str, Any] | Response:
        """The next prefill instance's JSON answer to :func:`prefill_body`, or its non-2xx answer as the
        client's response.

        Raises:
            UpstreamError: it cannot be reached, timed out, or answered something that is not a JSON object.
        """
        url = self.prefills.next() + path
        who = f"prefill instance {url}"
        upstream = await self._call("POST", url, who, raw, self.prefill_timeout, prefill_body(body))
        try:
            data = await self._read(upstream, who)
        finally:
            upstream.close()  # a no-op once read; on cancellation it drops the connection
        if not 200 <= upstream.status < 300:
            return _passthrough(upstream.status, data, upstream.content_type)
        try:
            answer = json.loads(data)
        except (ValueError, RecursionError):
            answer = None
        if not isinstance(answer, dict):
            raise UpstreamError(502, f"{who} answered {upstream.status} with something that is not a JSON "
                                     f"object: {data[:200]!r}")
        return answer

    async def decode(self, path: str, body: dict[str, Any], raw: Request) -> Response:
        """The next decode instance's answer to ``body``, relayed as a stream when ``body`` asks for one and
        the instance accepted it (2xx).

        Raises:
            UpstreamError: it cannot be reached, or timed out before answering.
        """
        url = self.decodes.next() + path
        who = f"decode instance {url}"
        upstream = await self._call("POST", url, who, raw, self.decode_timeout, body)
        relayed = False
        try:
            if body.get("stream") is True and 200 <= upstream.status < 300:
                relayed = True
                return _UpstreamStream(upstream, url)
            return _passthrough(upstream.status, await self._read(upstream, who), upstream.content_type)
        finally:
            if not relayed:
                upstream.close()

    async def complete(self, path: str, body: dict[str, Any], raw: Request) -> Response:
        """Prefill, then decode; an :class:`UpstreamError` as the client's 502 or 504."""
        try:
            answer = await self.prefill(path, body, raw)
            if isinstance(answer, Response):
                return answer
            return await self.decode(path, decode_body(body, answer), raw)
        except UpstreamError as e:
            logger.warning("%s", e.message)
            return error_response(e.status, e.message)

    async def models(self, raw: Request) -> Response:
        """``GET /v1/models`` of the first decode instance, as received."""
        url = self.decodes.urls[0] + "/v1/models"
        who = f"decode instance {url}"
        try:
            upstream = await self._call("GET", url, who, raw, self.prefill_timeout)
            try:
                return _passthrough(upstream.status, await self._read(upstream, who), upstream.content_type)
            finally:
                upstream.close()
        except UpstreamError as e:
            return error_response(e.status, e.message)


def build_app(prefill_urls: list[str], decode_urls: list[str], timeout: float = 300.0,
              api_key: str | None = None) -> FastAPI:
    """The proxy's FastAPI application (the module's documentation describes the protocol and failures).

    Args:
        prefill_urls: base URLs of the prefill instances (``kilat serve``), e.g. ``http://127.0.0.1:8100``;
            a trailing ``/`` or ``/v1`` is ignored. Used in turn.
        decode_urls: base URLs of the decode instances, likewise.
        timeout: seconds allowed for the whole prefill call, and for the decode call to connect and to send
            each piece of its answer (a non-streamed answer comes in one piece).
        api_key: when set, ``Authorization: Bearer <api_key>`` is required on ``/v1/*``.

    Raises:
        ValueError: no URL, or one that is not ``http(s)://``, for ``--prefill`` or ``--decode`` (named); a
            timeout that is not positive (``--timeout``), or an empty API key (``--api-key``).
    """
    proxy = _Proxy(prefill_urls, decode_urls, timeout)
    if api_key == "":
        raise ValueError("--api-key: must not be empty")

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await proxy.start()
        try:
            yield
        finally:
            await proxy.stop()

    async def handle(path: str, raw: Request) -> Response:
        try:
            body = json.loads(await raw.body())
        except (ValueError, RecursionError) as e:
            return error_response(400, f"invalid JSON body: {e}")
        if not isinstance(body, dict):
            return error_response(400, f"the body must be a JSON object, got {type(body).__name__}")
        return await _unless_disconnected(raw, proxy.complete(path, body, raw))

    app = FastAPI(title="kilat proxy", version=kilat.__version__, lifespan=lifespan)
    # kilat serve's guard: the API key (401), the body size (413), non-finite numbers (400).
    app.add_middleware(GuardMiddleware, api_key=api_key, max_body=ServerConfig().max_request_body_bytes)

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {}

    @app.get("/v1/models")
    async def models(raw: Request) -> Response:
        return await proxy.models(raw)

    def endpoint(path: str) -> Callable[[Request], Awaitable[Response]]:
        async def relay(raw: Request) -> Response:
            return await handle(path, raw)

        return relay

    for path in COMPLETION_PATHS:
        app.add_api_route(path, endpoint(path), methods=["POST"], response_class=Response,
                          name=path.removeprefix("/v1/").replace("/", "_"))

    return app


def run_proxy(prefill_urls: list[str], decode_urls: list[str], host: str = "127.0.0.1", port: int = 8000,
              timeout: float = 300.0, api_key: str | None = None, log_level: str = "info") -> None:
    """Serve :func:`build_app` on ``host:port`` with uvicorn until SIGINT or SIGTERM.

    Args:
        prefill_urls: base URLs of the prefill instances (see :func:`build_app`).
        decode_urls: base URLs of the decode instances.
        host: address to bind.
        port: TCP port (0: any free port).
        timeout: upstream timeout in seconds (see :func:`build_app`).
        api_key: the key clients must send, if any.
        log_level: uvicorn's log level.

    Raises:
        ValueError: an invalid argument (named by its flag), or an address that cannot be bound.
    """
    app = build_app(prefill_urls, decode_urls, timeout, api_key)
    prefills, decodes = _base_urls(prefill_urls, "--prefill"), _base_urls(decode_urls, "--decode")
    with bind_socket(host, port) as sock:
        bound_host, bound_port = sock.getsockname()[:2]
        server = UvicornServer(uvicorn.Config(app, log_level=log_level, timeout_graceful_shutdown=5),
                         f"proxying on http://{bound_host}:{bound_port}: prefill {', '.join(prefills)}; "
                         f"decode {', '.join(decodes)}")
        server.run(sockets=[sock])
