"""Reasoning parsers (issue 19, point 1): the splitting rules, streamed splitting at every cut of the text, and real
generations of the embedded model through ``kilat serve --reasoning-parser deepseek_r1``, its output forced through
structured outputs so that the tags occur (split across tokens by the model's own tokenization)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import openai
import pytest

from kilat.entrypoints.openai.reasoning import ReasoningParser, ReasoningStream
from kilat.entrypoints.openai.server_config import ServerConfig
from tests.server_utils import Server

R1 = ReasoningParser.create("deepseek_r1")
TEXTS = [
    "<think>first, add</think>The answer is 3.",
    "no start tag</think>answer",
    "<think>cut off before the end",
    "<think></think>",
    "</think>only an answer",
    "<thi",
    "a < b and </thin are not tags</think> and </think> or <think> after it stay",
    "",
]


@pytest.mark.parametrize("text", TEXTS)
def test_split_rules(text: str) -> None:
    reasoning, content = R1.split(text)
    body = text.removeprefix("<think>")
    if "</think>" in body:
        assert (reasoning, content) == tuple(body.split("</think>", 1))
    else:  # no end tag: everything is reasoning, no content
        assert (reasoning, content) == (body, None)


def test_split_examples() -> None:
    assert R1.split(TEXTS[0]) == ("first, add", "The answer is 3.")
    assert R1.split(TEXTS[6]) == ("a < b and </thin are not tags", " and </think> or <think> after it stay")
    tags = ReasoningParser.create("tags", {"start": "[[", "end": "]]"})
    assert tags.split("[[x]y]]z") == ("x]y", "z")
    qwen3 = ReasoningParser.create("qwen3")
    assert qwen3.applies(None) and qwen3.applies({"enable_thinking": True})
    assert not qwen3.applies({"enable_thinking": False}) and R1.applies({"enable_thinking": False})


@pytest.mark.parametrize("text", TEXTS)
def test_streamed_pieces_join_to_the_whole_split_at_every_cut(text: str) -> None:
    """One character at a time, and every two-piece cut: the deltas concatenate to :meth:`split`'s parts, content
    appears only once the end tag is whole, and a piece never holds part of a tag."""
    want_reasoning, want_content = R1.split(text)
    cuts = [[text[i:i + 1] for i in range(len(text))] + [""]] + [[text[:i], text[i:]] for i in range(len(text) + 1)]
    for pieces in cuts:
        stream = ReasoningStream(R1)
        reasoning, content = "", None
        for i, piece in enumerate(pieces):
            r, c = stream.next(piece, done=i == len(pieces) - 1)
            reasoning += r
            if c is not None:
                content = (content or "") + c
            assert want_reasoning.startswith(reasoning)
        assert (reasoning, content) == (want_reasoning, want_content), pieces


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"reasoning_parser": "nope"}, "reasoning_parser must be one of"),
    ({"reasoning_parser": "tags"}, "needs reasoning_parser_config with its 'start' and 'end'"),
    ({"reasoning_parser": "tags", "reasoning_parser_config": '{"start": "a", "end": "a"}'}, "must differ"),
    ({"reasoning_parser": "qwen3", "reasoning_parser_config": {"stop": "x"}}, r"unknown key\(s\) \['stop'\]"),
    ({"reasoning_parser": "qwen3", "reasoning_parser_config": "{not json"}, "must be a JSON object"),
    ({"reasoning_parser_config": {"start": "<r>"}}, "reasoning_parser_config needs reasoning_parser"),
])
def test_bad_reasoning_settings_are_named(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ServerConfig(**kwargs)


MODEL = "SmolLM2-135M-Instruct"
OPENS_THINK = ("{%- for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{%- endfor %}"
               "{%- if add_generation_prompt %}<|im_start|>assistant\n<think>\n{%- endif %}")
"""A chat template that opens ``<think>`` in the prompt, as DeepSeek-R1's and Qwen3's thinking models' do."""
TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}]
CALL = r'<tool_call>\{"name": "add", "arguments": \{"a": 1, "b": 2\}\}</tool_call>'


@pytest.fixture(scope="module")
def client() -> Iterator[openai.OpenAI]:
    srv = Server("--dtype", "float32", "--max-model-len", "1024", "--reasoning-parser", "deepseek_r1",
                 "--tool-call-parser", "hermes", "--trust-request-chat-template", "--scheduling-policy", "priority")
    yield openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0)
    srv.stop()


def chat(client: openai.OpenAI, regex: str, stream: bool, template: str | None = OPENS_THINK, priority: int = 0,
         **kwargs: Any) -> dict[str, Any]:
    """One greedy chat completion whose output matches ``regex`` (``priority``: the request's, under the server's
    ``priority`` scheduling policy): the message's ``reasoning_content``,
    ``reasoning``, ``content``, ``tool_calls`` (name and arguments) and ``finish_reason``; streamed deltas joined
    (a field no delta carried is ``None``)."""
    extra = {"structured_outputs": {"regex": regex}, "priority": priority} | (
        {"chat_template": template} if template else {})
    request = {"model": MODEL, "messages": [{"role": "user", "content": "What is 1 + 2?"}], "temperature": 0,
               "max_tokens": 96, "extra_body": extra, **kwargs}
    if not stream:
        choice = client.chat.completions.create(**request).choices[0]
        message = choice.message
        calls = [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or []]
        return {"reasoning_content": message.model_extra["reasoning_content"],
                "reasoning": message.model_extra["reasoning"], "content": message.content, "tool_calls": calls,
                "finish_reason": choice.finish_reason}
    joined: dict[str, Any] = {"reasoning_content": None, "reasoning": None, "content": None, "tool_calls": []}
    reasons = []
    for chunk in client.chat.completions.create(**request, stream=True):
        choice = chunk.choices[0]
        delta = choice.delta.model_dump(exclude_none=True)
        for field in ("reasoning_content", "reasoning", "content"):
            if delta.get(field):
                joined[field] = (joined[field] or "") + delta[field]
        joined["tool_calls"] += [(c["function"]["name"], json.loads(c["function"]["arguments"]))
                                 for c in delta.get("tool_calls", [])]
        reasons.append(choice.finish_reason)
    assert all(r is None for r in reasons[:-1])
    return joined | {"finish_reason": reasons[-1]}


@pytest.mark.slow
def test_reasoning_and_answer_are_split_streamed_or_not(client: openai.OpenAI) -> None:
    regex = r"[a-z ]{10,40}</think>[A-Z][a-z ]{10,40}\."
    whole = chat(client, regex, stream=False)
    reasoning, content = whole["reasoning_content"], whole["content"]
    assert whole["reasoning"] == reasoning and whole["finish_reason"] == "stop"
    assert 10 <= len(reasoning) <= 40 and set(reasoning) <= set("abcdefghijklmnopqrstuvwxyz ")
    assert content[0].isupper() and content.endswith(".") and "think" not in content
    assert chat(client, regex, stream=True, priority=-5) == whole
    # the model wrote the end tag over several tokens
    tokens = [t.token for t in client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "What is 1 + 2?"}], temperature=0, max_tokens=96,
        logprobs=True, extra_body={"structured_outputs": {"regex": regex}, "chat_template": OPENS_THINK},
    ).choices[0].logprobs.content]
    assert "</think>" in "".join(tokens) and not any("</think>" in t for t in tokens)


@pytest.mark.slow
@pytest.mark.parametrize("stream", [False, True])
def test_no_end_tag_is_all_reasoning(client: openai.OpenAI, stream: bool) -> None:
    out = chat(client, r"[a-z ]{10,30}", stream)
    assert out["content"] is None and 10 <= len(out["reasoning_content"]) <= 30
    assert out["reasoning"] == out["reasoning_content"]


@pytest.mark.slow
@pytest.mark.parametrize("stream", [False, True])
def test_a_start_tag_in_the_output_is_dropped(client: openai.OpenAI, stream: bool) -> None:
    out = chat(client, r"<think>[a-z ]{5,20}</think>[a-z ]{5,20}", stream, template=None)
    assert "<" not in out["reasoning_content"] and "<" not in out["content"]
    assert 5 <= len(out["reasoning_content"]) <= 20 and 5 <= len(out["content"]) <= 20


@pytest.mark.slow
@pytest.mark.parametrize("stream", [False, True])
def test_tool_calls_are_parsed_from_the_answer_only(client: openai.OpenAI, stream: bool) -> None:
    answer = chat(client, rf"[a-z ]{{5,20}}</think>{CALL}", stream, tools=TOOLS)
    assert answer["tool_calls"] == [("add", {"a": 1, "b": 2})] and answer["content"] is None
    assert answer["finish_reason"] == "tool_calls" and 5 <= len(answer["reasoning_content"]) <= 20
    thought = chat(client, rf"{CALL}</think>[a-z ]{{5,20}}", stream, tools=TOOLS)
    assert thought["tool_calls"] == [] and thought["finish_reason"] == "stop"
    assert thought["reasoning_content"].startswith("<tool_call>") and 5 <= len(thought["content"]) <= 20
