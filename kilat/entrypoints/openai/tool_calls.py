"""Tool calling for ``/v1/chat/completions``: OpenAI's ``tools`` and ``tool_choice``.

- ``required`` constrains the output (structured outputs) to a JSON array of ``{"name", "arguments"}`` calls,
  each matching one tool's ``parameters`` schema; a named ``tool_choice`` constrains it to that tool's
  arguments object. The calls come straight from that JSON.
- ``auto`` lets the model choose and parses its output with the server's ``--tool-call-parser``; ``hermes``
  reads ``<tool_call>{"name": ..., "arguments": ...}</tool_call>`` blocks (Qwen2.5's and Hermes' format).
- Templates that know tools (their source mentions ``tools``) get them through the chat template; for one
  that does not (SmolLM2's), the tools are described in a system message in the Hermes format.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass
from typing import Any

from kilat.sampling_params import StructuredOutputsParams

TOOL_CALL_PARSERS = ("hermes",)
_HERMES_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


@dataclass(frozen=True)
class ToolCall:
    """One function call: its name and its arguments as JSON text (OpenAI's ``function.arguments``)."""

    name: str
    arguments: str

    def to_openai(self) -> dict[str, Any]:
        """The ``tool_calls`` entry, with a fresh ``call_...`` id."""
        return {"id": f"call_{secrets.token_hex(12)}", "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class ToolPlan:
    """How one request uses its tools.

    Attributes:
        tools: the request's function definitions (``{"name", "description"?, "parameters"?}``).
        choice: ``"none"``, ``"auto"``, ``"required"`` or the forced function's name.
        parallel: whether ``required`` may produce several calls.
    """

    tools: list[dict[str, Any]]
    choice: str
    parallel: bool = True

    @property
    def named(self) -> str | None:
        """The forced function, when ``tool_choice`` names one."""
        return self.choice if self.choice not in ("none", "auto", "required") else None

    def constraint(self) -> StructuredOutputsParams | None:
        """The structured output that ``required`` or a named choice imposes (``None`` otherwise)."""
        if self.named is not None:
            return StructuredOutputsParams(json=_parameters(self._tool(self.named)))
        if self.choice != "required":
            return None
        calls = [{"type": "object", "properties": {"name": {"const": t["name"]}, "arguments": _parameters(t)},
                  "required": ["name", "arguments"], "additionalProperties": False} for t in self.tools]
        schema: dict[str, Any] = {"type": "array", "items": {"anyOf": calls}, "minItems": 1}
        if not self.parallel:
            schema["maxItems"] = 1
        return StructuredOutputsParams(json=schema)

    def _tool(self, name: str) -> dict[str, Any]:
        return next(t for t in self.tools if t["name"] == name)

    def extract(self, text: str, parser: str | None) -> tuple[str | None, list[ToolCall]]:
        """Split a finished output into (content, tool calls).

        ``required`` and named outputs are the constrained JSON; ``auto`` goes through ``parser``. Output that
        does not parse (e.g. cut by ``max_tokens``) stays content, with no calls.
        """
        if self.choice == "none" or (self.choice == "auto" and parser is None):
            return text, []
        if self.named is not None:
            try:
                json.loads(text)
            except json.JSONDecodeError:
                return text, []
            return None, [ToolCall(self.named, text)]
        if self.choice == "required":
            calls = _complete_array_items(text)
            if not calls:
                return text, []
            return None, [ToolCall(c["name"], json.dumps(c["arguments"], ensure_ascii=False)) for c in calls]
        return parse_hermes(text, {t["name"] for t in self.tools})


def _complete_array_items(text: str) -> list[Any]:
    """The complete items of a JSON array, even when ``max_tokens`` cut it short (the constrained output of
    ``required`` is always a prefix of a valid array)."""
    decoder = json.JSONDecoder()
    items: list[Any] = []
    i = text.find("[") + 1
    while i:
        while i < len(text) and text[i] in " ,\n\t":
            i += 1
        try:
            value, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            break
        items.append(value)
    return items


def _parameters(tool: dict[str, Any]) -> dict[str, Any]:
    return tool.get("parameters") or {"type": "object", "properties": {}}


def parse_hermes(text: str, names: set[str]) -> tuple[str | None, list[ToolCall]]:
    """Hermes-format calls: each ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` block naming a
    known tool becomes a call; the text outside the blocks is the content (``None`` when blank). Blocks that
    are not such JSON stay in the content."""
    calls: list[ToolCall] = []
    kept: list[str] = []
    last = 0
    for match in _HERMES_CALL.finditer(text):
        try:
            value = json.loads(match.group(1))
        except json.JSONDecodeError:
            continue
        if not isinstance(value, dict) or value.get("name") not in names:
            continue
        kept.append(text[last:match.start()])
        last = match.end()
        arguments = value.get("arguments", {})
        calls.append(ToolCall(value["name"], arguments if isinstance(arguments, str) else
                              json.dumps(arguments, ensure_ascii=False)))
    kept.append(text[last:])
    content = "".join(kept).strip()
    return (content or None), calls


def plan_tools(tools: list[dict[str, Any]] | None, tool_choice: str | dict[str, Any] | None,
               parallel_tool_calls: bool, parser: str | None) -> ToolPlan | None:
    """Validate ``tools`` / ``tool_choice`` (OpenAI's shapes) into a :class:`ToolPlan`.

    Returns ``None`` without tools. ``tool_choice`` defaults to ``"auto"``.

    Raises:
        ValueError: naming ``tools`` or ``tool_choice``: a malformed tool, a duplicate name, an unknown
            choice or function, ``auto`` without ``--tool-call-parser``, or a choice without tools.
    """
    if not tools:
        if tool_choice not in (None, "none"):
            raise ValueError("tool_choice needs tools")
        return None
    functions = []
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(function, dict) or \
                not isinstance(function.get("name"), str) or not function["name"]:
            raise ValueError(f"tools[{i}] must be {{'type': 'function', 'function': {{'name': str, ...}}}}")
        if function.get("parameters") is not None and not isinstance(function["parameters"], dict):
            raise ValueError(f"tools[{i}].function.parameters must be a JSON schema object")
        functions.append(function)
    names = [f["name"] for f in functions]
    if len(set(names)) != len(names):
        raise ValueError(f"tools must have distinct function names, got {names}")
    choice = tool_choice if tool_choice is not None else "auto"
    if isinstance(choice, dict):
        name = (choice.get("function") or {}).get("name") if choice.get("type") == "function" else None
        if name not in names:
            raise ValueError(f"tool_choice must name one of the tools {names}, got {choice!r}")
        choice = name
    elif choice not in ("none", "auto", "required"):
        raise ValueError(f"tool_choice must be 'none', 'auto', 'required' or a function, got {choice!r}")
    if choice == "auto" and parser is None:
        raise ValueError("tool_choice 'auto' needs the server started with --tool-call-parser "
                         f"({', '.join(TOOL_CALL_PARSERS)}); use 'required' or a named function otherwise")
    return ToolPlan(functions, choice, parallel_tool_calls)


def tools_system_prompt(tools: list[dict[str, Any]]) -> str:
    """A Hermes-style system message describing ``tools``, for chat templates that ignore them."""
    specs = "\n".join(json.dumps({"type": "function", "function": t}, ensure_ascii=False) for t in tools)
    return ("You are a function calling AI model. You may call one or more of these functions:\n<tools>\n"
            f"{specs}\n</tools>\nFor each call, reply with a JSON object with the function name and its "
            'arguments inside <tool_call></tool_call> tags: <tool_call>{"name": <function-name>, '
            '"arguments": <args-json-object>}</tool_call>')
