"""An async client for any OpenAI-compatible server that timestamps every streamed chunk (aiohttp)."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

import aiohttp

from kilat.bench.metrics import RequestResult

ENDPOINTS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}


@dataclass
class BenchRequest:
    """One request of a benchmark.

    Attributes:
        prompt: text, token ids (completions only) or chat messages.
        prompt_len: prompt tokens as the dataset counted them.
        output_len: ``max_tokens``.
    """

    prompt: str | list[int] | list[dict[str, str]]
    prompt_len: int
    output_len: int


def request_body(request: BenchRequest, endpoint: str, model: str, ignore_eos: bool,
                 extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """The JSON body for ``endpoint`` (``"chat"`` or ``"completions"``), greedy, streamed with usage.

    Raises:
        ValueError: token-id prompts on the chat endpoint.
    """
    body: dict[str, Any] = {"model": model, "max_tokens": request.output_len, "temperature": 0.0,
                            "stream": True, "stream_options": {"include_usage": True}}
    if ignore_eos:
        body["ignore_eos"] = True
    if endpoint == "chat":
        if isinstance(request.prompt, list) and request.prompt and isinstance(request.prompt[0], int):
            raise ValueError("the chat endpoint needs text prompts; use --endpoint completions for token ids")
        messages = request.prompt if isinstance(request.prompt, list) else [
            {"role": "user", "content": request.prompt}]
        body["messages"] = messages
    else:
        if isinstance(request.prompt, list) and request.prompt and isinstance(request.prompt[0], dict):
            raise ValueError("the completions endpoint needs text or token-id prompts, not messages")
        body["prompt"] = request.prompt
    return {**body, **(extra or {})}


def _chunk_text(data: dict[str, Any], endpoint: str) -> str:
    """Generated text in one streamed chunk (a role-only chunk has none)."""
    text = ""
    for choice in data.get("choices") or []:
        if endpoint == "chat":
            delta = choice.get("delta") or {}
            text += (delta.get("content") or "") + (delta.get("reasoning_content") or "")
        else:
            text += choice.get("text") or ""
    return text


async def send_request(session: aiohttp.ClientSession, base_url: str, endpoint: str, body: dict[str, Any],
                       headers: dict[str, str] | None = None) -> RequestResult:
    """Send one streamed request; time every content chunk, and the last event of the stream (``[DONE]``) as
    its end. Never raises: failures are in the result."""
    result = RequestResult(success=False, send_time=time.perf_counter())
    usage = None
    try:
        async with session.post(base_url.rstrip("/") + ENDPOINTS[endpoint], json=body,
                                headers=headers) as response:
            if response.status != 200:
                result.error = f"HTTP {response.status}: {(await response.text())[:200]}"
                result.end_time = time.perf_counter()
                return result
            done = False
            async for raw in response.content:
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                payload = line[5:].strip()
                now = result.end_time = time.perf_counter()
                if payload == b"[DONE]":
                    done = True
                    break
                data = json.loads(payload)
                if "error" in data:
                    result.error = f"stream error: {data['error']}"
                    break
                usage = data.get("usage") or usage
                text = _chunk_text(data, endpoint)
                if text:
                    result.chunk_times.append(now)
                    result.text += text
            if result.error is None and not done:
                result.error = "stream ended without [DONE]"
    except (aiohttp.ClientError, TimeoutError, json.JSONDecodeError) as e:
        result.error = f"{type(e).__name__}: {e}"
        result.end_time = time.perf_counter()
        return result
    if usage:
        result.prompt_tokens = usage.get("prompt_tokens")
        result.output_tokens = usage.get("completion_tokens") or 0
    result.success = result.error is None
    return result
