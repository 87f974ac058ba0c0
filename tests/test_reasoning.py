"""Reasoning parsers (issue 19, point 1): the splitting rules, streamed splitting at every cut of the text, and real
generations of the embedded model through ``kilat serve --reasoning-parser deepseek_r1``, its output forced through
structured outputs so that the tags occur (split across tokens by the model's own tokenization)."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import openai
import pytest
import torch

from kilat.core.reasoning import ReasoningState, reasoning_token_count
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


def chat(client: openai.OpenAI, stream: bool, regex: str | None = None, priority: int = 0,
         **kwargs: Any) -> dict[str, Any]:
    """One greedy chat completion (the template opens ``<think>``; ``regex``: the answer's structured output;
    ``priority``: the request's, under the server's ``priority`` policy): the message's ``reasoning_content``,
    ``reasoning``, ``content``, ``tool_calls`` (name and arguments), ``finish_reason`` and ``usage``; streamed
    deltas joined (a field no delta carried is ``None``)."""
    extra = {"chat_template": OPENS_THINK, "priority": priority} | kwargs.pop("extra_body", {})
    if "thinking_token_budget" in kwargs:  # vLLM's field, outside the openai client's signature
        extra["thinking_token_budget"] = kwargs.pop("thinking_token_budget")
    if regex is not None:
        extra["structured_outputs"] = {"regex": regex}
    request = {"model": MODEL, "messages": [{"role": "user", "content": "What is 1 + 2?"}], "temperature": 0,
               "max_tokens": 64, "extra_body": extra, **kwargs}
    if not stream:
        response = client.chat.completions.create(**request)
        choice = response.choices[0]
        message = choice.message
        calls = [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or []]
        return {"reasoning_content": message.model_extra["reasoning_content"],
                "reasoning": message.model_extra["reasoning"], "content": message.content, "tool_calls": calls,
                "finish_reason": choice.finish_reason,
                "usage": response.usage.model_dump(exclude_none=True, exclude={"prompt_tokens_details"})}
    joined: dict[str, Any] = {"reasoning_content": None, "reasoning": None, "content": None, "tool_calls": []}
    reasons, usage = [], None
    for chunk in client.chat.completions.create(**request, stream=True, stream_options={"include_usage": True}):
        if not chunk.choices:
            usage = chunk.usage.model_dump(exclude_none=True, exclude={"prompt_tokens_details"})  # cache hits vary
            continue
        choice = chunk.choices[0]
        delta = choice.delta.model_dump(exclude_none=True)
        for field in ("reasoning_content", "reasoning", "content"):
            if delta.get(field):
                joined[field] = (joined[field] or "") + delta[field]
        joined["tool_calls"] += [(c["function"]["name"], json.loads(c["function"]["arguments"]))
                                 for c in delta.get("tool_calls", [])]
        reasons.append(choice.finish_reason)
    assert all(r is None for r in reasons[:-1])
    return joined | {"finish_reason": reasons[-1], "usage": usage}


@pytest.mark.slow
def test_thinking_budget_forces_the_end_and_the_answer_follows_its_structured_output(client: openai.OpenAI) -> None:
    """Budget 6: six reasoning tokens, then the end tag (forced, over several tokens), then the answer under its
    regex, which does not constrain the reasoning; streamed (with a priority) or not, the same message."""
    answer = r"[A-Z][a-z ]{10,40}\."
    whole = chat(client, False, answer, thinking_token_budget=6)
    assert whole["reasoning"] == whole["reasoning_content"] and whole["finish_reason"] == "stop"
    assert whole["usage"]["completion_tokens_details"]["reasoning_tokens"] == 6
    assert re.fullmatch(answer, whole["content"]) and not re.fullmatch(answer, whole["reasoning_content"])
    assert chat(client, True, answer, priority=-5, thinking_token_budget=6) == whole
    tokens = [t.token for t in client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "What is 1 + 2?"}], temperature=0, max_tokens=64,
        logprobs=True, extra_body={"chat_template": OPENS_THINK, "thinking_token_budget": 6,
                                   "structured_outputs": {"regex": answer}}).choices[0].logprobs.content]
    text = "".join(tokens)  # the end tag is several tokens of this model: split across tokens and deltas
    assert text.startswith(whole["reasoning_content"] + "</think>") and not any("</think>" in t for t in tokens)
    # SGLang's name, and a budget of 0: no reasoning at all
    none = chat(client, False, answer, extra_body={"thinking_budget": 0})
    assert none["reasoning_content"] is None and re.fullmatch(answer, none["content"])
    assert none["usage"]["completion_tokens_details"]["reasoning_tokens"] == 0


@pytest.mark.slow
@pytest.mark.parametrize("stream", [False, True])
def test_no_end_tag_is_all_reasoning_and_a_budget_not_reached_changes_nothing(client: openai.OpenAI,
                                                                             stream: bool) -> None:
    out = chat(client, stream, max_tokens=12, extra_body={"ignore_eos": True})
    assert out["content"] is None and out["reasoning"] == out["reasoning_content"] and out["finish_reason"] == "length"
    assert out["usage"]["completion_tokens"] == out["usage"]["completion_tokens_details"]["reasoning_tokens"] == 12
    assert chat(client, stream, max_tokens=12, extra_body={"ignore_eos": True}, thinking_token_budget=100) == out


@pytest.mark.slow
@pytest.mark.parametrize("stream", [False, True])
def test_tool_calls_come_from_the_answer(client: openai.OpenAI, stream: bool) -> None:
    """``required`` constrains the answer (after a budget of 4 reasoning tokens) to the calls' JSON; ``auto``
    parses the Hermes block the answer's regex writes."""
    required = chat(client, stream, tools=TOOLS, tool_choice="required", thinking_token_budget=4)
    assert [name for name, _ in required["tool_calls"]] == ["add"] and required["finish_reason"] == "tool_calls"
    assert required["usage"]["completion_tokens_details"]["reasoning_tokens"] == 4 and not required["content"]
    auto = chat(client, stream, CALL, tools=TOOLS, thinking_token_budget=4)
    assert auto["tool_calls"] == [("add", {"a": 1, "b": 2})] and auto["finish_reason"] == "tool_calls"


def test_reasoning_state_counts_forces_and_closes() -> None:
    natural = ReasoningState([7, 8], budget=None)  # an end tag of two tokens, written by the model
    for token in (1, 2, 7, 3, 7, 8):
        assert natural.forced_token is None
        natural.accept(token)
    assert not natural.open and natural.num_reasoning_tokens == 4  # 1 2 7 3
    forced = ReasoningState([7, 8, 9], budget=2)
    forced.accept(4)
    forced.accept(5)
    assert forced.forced_token == 7 and forced.open
    bitmask = torch.zeros(4, 1, dtype=torch.int32)
    assert forced.fill_rows([7, 1, 9], bitmask, 0) == [0, 1]  # the second draft is not the forced 8: rows stop
    assert bitmask[:2, 0].tolist() == [1 << 7, 1 << 8]
    for token in (7, 8, 9):
        assert forced.forced_token == token
        forced.accept(token)
    assert not forced.open and forced.num_reasoning_tokens == 2 and forced.forced_token is None
    assert reasoning_token_count([4, 5, 7, 8, 9, 7, 8, 9], [7, 8, 9]) == 2 and reasoning_token_count([1], [2]) == 1
    assert ReasoningState([3], budget=0).forced_token == 3
    for bad, message in (({"end_token_ids": []}, "at least one"), ({"end_token_ids": [1], "budget": 2}, "must be"),
                         ({"end_token_ids": [1], "thinking_token_budget": -1}, ">= 0")):
        with pytest.raises(ValueError, match=message):
            ReasoningState.from_extra_args({"reasoning": bad})


def test_engine_forces_the_end_tokens_and_grammar_waits_for_the_answer(tiny_llama_dir: str) -> None:
    """Offline, with the engine's ``extra_args["reasoning"]``: budget 3 → three free tokens, the end ids, then an
    answer under its regex; without a budget the same free tokens (greedy)."""
    from kilat import LLM, SamplingParams
    from kilat.sampling_params import StructuredOutputsParams

    with LLM(tiny_llama_dir, dtype="float32", max_model_len=128) as llm:
        tokenizer = llm.get_tokenizer()
        end = tokenizer.encode("</think>", add_special_tokens=False)
        prompt = [{"prompt_token_ids": [1, 5, 9, 13]}]

        def run(budget: int | None, **kwargs: Any) -> list[int]:
            params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, **kwargs,
                                    extra_args={"reasoning": {"end_token_ids": end, "thinking_token_budget": budget}})
            return llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids

        free = run(None)
        forced = run(3, structured_outputs=StructuredOutputsParams(regex="[0-9]{4}"))
        assert forced[:3] == free[:3] and forced[3:3 + len(end)] == end
        answer = tokenizer.decode(forced[3 + len(end):], skip_special_tokens=True)
        assert re.fullmatch("[0-9]{4}", answer), answer
        with pytest.raises(ValueError, match="end_token_ids must be token ids in"):
            llm.generate(prompt, SamplingParams(extra_args={"reasoning": {"end_token_ids": [10 ** 9]}}),
                         use_tqdm=False)
