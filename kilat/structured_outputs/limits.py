"""Size limits of a structured-outputs constraint, checked in pure Python before any xgrammar work.

A constraint's compile time grows with its size (and faster than linearly for long choice lists and enums:
10,000 choices take 2.7 s to compile on SmolLM2's tokenizer, 100,000 went on for about 150 s), so the
front end refuses an oversized one at once with a ``ValueError`` (HTTP 400) naming the field and the limit.
At the limits, each kind compiles in about a second at most on SmolLM2's tokenizer (up to 0.96 s measured,
docs/architecture.md, "Structured outputs"), twice on a cache miss (in the worker, then in the engine core).
A small constraint can still be slow to compile (a 600-character regex of 40 bounded
repetitions, ``[a-z]{1,300}[a-z]{1,301}...``, compiles for a minute); the engine core's compile time limit
(``StructuredOutputsConfig.compile_timeout_s``) bounds those.
"""

from __future__ import annotations

import json
from typing import Any

from kilat.sampling_params import StructuredOutputsParams

MAX_CHOICES = 4096
"""Most entries of ``structured_outputs.choice``."""
MAX_CHOICE_CHARS = 65536
"""Most characters of all ``structured_outputs.choice`` entries together."""
MAX_ENUM_ENTRIES = 4096
"""Most entries of one JSON-schema ``enum``."""
MAX_SCHEMA_CHARS = 65536
"""Most characters of a JSON schema, serialized (``json.dumps`` of a dict, or the text as given)."""
MAX_SCHEMA_DEPTH = 64
"""Deepest nesting of objects and arrays in a JSON schema document (``{"a": [1]}`` is depth 2)."""
MAX_REGEX_CHARS = 4096
"""Most characters of ``structured_outputs.regex``."""
MAX_GRAMMAR_CHARS = 65536
"""Most characters of an EBNF ``structured_outputs.grammar``."""


def check_limits(params: StructuredOutputsParams) -> None:
    """Refuse a constraint over a size limit; linear in its size, no xgrammar.

    Raises:
        ValueError: naming the field, the limit and the value: too many choices or choice characters, a
            schema too long or too deeply nested, an ``enum`` with too many entries, a regex or grammar too
            long; or a JSON-schema text that is not JSON.
    """
    if params.choice is not None:
        _at_most("structured_outputs.choice", "entries", len(params.choice), MAX_CHOICES)
        _at_most("structured_outputs.choice", "characters in all", sum(len(c) for c in params.choice),
                 MAX_CHOICE_CHARS)
    elif params.regex is not None:
        _at_most("structured_outputs.regex", "characters", len(params.regex), MAX_REGEX_CHARS)
    elif params.grammar is not None:
        _at_most("structured_outputs.grammar", "characters", len(params.grammar), MAX_GRAMMAR_CHARS)
    elif params.json is not None:
        schema = params.json
        if isinstance(schema, str):
            _at_most("structured_outputs.json", "characters", len(schema), MAX_SCHEMA_CHARS)
            try:
                schema = json.loads(schema)
            except RecursionError:
                raise ValueError(f"structured_outputs.json: the schema may nest objects and arrays at most "
                                 f"{MAX_SCHEMA_DEPTH} deep") from None
            except json.JSONDecodeError as e:
                raise ValueError(f"structured_outputs.json: invalid JSON schema: {e}") from None
        _check_schema_tree(schema)
        if not isinstance(params.json, str):
            _at_most("structured_outputs.json", "characters", len(json.dumps(schema)), MAX_SCHEMA_CHARS)


def check_limits_for(params: StructuredOutputsParams, field: str) -> None:
    """:func:`check_limits` for a constraint the server built from another request field (``tools``,
    ``response_format``): the error names ``field`` instead of ``structured_outputs.json``, which the client
    never sent.

    Raises:
        ValueError: as :func:`check_limits`, naming ``field``.
    """
    try:
        check_limits(params)
    except ValueError as e:
        raise ValueError(str(e).replace("structured_outputs.json", field)) from None


def _at_most(field: str, what: str, value: int, limit: int) -> None:
    if value > limit:
        raise ValueError(f"{field}: at most {limit} {what} allowed, got {value}")


def _check_schema_tree(schema: Any) -> None:
    """Nesting depth and ``enum`` sizes of a parsed schema, without recursion (a deep document cannot
    overflow the stack before the depth limit refuses it)."""
    stack = [(schema, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, dict):
            children = node.values()
            enum = node.get("enum")
            if isinstance(enum, list):
                _at_most("structured_outputs.json", "entries in an enum", len(enum), MAX_ENUM_ENTRIES)
        elif isinstance(node, list):
            children = node
        else:
            continue
        if depth > MAX_SCHEMA_DEPTH:
            raise ValueError(f"structured_outputs.json: the schema may nest objects and arrays at most "
                             f"{MAX_SCHEMA_DEPTH} deep")
        stack.extend((child, depth + 1) for child in children if isinstance(child, dict | list))
