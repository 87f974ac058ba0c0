"""``kilat serve`` end to end: the official openai client (sync and async, streaming and not) and raw HTTP
against a real server of the embedded model in float32, greedy unless stated."""

from __future__ import annotations

import asyncio
import json
import re
import signal
import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import openai
import pytest
import requests

from tests.server_utils import Server, pid_alive, scrape_metrics
from tests.waiting import wait_until

API_KEY = "sk-kilat-test"
MODEL = "SmolLM2-135M-Instruct"
MAX_MODEL_LEN = 2048
MAX_BODY = 64 * 1024
REPLACEMENT = "\ufffd"
AUTH = {"Authorization": f"Bearer {API_KEY}"}

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    srv = Server("--dtype", "float32", "--max-model-len", str(MAX_MODEL_LEN), "--api-key", API_KEY,
                 "--max-request-body-bytes", str(MAX_BODY), "--tool-call-parser", "hermes")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0)


def post(server: Server, path: str, body: Any, headers: dict[str, str] | None = None) -> requests.Response:
    """POST ``body`` as JSON; Python's ``json`` writes ``inf``/``nan`` as ``Infinity``/``NaN`` (not JSON)."""
    return requests.post(server.url + path, data=json.dumps(body).encode(), timeout=60,
                         headers={"Content-Type": "application/json", **(AUTH if headers is None else headers)})


def metrics(server: Server) -> dict[str, float]:
    return scrape_metrics(server.url)


def chat_text(client: openai.OpenAI, content: str, stream: bool, **kwargs: Any) -> tuple[str, str | None]:
    """(text, finish_reason) of one greedy chat completion; streamed chunks are checked and joined."""
    messages = [{"role": "user", "content": content}]
    if not stream:
        r = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, **kwargs)
        return r.choices[0].message.content, r.choices[0].finish_reason
    pieces, reasons = [], []
    for chunk in client.chat.completions.create(model=MODEL, messages=messages, temperature=0, stream=True,
                                                **kwargs):
        choice = chunk.choices[0]
        pieces.append(choice.delta.content or "")
        reasons.append(choice.finish_reason)
    assert reasons[-1] is not None and all(r is None for r in reasons[:-1])
    assert all(REPLACEMENT not in p for p in pieces)
    return "".join(pieces), reasons[-1]


def assert_healthy(server: Server) -> None:
    """After an error the server still answers /health and serves a normal request."""
    assert requests.get(server.url + "/health", timeout=10).status_code == 200
    r = post(server, "/v1/completions", {"model": MODEL, "prompt": "Hello", "max_tokens": 3, "temperature": 0})
    assert r.status_code == 200
    assert r.json()["usage"]["completion_tokens"] == 3


def test_models_health_version_metrics(server: Server) -> None:
    models = requests.get(server.url + "/v1/models", headers=AUTH, timeout=10).json()
    assert [m["id"] for m in models["data"]] == [MODEL]
    assert models["data"][0]["max_model_len"] == MAX_MODEL_LEN
    assert requests.get(server.url + "/health", timeout=10).status_code == 200
    assert requests.get(server.url + "/version", timeout=10).json()["version"] == "0.1.0"
    text = requests.get(server.url + "/metrics", timeout=10).text
    for name in ("time_to_first_token_seconds", "inter_token_latency_seconds", "time_per_output_token_seconds",
                 "e2e_request_latency_seconds", "request_queue_time_seconds", "request_prefill_time_seconds",
                 "request_decode_time_seconds", "prompt_tokens_total", "generation_tokens_total",
                 "prefix_cache_queries_total", "prefix_cache_hits_total", "num_preemptions_total",
                 "num_preempted_tokens_total",
                 "request_success_total", "num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"):
        assert f"kilat:{name}" in text


def test_completion_matches_offline_engine(server: Server, client: openai.OpenAI) -> None:
    from kilat import LLM, SamplingParams

    prompts = ["The capital of France is", "def fibonacci(n):"]
    llm = LLM(dtype="float32", max_model_len=MAX_MODEL_LEN)
    expected = [o.outputs[0] for o in llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24),
                                                   use_tqdm=False)]
    del llm
    r = client.completions.create(model=MODEL, prompt=prompts, max_tokens=24, temperature=0)
    assert [c.text for c in sorted(r.choices, key=lambda c: c.index)] == [e.text for e in expected]
    assert r.usage.completion_tokens == sum(len(e.token_ids) for e in expected)
    ids = post(server, "/tokenize", {"prompt": prompts[0]}).json()["tokens"]
    by_ids = client.completions.create(model=MODEL, prompt=[ids], max_tokens=24, temperature=0)
    assert by_ids.choices[0].text == expected[0].text


def test_cache_salt_separates_the_prefix_cache(client: openai.OpenAI) -> None:
    """OpenAI's ``usage.prompt_tokens_details.cached_tokens`` per request: a salt reuses only its own blocks."""
    prompt = "Kilat means lightning in Indonesian. " * 12

    def run(salt: str | None, chat: bool) -> tuple[str, int]:
        extra = {"cache_salt": salt} if salt else {}
        if chat:
            r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}],
                                               max_tokens=4, temperature=0, extra_body=extra)
            text = r.choices[0].message.content
        else:
            r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0, extra_body=extra)
            text = r.choices[0].text
        return text, r.usage.prompt_tokens_details.cached_tokens

    for chat in (False, True):
        first, second, third = run("salt-a", chat), run("salt-b", chat), run("salt-a", chat)
        assert first[1] == second[1] == 0 and third[1] >= 64
        assert first[0] == second[0] == third[0]


@pytest.mark.parametrize("content", [
    "Write a short poem about the sea.",
    "Translate to Chinese: I love my family.",
    "Reply with three emoji that describe happiness.",
])
def test_streaming_equals_non_streaming(client: openai.OpenAI, content: str) -> None:
    whole, reason = chat_text(client, content, stream=False, max_tokens=32)
    streamed, streamed_reason = chat_text(client, content, stream=True, max_tokens=32)
    assert streamed == whole
    assert streamed_reason == reason == "length"
    assert REPLACEMENT not in whole


def test_streamed_multibyte_text_is_non_ascii(client: openai.OpenAI) -> None:
    zh, _ = chat_text(client, "Translate to Chinese: I love my family.", stream=True, max_tokens=32)
    emoji, _ = chat_text(client, "Reply with three emoji that describe happiness.", stream=True, max_tokens=32)
    assert any("\u4e00" <= ch <= "\u9fff" for ch in zh)
    assert any(ord(ch) > 0xFFFF for ch in emoji)


def _tokens(client: openai.OpenAI, prompt: str, max_tokens: int) -> list[str]:
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0, logprobs=0)
    assert "".join(r.choices[0].logprobs.tokens) == r.choices[0].text
    return r.choices[0].logprobs.tokens


def _stream_completion(client: openai.OpenAI, **kwargs: Any) -> tuple[list[str], str | None]:
    pieces, reasons = [], []
    for chunk in client.completions.create(model=MODEL, temperature=0, stream=True, **kwargs):
        pieces.append(chunk.choices[0].text)
        reasons.append(chunk.choices[0].finish_reason)
    assert reasons[-1] is not None and all(r is None for r in reasons[:-1])
    return pieces, reasons[-1]


PROMPT = "Once upon a time, in a small village,"


@pytest.mark.parametrize("kind", ["spans_tokens", "ends_inside_token", "never_matches"])
def test_stop_string_streaming(client: openai.OpenAI, kind: str) -> None:
    tokens = _tokens(client, PROMPT, 40)
    full = "".join(tokens)
    k = next(i for i in range(8, len(tokens) - 1) if len(tokens[i]) >= 3 and len(tokens[i + 1]) >= 3)
    before = "".join(tokens[:k])
    if kind == "spans_tokens":
        stop = tokens[k][-2:] + tokens[k + 1][:2]
    elif kind == "ends_inside_token":
        stop = tokens[k - 1][-1:] + tokens[k][:2]
    else:
        stop = full[-3:] + "\u2603"
    whole = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=40, temperature=0, stop=[stop])
    pieces, reason = _stream_completion(client, prompt=PROMPT, max_tokens=40, stop=[stop])
    assert "".join(pieces) == whole.choices[0].text
    if kind == "never_matches":
        assert whole.choices[0].text == full
        assert reason == whole.choices[0].finish_reason == "length"
    else:
        cut = full.find(stop)
        assert 0 < cut < len(before) + len(tokens[k])
        assert whole.choices[0].text == full[:cut]
        assert reason == whole.choices[0].finish_reason == "stop"
        assert whole.choices[0].stop_reason == stop
    assert not any(stop in "".join(pieces[:i + 1]) for i in range(len(pieces)))


def test_async_client_concurrent(server: Server, client: openai.OpenAI) -> None:
    prompts = ["Name three colors.", "What is 2 + 2?", "Say hello in French.", "Describe a cat."]
    expected = [chat_text(client, p, stream=False, max_tokens=20)[0] for p in prompts]

    async def run() -> list[str]:
        aclient = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0)

        async def streamed(p: str) -> str:
            stream = await aclient.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": p}], temperature=0, max_tokens=20, stream=True)
            return "".join([c.choices[0].delta.content or "" async for c in stream])

        async def whole(p: str) -> str:
            r = await aclient.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": p}], temperature=0, max_tokens=20)
            return r.choices[0].message.content

        results = await asyncio.gather(*[streamed(p) for p in prompts], *[whole(p) for p in prompts])
        await aclient.close()
        return results

    assert asyncio.run(run()) == expected + expected


def test_n_and_several_prompts_streamed(client: openai.OpenAI) -> None:
    prompts = ["One, two,", "Red, green,"]
    reasons: dict[int, list[str | None]] = {i: [] for i in range(4)}
    texts: dict[int, str] = {i: "" for i in range(4)}
    usage = None
    for chunk in client.completions.create(model=MODEL, prompt=prompts, n=2, max_tokens=8, temperature=0.8, seed=3,
                                           stream=True, stream_options={"include_usage": True}):
        if chunk.usage is not None:
            usage = chunk.usage
            assert chunk.choices == []
            continue
        for c in chunk.choices:
            reasons[c.index].append(c.finish_reason)
            texts[c.index] += c.text
    for i in range(4):
        assert reasons[i][-1] == "length" and all(r is None for r in reasons[i][:-1])
    assert usage is not None and usage.completion_tokens == 4 * 8
    whole = client.completions.create(model=MODEL, prompt=prompts, n=2, max_tokens=8, temperature=0.8, seed=3)
    assert {c.index: c.text for c in whole.choices} == texts
    assert whole.usage.prompt_tokens == usage.prompt_tokens


def test_completion_logprobs_with_echo(client: openai.OpenAI) -> None:
    r = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=5, temperature=0,
                                  logprobs=2, echo=True)
    lp = r.choices[0].logprobs
    num_prompt = r.usage.prompt_tokens
    assert len(lp.tokens) == num_prompt + 5
    assert "".join(lp.tokens) == r.choices[0].text
    assert r.choices[0].text.startswith("The capital of France is")
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    for i in range(num_prompt, len(lp.tokens)):  # greedy: the chosen token is the most likely
        assert len(lp.top_logprobs[i]) == 2
        assert max(lp.top_logprobs[i].values()) == pytest.approx(lp.token_logprobs[i], abs=1e-5)


def test_logprob_bytes_rebuild_multibyte_text(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model=MODEL, max_tokens=16, temperature=0, logprobs=True, messages=[
        {"role": "user", "content": "Reply with three emoji that describe happiness."}])
    content = r.choices[0].logprobs.content
    text = r.choices[0].message.content
    assert any(ord(ch) > 0xFFFF for ch in text)
    assert any("\ufffd" in c.token for c in content)  # some tokens hold part of an emoji ...
    # ... and their bytes rebuild it (less a character cut by max_tokens, which the text leaves out too)
    assert bytes(b for c in content for b in c.bytes).decode("utf-8", errors="ignore") == text
    prompt = "月亮 😀 bulan"
    e = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0, echo=True,
                                  logprobs=0, extra_body={"skip_special_tokens": True})
    offsets = e.choices[0].logprobs.text_offset
    assert offsets == sorted(offsets) and offsets[-1] < len(e.choices[0].text)
    assert offsets[:3] == [0, 0, 1]  # 月 spans two tokens; 亮 starts at character 1


def test_chat_logprobs(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=6,
                                       temperature=0, logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == 6
    assert "".join(c.token for c in content) == r.choices[0].message.content
    for c in content:
        assert [t.logprob for t in c.top_logprobs] == sorted((t.logprob for t in c.top_logprobs), reverse=True)
        assert len(c.top_logprobs) == 3 and c.top_logprobs[0].token == c.token
        assert bytes(c.bytes).decode() == c.token


def test_chat_message_forms(client: openai.OpenAI) -> None:
    parts = [{"type": "text", "text": "What is the capital"}, {"type": "text", "text": "of France?"}]
    a = client.chat.completions.create(model=MODEL, messages=[
        {"role": "system", "content": "Answer briefly."}, {"role": "user", "content": parts}],
        max_tokens=8, temperature=0)
    b = client.chat.completions.create(model=MODEL, messages=[
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "What is the capital\nof France?"}], max_tokens=8, temperature=0)
    assert a.choices[0].message.content == b.choices[0].message.content
    cont = client.chat.completions.create(model=MODEL, messages=[
        {"role": "user", "content": "Count to five."}, {"role": "assistant", "content": "1, 2, 3,"}],
        max_tokens=4, temperature=0, extra_body={"add_generation_prompt": False, "continue_final_message": True})
    assert cont.choices[0].message.content.strip().startswith("4")


def test_tool_message_and_chat_n(client: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "What is the weather in Jakarta?"},
                {"role": "assistant", "content": "Let me check."},
                {"role": "tool", "content": "31 degrees, sunny", "tool_call_id": "call_1"}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, n=3, max_tokens=10, temperature=0.9,
                                           seed=5)
    assert sorted(c.index for c in whole.choices) == [0, 1, 2]
    texts = {i: "" for i in range(3)}
    reasons: dict[int, list[str | None]] = {i: [] for i in range(3)}
    for chunk in client.chat.completions.create(model=MODEL, messages=messages, n=3, max_tokens=10,
                                                temperature=0.9, seed=5, stream=True):
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            reasons[c.index].append(c.finish_reason)
    assert texts == {c.index: c.message.content for c in whole.choices}
    for i in range(3):
        assert reasons[i][-1] == whole.choices[i].finish_reason
        assert all(r is None for r in reasons[i][:-1])


def test_streamed_completion_logprobs(client: openai.OpenAI) -> None:
    whole = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0, logprobs=2)
    tokens, offsets, token_logprobs = [], [], []
    text = ""
    for chunk in client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0, logprobs=2,
                                           stream=True):
        c = chunk.choices[0]
        text += c.text
        if c.logprobs is not None:
            tokens += c.logprobs.tokens
            offsets += c.logprobs.text_offset
            token_logprobs += c.logprobs.token_logprobs
    lp = whole.choices[0].logprobs
    assert text == whole.choices[0].text
    assert (tokens, offsets) == (lp.tokens, lp.text_offset)
    assert token_logprobs == pytest.approx(lp.token_logprobs, abs=1e-5)


@pytest.mark.parametrize("stream", [False, True])
def test_echo_with_zero_max_tokens_scores_the_prompt(client: openai.OpenAI, stream: bool) -> None:
    kwargs = {"model": MODEL, "prompt": "The capital of France is Paris", "max_tokens": 0, "echo": True,
              "logprobs": 1, "temperature": 0}
    if stream:
        chunks = list(client.completions.create(stream=True, **kwargs))
        text = "".join(c.choices[0].text for c in chunks)
        lp_tokens = [t for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    else:
        r = client.completions.create(**kwargs)
        text, lp_tokens = r.choices[0].text, r.choices[0].logprobs.tokens
        assert r.usage.completion_tokens == 0
        assert r.choices[0].logprobs.token_logprobs[0] is None
        assert all(x < 0 for x in r.choices[0].logprobs.token_logprobs[1:])
    assert text == "The capital of France is Paris"
    assert "".join(lp_tokens) == text


def test_extra_sampling_fields(client: openai.OpenAI) -> None:
    r = client.completions.create(model=MODEL, prompt="Hello", max_tokens=6, temperature=0, extra_body={
        "min_tokens": 6, "ignore_eos": True, "top_k": 5, "min_p": 0.01, "repetition_penalty": 1.1,
        "skip_special_tokens": True, "include_stop_str_in_output": False, "stop_token_ids": [2]})
    assert r.usage.completion_tokens == 6
    extreme = client.completions.create(model=MODEL, prompt="Hello", max_tokens=3, top_p=1e-300,
                                        extra_body={"top_k": 10**6, "ignore_eos": True})
    assert extreme.usage.completion_tokens == 3


def test_assistant_tool_call_without_content(client: openai.OpenAI) -> None:
    call = {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Bogor"}'}}
    r = client.chat.completions.create(model=MODEL, max_tokens=4, temperature=0, messages=[
        {"role": "user", "content": "Weather in Bogor?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "rainy"}])
    assert r.choices[0].finish_reason in ("stop", "length")


def test_auth_scheme_is_case_insensitive_and_health_answers_head(server: Server) -> None:
    r = post(server, "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 1},
             headers={"Authorization": f"bearer {API_KEY}"})
    assert r.status_code == 200
    assert requests.head(server.url + "/health", timeout=10).status_code == 200


def test_tokenize_detokenize(server: Server) -> None:
    r = post(server, "/tokenize", {"prompt": "Selamat pagi"}).json()
    assert r["count"] == len(r["tokens"]) and r["max_model_len"] == MAX_MODEL_LEN
    assert post(server, "/detokenize", {"tokens": r["tokens"]}).json()["prompt"] == "Selamat pagi"
    chat = post(server, "/tokenize", {"messages": [{"role": "user", "content": "Hi"}]}).json()
    assert chat["count"] > r["count"]


LONG_PROMPT = "hello " * 2100


@pytest.mark.parametrize(("path", "body", "param", "needle"), [
    ("/v1/completions", {"prompt": "x", "temperature": -1}, "temperature", "temperature"),
    ("/v1/completions", {"prompt": "x", "n": 0}, "n", "n must be"),
    ("/v1/completions", {"prompt": "x", "temperature": "hot"}, "temperature", "temperature"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 5000}, "max_tokens", "2048"),
    ("/v1/completions", {"prompt": LONG_PROMPT}, "prompt", "2048"),
    ("/v1/completions", {"prompt": []}, "prompt", "empty"),
    ("/v1/completions", {"prompt": [[1, 2], [999999]]}, "prompt", "49152"),
    ("/v1/completions", {"prompt": "x", "stop_token_ids": [10 ** 7]}, "stop_token_ids", "stop_token_ids"),
    ("/v1/completions", {"prompt": "x", "logprobs": 50}, "logprobs", "logprobs"),
    ("/v1/chat/completions", {"messages": []}, "messages", "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 30,
                              "logprobs": True}, "top_logprobs", "top_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x"}}]}]}, None, "text"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, "messages", "role"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 4096},
     "max_tokens", "2048"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "chat_template": "{{ 1 }}"},
     "chat_template", "trust-request-chat-template"),
    ("/v1/completions", {"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options", "stream"),
    ("/v1/completions", {"prompt": "x", "n": 129}, "n", "128"),
    ("/v1/completions", {"prompt": ["x"] * 100, "n": 50}, "prompt", "4096"),
    ("/v1/completions", {"prompt": "x", "stop": ["s"] * 65}, "stop", "64"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, "max_tokens", ">= 1"),
    ("/v1/completions", {"prompt": "Hi \ud800 there"}, "prompt", "surrogate"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "\ud800"}]}, "messages", "surrogate"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": LONG_PROMPT}]}, "messages", "2048"),
    ("/v1/completions", {"prompt": [True, False]}, "prompt", "prompt"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}}},
     "structured_outputs", "invalid JSON schema: Unsupported type"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "response_format": {
        "type": "json_schema", "json_schema": {"name": "x"}}}, "response_format", "schema"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "xml"}},
     "response_format", "'xml'"),
    ("/v1/completions", {"prompt": "x", "structured_outputs": {"regex": "a(b"}}, "structured_outputs",
     "invalid regex"),
    ("/v1/completions", {"prompt": "x", "structured_outputs": {"grammar": "root ::= "}}, "structured_outputs",
     "invalid grammar"),
    ("/v1/completions", {"prompt": "x", "structured_outputs": {"regex": "a", "choice": ["b"]}},
     "structured_outputs", "exactly one"),
    ("/v1/completions", {"prompt": "x", "structured_outputs": {"jsonschema": {}}}, "structured_outputs",
     "unknown keys"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": {
        "messages": "x"}}, "chat_template_kwargs", "must not set ['messages']"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": {
        "chat_template": "{{ 1 }}", "tokenize": True}}, "chat_template_kwargs", "['chat_template', 'tokenize']"),
    ("/tokenize", {"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": {"tools": []}},
     "chat_template_kwargs", "must not set ['tools']"),
    # Python's json (and so requests) writes inf/nan as Infinity/NaN, which are not JSON numbers.
    ("/v1/completions", {"prompt": "x", "temperature": float("inf")}, "temperature", "finite"),
    ("/v1/completions", {"prompt": "x", "temperature": float("nan")}, "temperature", "finite"),
    ("/v1/completions", {"prompt": "x", "temperature": 1e308}, "temperature", "in [0, 100]"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "repetition_penalty": float("inf")},
     "repetition_penalty", "finite"),
    ("/v1/completions", {"prompt": "x", "repetition_penalty": 1e6}, "repetition_penalty", "in [0.01, 100]"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"5": float("-inf")}}, "logit_bias", "finite"),
    ("/v1/completions", {"prompt": "x", "structured_outputs": {"json": {"type": "number", "maximum": float("inf")}}},
     "structured_outputs", "structured_outputs.json.maximum: inf is not a finite number"),
    ("/v1/completions", {"prompt": "x", "top_k": 1e9}, "top_k", "valid integer"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 8.0}, "max_tokens", "valid integer"),
    ("/v1/completions", {"prompt": "x", "seed": 2 ** 64}, "seed", "64-bit"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "min_tokens": 3000}, "min_tokens",
     "min_tokens must be <= max_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "tools": [
        {"type": "function", "function": {"name": "f"}}], "parallel_tool_calls": 0},
     "parallel_tool_calls", "valid boolean"),
    ("/v1/completions", {"prompt": "x", "stream": 1}, "stream", "valid boolean"),
    ("/v1/completions", {"prompt": "x", "cache_salt": ""}, "cache_salt", "non-empty string"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "cache_salt": 5}, "cache_salt",
     "valid string"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "logprobs": "true"}, "logprobs",
     "valid boolean"),
    ("/v1/completions", {"prompt": "x", "priority": 1}, "priority", "needs the 'priority' scheduling policy"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "thinking_token_budget": 5},
     "thinking_token_budget", "needs a server started with --reasoning-parser"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "thinking_token_budget": 5,
                              "thinking_budget": 6}, "thinking_token_budget", "differ"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "thinking_budget": -1},
     "thinking_token_budget", ">= 0"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "priority": "high"}, "priority",
     "valid integer"),
])
def test_bad_request_is_400(server: Server, path: str, body: dict[str, Any], param: str | None,
                            needle: str) -> None:
    r = post(server, path, {"model": MODEL, **body})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error"
    assert needle in error["message"]
    if param is not None:
        assert error["param"] == param
    assert_healthy(server)


@pytest.mark.parametrize("body, param, needle", [
    ({"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": {"a": {"b": [1, {"c": float("nan")}]}}},
     "chat_template_kwargs", "chat_template_kwargs.a.b.1.c: nan is not a finite number"),
    ({"messages": [{"role": "user", "content": "x"}], "logit_bias": {"7": 1.0, "9": float("inf")}},
     "logit_bias", "logit_bias.9: inf is not a finite number"),
])
def test_non_finite_number_deep_in_a_field_is_named(server: Server, body: dict[str, Any], param: str,
                                                     needle: str) -> None:
    r = post(server, "/v1/chat/completions", {"model": MODEL, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param and needle in r.json()["error"]["message"], r.text


def test_deeply_nested_body_with_nan_is_400(server: Server) -> None:
    """Nesting beyond ``json``'s recursion limit used to raise RecursionError in the non-finite check: 500."""
    body = b'{"prompt": "x", "max_tokens": 1, "user": ' + b"[" * 5000 + b"NaN" + b"]" * 5000 + b"}"
    r = requests.post(server.url + "/v1/completions", data=body, timeout=30,
                      headers={**AUTH, "Content-Type": "application/json"})
    assert r.status_code == 400, r.text
    assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    assert_healthy(server)


def test_wrong_method_is_405_with_allow(server: Server) -> None:
    r = requests.get(server.url + "/v1/completions", headers=AUTH, timeout=10)
    assert r.status_code == 405
    assert r.headers["Allow"] == "POST"
    assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    r = requests.post(server.url + "/health", timeout=10)
    assert r.status_code == 405 and set(r.headers["Allow"].split(", ")) == {"GET", "HEAD"}


def test_openapi_declares_the_error_responses(server: Server) -> None:
    schema = requests.get(server.url + "/openapi.json", timeout=10).json()
    assert "422" not in json.dumps(schema["paths"])
    assert "HTTPValidationError" not in schema["components"]["schemas"]
    error = schema["components"]["schemas"]["ErrorInfo"]
    assert set(error["properties"]) == {"message", "type", "param", "code"}
    for path in ("/v1/completions", "/v1/chat/completions"):
        responses = schema["paths"][path]["post"]["responses"]
        assert set(responses) == {"200", "400", "401", "404", "413", "500", "503"}
        assert responses["400"]["content"]["application/json"]["schema"] == {
            "$ref": "#/components/schemas/ErrorResponse"}
    for path in ("/tokenize", "/detokenize"):
        assert set(schema["paths"][path]["post"]["responses"]) == {"200", "400", "401", "404", "413"}
    health = schema["paths"]["/health"]["get"]["responses"]
    assert set(health) == {"200", "503"} and "content" not in health["200"]  # an empty body, not JSON


@pytest.mark.parametrize("content_type", [None, "text/plain", "application/x-www-form-urlencoded"])
def test_json_body_without_json_content_type(server: Server, content_type: str | None) -> None:
    body = json.dumps({"model": MODEL, "prompt": "Hello", "max_tokens": 2, "temperature": 0})
    headers = {**AUTH, **({"Content-Type": content_type} if content_type else {})}
    r = requests.post(server.url + "/v1/completions", data=body.encode(), headers=headers, timeout=60)
    assert r.request.headers.get("Content-Type") == content_type
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 2


def test_tokenize_renders_like_chat(server: Server) -> None:
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    r = post(server, "/tokenize", {"messages": messages, "add_generation_prompt": False,
                                   "continue_final_message": True})
    assert r.status_code == 200, r.text
    text = post(server, "/detokenize", {"tokens": r.json()["tokens"]}).json()["prompt"]
    assert text.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello")
    closed = post(server, "/tokenize", {"messages": messages, "add_generation_prompt": False}).json()
    assert closed["tokens"][:r.json()["count"]] == r.json()["tokens"]
    assert post(server, "/detokenize", {"tokens": closed["tokens"]}).json()["prompt"] == text + "<|im_end|>\n"
    both = post(server, "/tokenize", {"messages": messages, "continue_final_message": True})
    assert both.status_code == 400 and "continue_final_message" in both.json()["error"]["message"]
    # With tools, /tokenize counts the prompt that the chat endpoint sends to the model.
    question = [{"role": "user", "content": "Weather in Rome?"}]
    count = post(server, "/tokenize", {"messages": question, "tools": TOOLS}).json()["count"]
    chat = post(server, "/v1/chat/completions", {"model": MODEL, "messages": question, "tools": TOOLS,
                                                 "max_tokens": 1})
    assert chat.json()["usage"]["prompt_tokens"] == count
    assert count > post(server, "/tokenize", {"messages": question}).json()["count"] + 20


def test_special_tokens_in_text_as_generated(client: openai.OpenAI) -> None:
    """EOS kept in the text (skip_special_tokens false, include_stop_str_in_output, EOS a stop token id):
    the text equals the generated tokens' bytes, with no space inserted before <|im_end|>."""
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Say hello."}], temperature=0, max_tokens=64,
        logprobs=True, extra_body={"skip_special_tokens": False, "include_stop_str_in_output": True,
                                   "stop_token_ids": [2]})
    choice = r.choices[0]
    assert choice.finish_reason == "stop"
    generated = b"".join(bytes(t.bytes) for t in choice.logprobs.content).decode()
    assert choice.message.content == generated
    assert generated.endswith("<|im_end|>") and not generated.endswith(" <|im_end|>")


def test_prompt_too_long_message_gives_both_numbers(server: Server) -> None:
    r = post(server, "/v1/completions", {"model": MODEL, "prompt": LONG_PROMPT, "max_tokens": 1})
    num_tokens = post(server, "/tokenize", {"prompt": LONG_PROMPT}).json()["count"]
    assert r.status_code == 400
    assert str(num_tokens) in r.json()["error"]["message"] and "2048" in r.json()["error"]["message"]
    assert_healthy(server)


def test_malformed_json_is_400(server: Server) -> None:
    r = requests.post(server.url + "/v1/completions", data=b'{"prompt": "x",', timeout=10,
                      headers={**AUTH, "Content-Type": "application/json"})
    assert r.status_code == 400
    assert r.json()["error"]["param"] is None and "invalid JSON" in r.json()["error"]["message"]
    assert_healthy(server)


def test_unknown_model_is_404(server: Server) -> None:
    r = post(server, "/v1/chat/completions", {"model": "gpt-9", "messages": [{"role": "user", "content": "x"}]})
    assert r.status_code == 404
    assert r.json()["error"]["code"] == "model_not_found" and r.json()["error"]["param"] == "model"
    assert requests.get(server.url + "/v2/nothing", timeout=10).status_code == 404
    assert_healthy(server)


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}])
def test_api_key_is_401(server: Server, headers: dict[str, str]) -> None:
    r = post(server, "/v1/completions", {"model": MODEL, "prompt": "x"}, headers=headers)
    assert r.status_code == 401
    assert r.headers["WWW-Authenticate"] == "Bearer"  # RFC 7235: a 401 names its scheme
    assert r.json()["error"]["code"] == "invalid_api_key"
    assert requests.get(server.url + "/v1/models", timeout=10).status_code == 401
    assert requests.get(server.url + "/health", timeout=10).status_code == 200
    assert_healthy(server)


def test_oversized_body_is_413(server: Server) -> None:
    big = {"model": MODEL, "prompt": "x" * (MAX_BODY + 10)}
    assert post(server, "/v1/completions", big).status_code == 413

    def chunks() -> Iterator[bytes]:
        data = json.dumps(big).encode()
        for i in range(0, len(data), 8192):
            yield data[i:i + 8192]

    r = requests.post(server.url + "/v1/completions", data=chunks(), timeout=30,
                      headers={**AUTH, "Content-Type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    assert_healthy(server)


def _wait_idle(server: Server) -> dict[str, float]:
    """The server's metrics once nothing runs, waits or holds KV blocks (failing the test if that never happens)."""

    def idle() -> dict[str, float] | None:
        m = metrics(server)
        busy = m["kilat:num_requests_running"] or m["kilat:num_requests_waiting"] or m["kilat:kv_cache_usage_perc"]
        return None if busy else m

    return wait_until(idle, "the server going idle (no request running or waiting, no KV block in use)")


def _raw_request(server: Server, body: dict[str, Any]) -> socket.socket:
    data = json.dumps(body).encode()
    sock = socket.create_connection(("127.0.0.1", server.port))
    sock.sendall(b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nAuthorization: Bearer %s\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (body.pop("_path").encode(), API_KEY.encode(), len(data), data))
    return sock


@pytest.mark.parametrize("stream", [True, False])
def test_disconnect_aborts_and_frees_blocks(server: Server, stream: bool) -> None:
    before = metrics(server)['kilat:request_success_total{finished_reason="abort"}']
    body = {"_path": "/v1/completions", "model": MODEL, "prompt": "Tell me a long story.", "max_tokens": 1000,
            "temperature": 0, "ignore_eos": True, "stream": stream}
    if stream:
        with requests.post(server.url + "/v1/completions", json={k: v for k, v in body.items() if k != "_path"},
                           headers=AUTH, stream=True, timeout=60) as r:
            chunks = []
            for line in r.iter_lines():
                if line.startswith(b"data: "):
                    chunks.append(line)
                if len(chunks) == 2:
                    break
            assert len(chunks) == 2
            wait_until(lambda: metrics(server)["kilat:num_requests_running"] == 1, "the gauge counting the stream")
    else:
        sock = _raw_request(server, body)
        wait_until(lambda: metrics(server)["kilat:num_requests_running"] == 1, "the request starting")
        sock.close()
    closed = time.monotonic()
    m = _wait_idle(server)
    # aborted (not finished: its 1,000 float32 tokens take about 30 s here), and soon after the disconnect
    assert m['kilat:request_success_total{finished_reason="abort"}'] == before + 1
    assert time.monotonic() - closed < 10
    assert_healthy(server)


def test_usage_counters_agree_with_responses(server: Server, client: openai.OpenAI) -> None:
    before = metrics(server)
    r = client.completions.create(model=MODEL, prompt=["a b c", "d e f g"], max_tokens=7, temperature=0,
                                  extra_body={"ignore_eos": True})
    after = metrics(server)
    assert after["kilat:generation_tokens_total"] - before["kilat:generation_tokens_total"] == 14
    assert after["kilat:prompt_tokens_total"] - before["kilat:prompt_tokens_total"] == r.usage.prompt_tokens


@pytest.mark.parametrize("stream", [False, True])
def test_response_format_json_schema(client: openai.OpenAI, stream: bool) -> None:
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                               "population": {"type": "integer", "minimum": 0}},
              "required": ["city", "population"], "additionalProperties": False}
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": schema, "strict": True}}
    text, reason = chat_text(client, "Name a big city and its population, in JSON.", stream, max_tokens=80,
                             response_format=fmt)
    assert reason == "stop"
    value = json.loads(text)
    assert set(value) == {"city", "population"} and isinstance(value["population"], int)
    assert (text, reason) == chat_text(client, "Name a big city and its population, in JSON.", not stream,
                                       max_tokens=80, response_format=fmt)


def test_structured_outputs_extra_and_json_object(client: openai.OpenAI) -> None:
    r = client.completions.create(model=MODEL, prompt="The year the Berlin wall fell:", max_tokens=10,
                                  temperature=0, extra_body={"structured_outputs": {"regex": "19[0-9]{2}"}})
    assert r.choices[0].finish_reason == "stop" and re.fullmatch("19[0-9]{2}", r.choices[0].text)
    r = client.chat.completions.create(model=MODEL, max_tokens=10, temperature=0, messages=[
        {"role": "user", "content": "Is water wet?"}], extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    assert r.choices[0].message.content in ("yes", "no")
    text, reason = chat_text(client, 'Give a JSON object with one key "animal".', False, max_tokens=60,
                             response_format={"type": "json_object"})
    assert reason == "stop" and isinstance(json.loads(text), dict)
    text, reason = chat_text(client, "Give a JSON object describing a cat.", False, max_tokens=4,
                             response_format={"type": "json_object"})
    assert reason == "length"


WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                            "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"]}
TIME = {"type": "object", "properties": {"timezone": {"type": "string", "maxLength": 30}}, "required": ["timezone"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "description": "Current time in a timezone",
                                           "parameters": TIME}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}


def _tool_calls(client: openai.OpenAI, messages: list[dict[str, Any]], stream: bool, **kwargs: Any
                ) -> tuple[list[tuple[str, dict]], str | None, str | None]:
    """((name, arguments) per call, finish_reason, content) of a greedy chat with TOOLS; stream deltas are
    checked and joined. Every call has a call_ id and arguments valid for its tool's schema."""
    import jsonschema

    if not stream:
        r = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, temperature=0,
                                           max_tokens=80, **kwargs)
        message = r.choices[0].message
        calls, reason, content = message.tool_calls or [], r.choices[0].finish_reason, message.content
    else:
        calls, reasons, pieces = [], [], []
        for chunk in client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, temperature=0,
                                                    max_tokens=80, stream=True, **kwargs):
            delta = chunk.choices[0].delta
            calls += delta.tool_calls or []
            pieces.append(delta.content or "")
            reasons.append(chunk.choices[0].finish_reason)
        assert [c.index for c in calls] == list(range(len(calls)))
        reason, content = reasons[-1], "".join(pieces) or None
    assert all(c.id.startswith("call_") and c.type == "function" for c in calls)
    parsed = [(c.function.name, json.loads(c.function.arguments)) for c in calls]
    for name, arguments in parsed:
        jsonschema.validate(arguments, SCHEMAS[name])
    return parsed, reason, content


@pytest.mark.parametrize("stream", [False, True])
def test_tool_choice_required_and_named(client: openai.OpenAI, stream: bool) -> None:
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    calls, reason, content = _tool_calls(client, messages, stream, tool_choice="required")
    assert reason == "tool_calls" and content is None and calls[0] == (
        "get_weather", {"city": "Paris", "unit": "celsius"})
    assert (calls, reason) == _tool_calls(client, messages, not stream, tool_choice="required")[:2]
    named = {"type": "function", "function": {"name": "get_time"}}
    calls, reason, _ = _tool_calls(client, messages, stream, tool_choice=named)
    assert reason == "tool_calls" and len(calls) == 1 and calls[0][0] == "get_time"
    calls, reason, content = _tool_calls(client, messages, stream, tool_choice="none")
    assert calls == [] and reason == "length" and content


@pytest.mark.parametrize("stream", [False, True])
def test_tool_choice_auto_parses_hermes_calls(client: openai.OpenAI, stream: bool) -> None:
    # SmolLM2's template has no tools: they go into a system message; one example call shows the format.
    example = '<tool_call>{"name": "get_weather", "arguments": {"city": "Rome", "unit": "celsius"}}</tool_call>'
    messages = [{"role": "user", "content": "What is the weather in Rome?"},
                {"role": "assistant", "content": example},
                {"role": "user", "content": "What is the weather in Paris?"}]
    calls, reason, content = _tool_calls(client, messages, stream)
    assert reason == "tool_calls" and content is None
    assert [name for name, _ in calls] == ["get_weather"] and calls[0][1]["city"] == "Paris"


@pytest.mark.parametrize("body,param,needle", [
    ({"tools": [{"type": "function"}]}, "tools", "tools[0]"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "fly"}}}, "tool_choice", "fly"),
    ({"tools": TOOLS, "tool_choice": "always"}, "tool_choice", "always"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": TOOLS + TOOLS[:1]}, "tools", "distinct"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice",
     "cannot be combined"),
])
def test_bad_tools_are_400(server: Server, body: dict[str, Any], param: str, needle: str) -> None:
    r = post(server, "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                                              **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param and needle in r.json()["error"]["message"]
    assert_healthy(server)


NESTED_LOOPS = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
SIMPLE_TEMPLATE = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}{{ extra }}"


@pytest.fixture(scope="module")
def trusted_server(tiny_llama_dir: str) -> Iterator[Server]:
    """A server that renders requests' chat templates: the tiny random Llama (SmolLM2's tokenizer; no real text
    needed)."""
    srv = Server(tiny_llama_dir, "--dtype", "float32", "--max-model-len", "512", "--kv-cache-memory", "16MiB",
                 "--trust-request-chat-template")
    yield srv
    srv.stop()


def _template_worker_pid(server: Server) -> int | None:
    for pid in server.children():
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"chat_template_worker.py" in f.read():
                    return pid
        except OSError:  # it exited meanwhile
            pass
    return None


def test_request_template_renders_with_kwargs(trusted_server: Server) -> None:
    messages = [{"role": "user", "content": "Hi"}]
    r = post(trusted_server, "/tokenize", {"messages": messages, "chat_template": SIMPLE_TEMPLATE,
                                           "chat_template_kwargs": {"extra": "END"}}, headers={})
    assert r.status_code == 200, r.text
    assert post(trusted_server, "/detokenize", {"tokens": r.json()["tokens"]}, headers={}).json()["prompt"] == \
        "user: Hi\nEND"
    r = post(trusted_server, "/v1/chat/completions", {"messages": messages, "chat_template": SIMPLE_TEMPLATE,
                                                       "max_tokens": 2, "temperature": 0}, headers={})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


def test_stuck_request_template_is_400_and_others_are_served(trusted_server: Server) -> None:
    """Nested range() loops (10^10 iterations) used to freeze the tokenizer thread: now the render is killed
    at its time limit, a concurrent plain request is served meanwhile, and the next template renders.

    Stuck templates are sent one after another for up to 120 s, so the plain request need not beat a single
    5 s render on a loaded machine: it only has to finish while the renderer is still kept stuck."""
    body = {"messages": [{"role": "user", "content": "Hi"}], "chat_template": NESTED_LOOPS, "max_tokens": 2}
    stop = threading.Event()

    def stuck_renders() -> list[tuple[float, requests.Response]]:
        results, deadline = [], time.monotonic() + 120
        while not stop.is_set() and time.monotonic() < deadline:
            start = time.monotonic()
            r = post(trusted_server, "/v1/chat/completions", body, {})
            results.append((time.monotonic() - start, r))
        return results

    with ThreadPoolExecutor(1) as pool:
        stuck = pool.submit(stuck_renders)
        time.sleep(0.5)
        plain = post(trusted_server, "/v1/completions", {"prompt": "Hello", "max_tokens": 3, "temperature": 0},
                     headers={})
        assert plain.status_code == 200 and plain.json()["usage"]["completion_tokens"] == 3
        assert not stuck.done()
        stop.set()
        results = stuck.result()
    assert results
    for elapsed, r in results:
        assert elapsed < 5 + 25  # the 5 s limit (child start-up not counted) plus a margin for a loaded machine
        assert r.status_code == 400
        error = r.json()["error"]
        assert error["param"] == "chat_template"
        assert error["message"] == ("chat_template took longer than 5 s to render (the limit for a request's "
                                    "chat template)")
    test_request_template_renders_with_kwargs(trusted_server)


def test_sigterm_does_not_wait_for_a_stuck_render(tiny_llama_dir: str) -> None:
    """SIGTERM during a stuck render exits promptly and leaves no renderer behind (a server of its own, as
    the test stops it)."""
    server = Server(tiny_llama_dir, "--dtype", "float32", "--max-model-len", "512", "--kv-cache-memory", "16MiB",
                    "--trust-request-chat-template")
    try:
        body = {"messages": [{"role": "user", "content": "Hi"}], "chat_template": NESTED_LOOPS}
        with ThreadPoolExecutor(1) as pool:
            pool.submit(post, server, "/tokenize", body, {})
            worker = wait_until(lambda: _template_worker_pid(server), "the template renderer starting", interval_s=0.1)
            time.sleep(1.0)
            start = time.monotonic()
            assert server.stop(timeout_s=60) in (0, -signal.SIGTERM, 128 + signal.SIGTERM)
            assert time.monotonic() - start < 20
    finally:
        server.stop()
    assert not pid_alive(worker)
