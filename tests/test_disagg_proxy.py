"""``kilat proxy`` (kilat.entrypoints.disagg_proxy) against fake prefill and decode instances: tiny FastAPI
apps served by uvicorn in threads, which record what they receive and answer as ``kilat serve`` would."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
import requests
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from kilat.entrypoints.cli import build_parser
from kilat.entrypoints.disagg_proxy import build_app, normalize_base_url
from tests.waiting import PATIENCE_S, wait_until

KV_PARAMS = {"do_remote_prefill": True, "remote_host": "127.0.0.1", "remote_port": 1234,
             "remote_request_id": "cmpl-x-0", "remote_engine_id": "e1"}
"""What the fake prefill instances answer as ``kv_transfer_params``."""


def sse_events(n: int) -> list[bytes]:
    """The fake decode's stream: ``n`` completion chunks, then ``[DONE]``."""
    chunks = [json.dumps({"id": "cmpl-d", "object": "text_completion",
                          "choices": [{"index": 0, "text": f" tok{i}", "finish_reason": None}]}) for i in range(n)]
    return [f"data: {c}\n\n".encode() for c in chunks] + [b"data: [DONE]\n\n"]


class Fake:
    """A fake ``kilat serve`` (prefill or decode role) on a free loopback port.

    Attributes:
        received: the JSON bodies of the POSTs, in order.
        headers: each POST's ``Authorization`` header (or ``None``).
        mode: how the next requests are answered: ``"ok"``, ``"error400"``, ``"no_params"``, ``"text"``,
            ``"hang"`` (waits 3 s first, unless the client goes) or ``"slow_stream"`` (one event per 0.1 s, 100
            events).
        client_gone: set when a hanging request or a slow stream noticed its client had gone.
    """

    def __init__(self, role: str, name: str):
        self.role = role
        self.name = name
        self.received: list[dict[str, Any]] = []
        self.headers: list[str | None] = []
        self.mode = "ok"
        self.stream_events_sent = 0
        self.client_gone = threading.Event()
        app = FastAPI()
        app.post("/v1/completions")(self.complete)
        app.post("/v1/chat/completions")(self.complete)
        app.get("/v1/models")(self.models)
        self.server, self.thread, self.url = serve(app)

    def reset(self) -> None:
        self.received.clear()
        self.headers.clear()
        self.mode = "ok"
        self.stream_events_sent = 0
        self.client_gone.clear()

    async def models(self) -> dict[str, Any]:
        return {"object": "list", "data": [{"id": f"model-of-{self.name}", "object": "model"}]}

    async def complete(self, request: Request) -> Response:
        body = await request.json()
        self.received.append(body)
        self.headers.append(request.headers.get("authorization"))
        if self.mode == "error400":
            return JSONResponse({"error": {"message": f"{self.name}: temperature must be >= 0",
                                           "type": "invalid_request_error", "param": "temperature",
                                           "code": None}}, status_code=400)
        if self.mode == "text":
            return PlainTextResponse("not json")
        if self.mode == "hang":
            for _ in range(30):
                await asyncio.sleep(0.1)
                if await request.is_disconnected():
                    self.client_gone.set()
                    return Response(status_code=499)
        if self.role == "prefill":
            answer: dict[str, Any] = {"id": "cmpl-p", "object": "text_completion", "model": "m",
                                      "choices": [{"index": 0, "text": "x", "finish_reason": "length"}],
                                      "usage": {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6}}
            if self.mode != "no_params":
                answer["kv_transfer_params"] = KV_PARAMS
            return JSONResponse(answer)
        if self.mode == "slow_stream":
            return StreamingResponse(self._slow_stream(request), media_type="text/event-stream")
        if body.get("stream"):
            return StreamingResponse(self._stream(), media_type="text/event-stream")
        params = body.get("kv_transfer_params")
        text = f"{self.name} decoded with remote KV from {params['remote_engine_id']}" if params else \
            f"{self.name} computed the prompt itself"
        return JSONResponse({"id": "cmpl-d", "object": "text_completion", "model": "m",
                             "choices": [{"index": 0, "text": text, "finish_reason": "length"}]})

    async def _stream(self) -> AsyncIterator[bytes]:
        for event in sse_events(5):
            yield event
            await asyncio.sleep(0.01)

    async def _slow_stream(self, request: Request) -> AsyncIterator[bytes]:
        try:
            for event in sse_events(100):
                yield event
                self.stream_events_sent += 1
                await asyncio.sleep(0.1)
        finally:
            if self.stream_events_sent < 101:
                self.client_gone.set()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve(app: FastAPI) -> tuple[uvicorn.Server, threading.Thread, str]:
    """``app`` served by uvicorn in a daemon thread, once it accepts connections; its base URL."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                                           timeout_graceful_shutdown=1, lifespan="on"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    wait_until(lambda: server.started or not thread.is_alive(), "the test server starting", interval_s=0.01)
    assert server.started, "the test server's thread ended before it started"
    return server, thread, f"http://127.0.0.1:{port}"


def stop(server: uvicorn.Server, thread: threading.Thread) -> None:
    server.should_exit = True
    thread.join(timeout=10)


@pytest.fixture(scope="module")
def fakes() -> Iterator[dict[str, Fake]]:
    instances = {name: Fake(name[:-1] if name[-1].isdigit() else name, name)
                 for name in ("prefill1", "prefill2", "decode1", "decode2")}
    yield instances
    for fake in instances.values():
        stop(fake.server, fake.thread)


@pytest.fixture(autouse=True)
def _reset(request: pytest.FixtureRequest) -> None:
    if "fakes" in request.fixturenames:
        for fake in request.getfixturevalue("fakes").values():
            fake.reset()


class Proxy:
    """``build_app(...)`` served by uvicorn; ``url`` is its base URL."""

    def __init__(self, prefill: list[str], decode: list[str], **kwargs: Any):
        self.server, self.thread, self.url = serve(build_app(prefill, decode, **kwargs))

    def post(self, path: str, body: Any, **kwargs: Any) -> requests.Response:
        data = body if isinstance(body, (str, bytes)) else json.dumps(body)
        return requests.post(self.url + path, data=data, timeout=30, **kwargs)

    def close(self) -> None:
        stop(self.server, self.thread)


@pytest.fixture
def proxy(fakes: dict[str, Fake]) -> Iterator[Proxy]:
    p = Proxy([fakes["prefill1"].url], [fakes["decode1"].url])
    yield p
    p.close()


def closed_port_url() -> str:
    return f"http://127.0.0.1:{free_port()}"


COMPLETION = {"model": "m", "prompt": "The capital of France is", "max_tokens": 16, "temperature": 0.0,
              "n": 1, "stream": False}


def test_completion_goes_through_prefill_then_decode(fakes: dict[str, Fake], proxy: Proxy):
    body = {**COMPLETION, "min_tokens": 4, "stream_options": None, "seed": 7}
    r = proxy.post("/v1/completions", body)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == "decode1 decoded with remote KV from e1"
    [sent] = fakes["prefill1"].received
    assert sent["max_tokens"] == 1 and sent["stream"] is False and sent["n"] == 1
    assert sent["kv_transfer_params"] == {"do_remote_decode": True, "do_remote_prefill": False}
    assert "min_tokens" not in sent and "stream_options" not in sent
    assert sent["prompt"] == body["prompt"] and sent["seed"] == 7
    [decoded] = fakes["decode1"].received
    assert decoded == {**body, "kv_transfer_params": KV_PARAMS}
    assert fakes["prefill2"].received == [] and fakes["decode2"].received == []


def test_chat_prefill_drops_max_completion_tokens(fakes: dict[str, Fake], proxy: Proxy):
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 32,
            "n": 2, "stream": False}
    r = proxy.post("/v1/chat/completions", body)
    assert r.status_code == 200, r.text
    [sent] = fakes["prefill1"].received
    assert sent["max_tokens"] == 1 and "max_completion_tokens" not in sent and sent["n"] == 1
    assert sent["messages"] == body["messages"]
    assert fakes["decode1"].received == [{**body, "kv_transfer_params": KV_PARAMS}]


def test_prefill_without_kv_transfer_params_sends_the_original_body(fakes: dict[str, Fake], proxy: Proxy):
    """...without the client's own kv_transfer_params: they never reach an instance."""
    fakes["prefill1"].mode = "no_params"
    own = {"do_remote_prefill": True, "remote_host": "10.1.2.3", "remote_port": 22}
    r = proxy.post("/v1/completions", {**COMPLETION, "kv_transfer_params": own})
    assert r.status_code == 200
    assert fakes["decode1"].received == [COMPLETION]
    assert fakes["prefill1"].received[0]["kv_transfer_params"] == {"do_remote_decode": True, "do_remote_prefill": False}
    assert r.json()["choices"][0]["text"] == "decode1 computed the prompt itself"


def test_stream_is_relayed_byte_for_byte(fakes: dict[str, Fake], proxy: Proxy):
    body = {**COMPLETION, "stream": True, "stream_options": {"include_usage": True}}
    with requests.post(proxy.url + "/v1/completions", json=body, stream=True, timeout=30) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        received = b"".join(r.iter_content(chunk_size=None))
    assert received == b"".join(sse_events(5))
    [sent] = fakes["prefill1"].received
    assert sent["stream"] is False and "stream_options" not in sent
    assert fakes["decode1"].received == [{**body, "kv_transfer_params": KV_PARAMS}]


def test_client_disconnect_mid_stream_reaches_the_decode_instance(fakes: dict[str, Fake], proxy: Proxy):
    decode = fakes["decode1"]
    decode.mode = "slow_stream"
    r = requests.post(proxy.url + "/v1/completions", json={**COMPLETION, "stream": True}, stream=True, timeout=30)
    lines = r.iter_lines()
    assert next(lines).startswith(b"data: ")
    r.close()
    assert decode.client_gone.wait(timeout=PATIENCE_S), "the decode instance did not see the disconnect"
    assert decode.stream_events_sent < 60


def test_round_robin(fakes: dict[str, Fake]):
    p = Proxy([fakes["prefill1"].url, fakes["prefill2"].url + "/v1/"], [fakes["decode1"].url + "/",
                                                                       fakes["decode2"].url + "/v1"])
    try:
        texts = [p.post("/v1/completions", COMPLETION).json()["choices"][0]["text"] for _ in range(4)]
    finally:
        p.close()
    assert [len(fakes[n].received) for n in ("prefill1", "prefill2", "decode1", "decode2")] == [2, 2, 2, 2]
    assert texts == ["decode1 decoded with remote KV from e1", "decode2 decoded with remote KV from e1"] * 2


def test_prefill_error_is_passed_through(fakes: dict[str, Fake], proxy: Proxy):
    fakes["prefill1"].mode = "error400"
    r = proxy.post("/v1/completions", {**COMPLETION, "temperature": -1})
    assert r.status_code == 400
    assert r.json() == {"error": {"message": "prefill1: temperature must be >= 0", "type": "invalid_request_error",
                                  "param": "temperature", "code": None}}
    assert fakes["decode1"].received == []


def test_prefill_not_json_is_502(fakes: dict[str, Fake], proxy: Proxy):
    fakes["prefill1"].mode = "text"
    r = proxy.post("/v1/completions", COMPLETION)
    assert r.status_code == 502
    error = r.json()["error"]
    assert error["type"] == "BadGatewayError" and error["code"] == 502
    assert fakes["prefill1"].url in error["message"] and "not a JSON object" in error["message"]
    assert fakes["decode1"].received == []


def test_unreachable_prefill_is_502_at_once(fakes: dict[str, Fake]):
    dead = closed_port_url()
    p = Proxy([dead], [fakes["decode1"].url])
    try:
        start = time.monotonic()
        r = p.post("/v1/completions", COMPLETION)
        elapsed = time.monotonic() - start
    finally:
        p.close()
    assert r.status_code == 502 and elapsed < 5
    assert r.json()["error"]["type"] == "BadGatewayError" and r.json()["error"]["param"] is None
    assert dead in r.json()["error"]["message"] and "prefill" in r.json()["error"]["message"]
    assert fakes["decode1"].received == []


def test_hung_prefill_is_504_after_the_timeout(fakes: dict[str, Fake]):
    fakes["prefill1"].mode = "hang"
    p = Proxy([fakes["prefill1"].url], [fakes["decode1"].url], timeout=1)
    try:
        start = time.monotonic()
        r = p.post("/v1/completions", COMPLETION)
        elapsed = time.monotonic() - start
    finally:
        p.close()
    assert r.status_code == 504 and 0.9 < elapsed < 10  # the 1 s timeout (the default is 300 s)
    error = r.json()["error"]
    assert error == {"message": error["message"], "type": "GatewayTimeoutError", "param": None, "code": 504}
    assert fakes["prefill1"].url in error["message"] and "1 s" in error["message"]
    assert fakes["decode1"].received == []
    assert fakes["prefill1"].client_gone.wait(timeout=PATIENCE_S), "the prefill instance did not see the proxy give up"


def test_client_disconnect_before_the_answer_reaches_the_instance(fakes: dict[str, Fake], proxy: Proxy):
    fakes["decode1"].mode = "hang"
    with pytest.raises(requests.Timeout):
        requests.post(proxy.url + "/v1/completions", json=COMPLETION, timeout=0.5)
    assert fakes["decode1"].client_gone.wait(timeout=PATIENCE_S), "the decode instance did not see the disconnect"
    assert len(fakes["prefill1"].received) == 1


def test_unreachable_decode_is_502(fakes: dict[str, Fake]):
    dead = closed_port_url()
    p = Proxy([fakes["prefill1"].url], [dead])
    try:
        r = p.post("/v1/completions", COMPLETION)
        streamed = p.post("/v1/completions", {**COMPLETION, "stream": True})
    finally:
        p.close()
    for response in (r, streamed):
        assert response.status_code == 502
        assert response.json()["error"]["type"] == "BadGatewayError"
        assert dead in response.json()["error"]["message"] and "decode" in response.json()["error"]["message"]
    assert len(fakes["prefill1"].received) == 2


def test_decode_error_before_streaming_is_passed_through(fakes: dict[str, Fake], proxy: Proxy):
    fakes["decode1"].mode = "error400"
    r = proxy.post("/v1/completions", {**COMPLETION, "stream": True})
    assert r.status_code == 400 and r.headers["content-type"].startswith("application/json")
    assert r.json()["error"]["message"] == "decode1: temperature must be >= 0"


@pytest.mark.parametrize("body", ["{not json", "[1, 2]", ""])
def test_bad_json_is_400(fakes: dict[str, Fake], proxy: Proxy, body: str):
    r = proxy.post("/v1/completions", body)
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["type"] == "BadRequestError" and error["code"] == 400 and error["param"] is None
    assert fakes["prefill1"].received == [] and fakes["decode1"].received == []


def test_api_key(fakes: dict[str, Fake]):
    p = Proxy([fakes["prefill1"].url], [fakes["decode1"].url], api_key="sk-proxy")
    try:
        missing = p.post("/v1/completions", COMPLETION)
        wrong = p.post("/v1/completions", COMPLETION, headers={"Authorization": "Bearer nope"})
        models = requests.get(p.url + "/v1/models", timeout=10)
        health = requests.get(p.url + "/health", timeout=10)
        ok = p.post("/v1/completions", COMPLETION, headers={"Authorization": "Bearer sk-proxy"})
    finally:
        p.close()
    assert missing.status_code == 401 and wrong.status_code == 401 and models.status_code == 401
    assert "API key" in missing.json()["error"]["message"]
    assert health.status_code == 200
    assert ok.status_code == 200
    assert fakes["prefill1"].headers == ["Bearer sk-proxy"] and fakes["decode1"].headers == ["Bearer sk-proxy"]


def test_health_and_models(fakes: dict[str, Fake]):
    p = Proxy([closed_port_url()], [fakes["decode2"].url, fakes["decode1"].url])
    try:
        health = requests.get(p.url + "/health", timeout=10)
        models = requests.get(p.url + "/v1/models", timeout=10)
    finally:
        p.close()
    assert health.status_code == 200 and health.json() == {}
    assert models.status_code == 200 and models.json()["data"][0]["id"] == "model-of-decode2"


@pytest.mark.parametrize(("prefill", "decode", "flag"), [
    ([], ["http://b:2"], "--prefill"), (["http://a:1"], [], "--decode"), (["ftp://a:1"], ["http://b:2"], "--prefill"),
    (["http://a:1"], ["localhost:8000"], "--decode"), (["http://a:1"], ["http://"], "--decode")])
def test_invalid_urls_are_value_errors(prefill: list[str], decode: list[str], flag: str):
    with pytest.raises(ValueError, match=flag):
        build_app(prefill, decode)


def test_invalid_timeout_and_key():
    with pytest.raises(ValueError, match="--timeout"):
        build_app(["http://a:1"], ["http://b:2"], timeout=0)
    with pytest.raises(ValueError, match="--api-key"):
        build_app(["http://a:1"], ["http://b:2"], api_key="")


@pytest.mark.parametrize(("url", "base"), [
    ("http://127.0.0.1:8100", "http://127.0.0.1:8100"), ("http://127.0.0.1:8100/", "http://127.0.0.1:8100"),
    ("http://h:8100/v1", "http://h:8100"), ("https://h/v1/", "https://h"), (" http://h:1/prefix/ ", "http://h:1/prefix")])
def test_normalize_base_url(url: str, base: str):
    assert normalize_base_url(url, "--prefill") == base


def test_cli_parses_proxy():
    ns = build_parser().parse_args(["proxy", "--prefill", "http://a:1", "--decode", "http://b:2", "--port", "9000"])
    assert (ns.prefill, ns.decode, ns.port, ns.host, ns.timeout) == (["http://a:1"], ["http://b:2"], 9000,
                                                                     "127.0.0.1", 300.0)
    ns = build_parser().parse_args(["proxy", "--prefill", "http://a:1", "http://a:2", "--decode", "http://b:2",
                                    "--timeout", "2.5", "--api-key", "k"])
    assert (ns.prefill, ns.timeout, ns.api_key) == (["http://a:1", "http://a:2"], 2.5, "k")
    assert ns.func.__name__ == "cmd_proxy"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["proxy", "--decode", "http://b:2"])
