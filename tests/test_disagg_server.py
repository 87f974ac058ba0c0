"""Disaggregated prefill/decode end to end (issue 17): a ``kv_producer`` and a ``kv_consumer`` ``kilat serve`` of
the embedded model in float32 behind ``kilat proxy``, against one colocated server: the same greedy answers,
streamed and not; an abort during the transfer leaves 0 blocks in use on both sides (read from ``/metrics``); a
prefill instance killed mid-request gives the client a clear error within the timeout while the decode instance
keeps serving."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import requests

from tests.kv_relay import Relay
from tests.server_utils import Server, free_port, scrape_metrics
from tests.waiting import wait_until

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
PROMPT = "Kilat means lightning in Indonesian. Write a short story about a storm over Jakarta. " * 4
BYTES_PER_BLOCK = 2 * 30 * 16 * 3 * 64 * 4  # keys and values, 30 layers, 16 tokens, 3 KV heads of 64, float32


def _transfer(role: str, **extra: Any) -> list[str]:
    config = {"kv_connector": "TcpConnector", "kv_role": role, "kv_port": free_port(), **extra}
    return ["--kv-transfer-config", json.dumps(config)]


class Proxy:
    """``kilat proxy`` in a subprocess on a free port."""

    def __init__(self, prefill: str, decode: str, timeout_s: float = 30.0):
        self.url = f"http://127.0.0.1:{free_port()}"
        self.proc = subprocess.Popen([sys.executable, "-m", "kilat.entrypoints.cli", "proxy", "--prefill", prefill,
                                      "--decode", decode, "--port", self.url.rsplit(":", 1)[1],
                                      "--timeout", str(timeout_s)])
        wait_until(self._healthy, "kilat proxy answering /health", interval_s=0.2)

    def _healthy(self) -> bool:
        try:
            return requests.get(self.url + "/health", timeout=5).status_code == 200
        except requests.ConnectionError:
            return False

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)


@pytest.fixture(scope="module")
def servers() -> Iterator[tuple[Server, Server, Server, Proxy]]:
    common = ("--dtype", "float32", "--max-model-len", "2048")
    started: list[Any] = []
    try:
        for args in ((), _transfer("kv_producer"), _transfer("kv_consumer")):
            started.append(Server(*common, *args, new_session=True))
        started.append(Proxy(started[1].url, started[2].url))
        yield tuple(started)  # type: ignore[misc]
    finally:
        for s in reversed(started):
            s.stop()


def _complete(url: str, chat: bool, stream: bool, **extra: Any) -> str:
    body: dict[str, Any] = {"model": MODEL, "max_tokens": 24, "temperature": 0, "stream": stream, **extra}
    if chat:
        body["messages"] = [{"role": "user", "content": PROMPT}]
    else:
        body["prompt"] = PROMPT
    r = requests.post(f"{url}/v1/{'chat/completions' if chat else 'completions'}", json=body, timeout=120,
                      stream=stream)
    assert r.status_code == 200, r.text
    if not stream:
        choice = r.json()["choices"][0]
        return choice["message"]["content"] if chat else choice["text"]
    text = ""
    for line in r.iter_lines():
        if line.startswith(b"data: ") and line != b"data: [DONE]":
            for choice in json.loads(line[6:])["choices"]:
                text += (choice.get("delta") or {}).get("content") or choice.get("text") or ""
    return text


def _usage(url: str) -> float:
    return scrape_metrics(url)["kilat:kv_cache_usage_perc"]




@pytest.mark.parametrize("chat", [False, True])
def test_pd_answers_equal_the_colocated_server(servers, chat):
    colocated, prefill, decode, proxy = servers
    want = _complete(colocated.url, chat, stream=False)
    before = scrape_metrics(decode.url).get('kilat:kv_offload_blocks_total{direction="receive",tier="tcp"}', 0.0)
    for stream in (False, True):
        assert _complete(proxy.url, chat, stream) == want
    after = scrape_metrics(decode.url)['kilat:kv_offload_blocks_total{direction="receive",tier="tcp"}']
    if not chat:  # the first pull brought the prompt's full blocks but the last token's; the second found them cached
        num_tokens = len(requests.post(decode.url + "/tokenize", json={"prompt": PROMPT}, timeout=30).json()["tokens"])
        assert after - before == (num_tokens - 1) // 16 >= 4
    else:
        assert after - before >= 4
    wait_until(lambda: _usage(prefill.url) == 0.0, "the prefill instance freeing its KV blocks", interval_s=0.1)


def test_requests_the_transfer_cannot_serve_get_a_400(servers):
    _, prefill, decode, _ = servers
    remote = {"do_remote_decode": True}
    for body, word in (({"prompt": PROMPT, "stream": True, "kv_transfer_params": remote}, "stream=false"),
                       ({"prompt": [PROMPT, PROMPT], "kv_transfer_params": remote}, "one prompt"),
                       ({"prompt": PROMPT, "kv_transfer_params": {"do_remote_prefill": "yes"}}, "boolean")):
        r = requests.post(prefill.url + "/v1/completions", json={"model": MODEL, "max_tokens": 1, **body}, timeout=60)
        assert r.status_code == 400 and word in r.json()["error"]["message"], r.text
        assert r.json()["error"]["param"] == "kv_transfer_params"
    r = requests.post(decode.url + "/v1/completions", timeout=60,
                      json={"model": MODEL, "prompt": PROMPT, "max_tokens": 1, "kv_transfer_params": remote})
    assert r.status_code == 400 and "kv_role is 'kv_consumer'" in r.json()["error"]["message"]


def test_an_abort_during_the_transfer_frees_the_blocks_on_both_sides(servers):
    _, prefill, decode, _ = servers
    body = {"model": MODEL, "prompt": "A different prompt about thunder. " * 30, "max_tokens": 8, "temperature": 0}
    r = requests.post(prefill.url + "/v1/completions", json={**body, "max_tokens": 1, "kv_transfer_params": {
        "do_remote_decode": True}}, timeout=120)
    kv = r.json()["kv_transfer_params"]
    assert kv["do_remote_prefill"] is True and _usage(prefill.url) > 0
    relay = Relay(kv["remote_port"], "slow", BYTES_PER_BLOCK)

    def client() -> None:
        with requests.post(decode.url + "/v1/completions", stream=True, timeout=120,
                           json={**body, "stream": True, "kv_transfer_params": {**kv, "remote_port": relay.port}}):
            assert relay.started.wait(30)
            time.sleep(0.5)  # mid-transfer: the relay passes 20 KiB/s, a block is 720 KiB

    thread = threading.Thread(target=client)
    thread.start()
    thread.join(60)
    wait_until(lambda: _usage(decode.url) == 0.0 and _usage(prefill.url) == 0.0,
               "both instances freeing their KV blocks", interval_s=0.1)
    m = scrape_metrics(decode.url)
    assert m['kilat:request_success_total{finished_reason="abort"}'] >= 1


def test_a_killed_prefill_instance_gives_a_clear_error_and_decode_keeps_serving(servers):
    colocated, _, decode, _ = servers
    prefill = Server("--dtype", "float32", *_transfer("kv_producer"), new_session=True)
    proxy = Proxy(prefill.url, decode.url, timeout_s=20)
    try:
        result: dict[str, Any] = {}

        def client() -> None:
            start = time.monotonic()
            r = requests.post(proxy.url + "/v1/completions", timeout=120, json={
                "model": MODEL, "prompt": "storm " * 1500, "max_tokens": 4, "temperature": 0})
            result.update(status=r.status_code, body=r.json(), seconds=time.monotonic() - start)

        thread = threading.Thread(target=client)
        thread.start()
        time.sleep(1.0)  # the 1,500-token prompt is being prefilled
        os.killpg(prefill.proc.pid, signal.SIGKILL)
        thread.join(60)
        assert result["status"] == 502 and result["seconds"] < 20
        assert prefill.url in result["body"]["error"]["message"]
        assert _complete(decode.url, False, stream=False) == _complete(colocated.url, False, stream=False)
    finally:
        proxy.stop()
        prefill.stop()
