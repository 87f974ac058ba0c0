"""Tool plans and the Hermes tool-call parser (no model)."""

from __future__ import annotations

import json

import pytest

from kilat.entrypoints.openai.tool_calls import ToolCall, parse_hermes, plan_tools, tools_system_prompt

TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}},
         {"type": "function", "function": {"name": "now"}}]


def test_parse_hermes_keeps_text_and_bad_blocks() -> None:
    text = ('Sure. <tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>\n'
            '<tool_call>{"name": "now", "arguments": {}}</tool_call> <tool_call>{broken</tool_call>'
            '<tool_call>{"name": "unknown", "arguments": {}}</tool_call>')
    content, calls = parse_hermes(text, {"add", "now"})
    assert calls == [ToolCall("add", '{"a": 1, "b": 2}'), ToolCall("now", "{}")]
    assert content == ('Sure. \n <tool_call>{broken</tool_call><tool_call>{"name": "unknown", "arguments": {}}'
                       '</tool_call>')
    assert parse_hermes("no calls", {"add"}) == ("no calls", [])
    # arguments given as JSON text are passed through, not encoded twice
    assert parse_hermes('<tool_call>{"name": "add", "arguments": "{\\"a\\": 1}"}</tool_call>', {"add"})[1] == [
        ToolCall("add", '{"a": 1}')]


def test_required_constraint_and_extraction() -> None:
    plan = plan_tools(TOOLS, "required", parallel_tool_calls=False, parser=None)
    schema = plan.constraint().json
    assert schema["maxItems"] == 1 and [s["properties"]["name"]["const"] for s in schema["items"]["anyOf"]] == [
        "add", "now"]
    assert schema["items"]["anyOf"][1]["properties"]["arguments"] == {"type": "object", "properties": {}}
    content, calls = plan.extract('[{"name": "add", "arguments": {"a": 3, "b": 4}}]', None)
    assert content is None and calls == [ToolCall("add", json.dumps({"a": 3, "b": 4}))]
    assert plan.extract('[{"name": "add", "argu', None) == ('[{"name": "add", "argu', [])  # cut by max_tokens
    # a run of parallel calls cut by max_tokens keeps its complete calls
    cut = '[{"name": "now", "arguments": {}}, {"name": "add", "arguments": {"a": 1, "b": 2}}, {"name": "no'
    assert plan.extract(cut, None) == (None, [ToolCall("now", "{}"), ToolCall("add", '{"a": 1, "b": 2}')])


def test_named_auto_and_none() -> None:
    named = plan_tools(TOOLS, {"type": "function", "function": {"name": "add"}}, True, None)
    assert named.named == "add" and named.constraint().json == TOOLS[0]["function"]["parameters"]
    assert named.extract('{"a": 1, "b": 2}', None) == (None, [ToolCall("add", '{"a": 1, "b": 2}')])
    auto = plan_tools(TOOLS, None, True, "hermes")
    assert auto.choice == "auto" and auto.constraint() is None
    assert plan_tools(TOOLS, "none", True, None).extract("hi", None) == ("hi", [])
    assert plan_tools(None, None, True, None) is None
    with pytest.raises(ValueError, match="--tool-call-parser"):
        plan_tools(TOOLS, "auto", True, None)
    assert '"name": "add"' in tools_system_prompt([t["function"] for t in TOOLS])
