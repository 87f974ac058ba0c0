"""From a :class:`~kilat.sampling_params.StructuredOutputsParams` to an xgrammar grammar (Dong et al., 2024,
"XGrammar: Flexible and Efficient Structured Generation Engine for Large Language Models")."""

from __future__ import annotations

import json
import re
from typing import Any

import xgrammar as xgr

from kilat.sampling_params import StructuredOutputsParams
from kilat.structured_outputs.limits import check_limits

_LOCATION = re.compile(r"^\[[\d:]+\] \S+:\d+: ")
"""xgrammar's ``[time] file.cc:line: `` prefix on error messages."""


_ANY_OBJECT = '{"type": "object"}'
"""``json_object`` is any JSON object (OpenAI's rule), not any JSON value."""


def choice_ebnf(choices: list[str]) -> str:
    """An EBNF grammar whose language is exactly ``choices`` (each a double-quoted literal)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def _schema_text(schema: dict[str, Any] | str) -> str:
    return schema if isinstance(schema, str) else json.dumps(schema)


def validate_structured_outputs(params: StructuredOutputsParams) -> None:
    """Check the constraint's size (:func:`~kilat.structured_outputs.limits.check_limits`), then parse it
    without a tokenizer, so a bad one is refused before it enters the engine.

    Raises:
        ValueError: naming the field: a constraint over a size limit, a schema that is not JSON or that
            xgrammar cannot convert, an invalid regex, or an EBNF grammar that does not parse.
    """
    check_limits(params)
    kind, _ = params.key
    try:
        if kind == "json":
            text = _schema_text(params.json)
            json.loads(text)
            xgr.Grammar.from_json_schema(text, any_whitespace=False)
        elif kind == "regex":
            xgr.Grammar.from_regex(params.regex)
        elif kind == "choice":
            xgr.Grammar.from_ebnf(choice_ebnf(params.choice))
        elif kind == "grammar":
            xgr.Grammar.from_ebnf(params.grammar)
    except (ValueError, RuntimeError, TypeError) as e:
        lines = str(e).strip().splitlines()
        reason = _LOCATION.sub("", lines[-1]) if lines else type(e).__name__
        raise ValueError(f"structured_outputs.{kind}: invalid {kind.replace('json', 'JSON schema')}: {reason}") from e


def compile_grammar(compiler: xgr.GrammarCompiler, params: StructuredOutputsParams) -> xgr.CompiledGrammar:
    """Compile the constraint for ``compiler``'s tokenizer (the compiler caches by grammar).

    JSON is on one line (xgrammar's ``", "`` and ``": "`` separators, no other whitespace), so a small model
    cannot wander in whitespace.
    """
    kind, _ = params.key
    if kind == "json":
        return compiler.compile_json_schema(_schema_text(params.json), any_whitespace=False)
    if kind == "json_object":
        return compiler.compile_json_schema(_ANY_OBJECT, any_whitespace=False)
    if kind == "regex":
        return compiler.compile_regex(params.regex)
    if kind == "choice":
        return compiler.compile_grammar(choice_ebnf(params.choice))
    return compiler.compile_grammar(params.grammar)
