"""Reasoning parsers (``--reasoning-parser``, vLLM's server flag): split a chat completion's text into the model's
reasoning and its answer.

Reasoning models write their thinking between a start and an end tag (``<think>`` … ``</think>`` for DeepSeek-R1
and Qwen3) before the answer. With a parser, chat responses carry the text before the end tag in
``message.reasoning_content`` and ``message.reasoning`` (both: clients are split between vLLM's older and newer
name) and the text after it in ``content``; streamed deltas do the same, with no tag text in either.

Rules, the same for every parser (vLLM's DeepSeek-R1 parser's):

- A start tag at the very beginning of the output is dropped: templates that open ``<think>`` in the prompt (R1,
  Qwen3's thinking models) make the model write no start tag, and others let it write one.
- Everything up to the first end tag is reasoning; everything after it is the answer (a later start or end tag
  stays in the answer).
- **An output with no end tag is all reasoning** and has no content (``content: null``): the model was cut off
  (``max_tokens``) or never closed its thinking.
- ``qwen3`` only: a request with ``chat_template_kwargs: {"enable_thinking": false}`` (Qwen3's switch, whose
  template then closes an empty thinking block in the prompt) is all answer.

Streaming holds back text that may still become a tag (a start tag's prefix at the beginning, an end tag's
prefix at the end), so a tag split across tokens never leaks; the streamed pieces concatenate to the
non-streamed message exactly. Tool calls (``--tool-call-parser``) are parsed from the answer only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

REASONING_PARSERS = ("deepseek_r1", "qwen3", "tags")
"""``--reasoning-parser`` names: ``deepseek_r1`` and ``qwen3`` read ``<think>`` … ``</think>``; ``tags`` reads the
``start`` and ``end`` strings of ``--reasoning-parser-config``."""
MAX_TAG_CHARS = 64
"""Longest start or end tag (each streamed delta checks the text's end against the end tag)."""


@dataclass(frozen=True)
class ReasoningParser:
    """One server's reasoning parser (module docs for the rules).

    Args:
        name: one of :data:`REASONING_PARSERS`.
        start, end: the tags around the reasoning.

    Raises:
        ValueError: an unknown name, or an empty, too long or equal pair of tags.
    """

    name: str
    start: str = "<think>"
    end: str = "</think>"

    def __post_init__(self) -> None:
        if self.name not in REASONING_PARSERS:
            raise ValueError(f"reasoning_parser must be one of {REASONING_PARSERS}, got {self.name!r}")
        for field, tag in (("start", self.start), ("end", self.end)):
            if not isinstance(tag, str) or not 1 <= len(tag) <= MAX_TAG_CHARS:
                raise ValueError(f"reasoning_parser_config.{field} must be a string of 1 to {MAX_TAG_CHARS} "
                                 f"characters, got {tag!r}")
        if self.start == self.end:
            raise ValueError(f"reasoning_parser_config: start and end must differ, got {self.start!r} twice")

    @classmethod
    def create(cls, name: str, config: dict[str, Any] | None = None) -> ReasoningParser:
        """The parser ``name`` with ``config`` (``{"start": ..., "end": ...}``: required for ``tags``, optional
        overrides for the others).

        Raises:
            ValueError: an unknown name or key, ``tags`` without both tags, or invalid tags (named).
        """
        config = dict(config or {})
        unknown = sorted(set(config) - {"start", "end"})
        if unknown:
            raise ValueError(f"reasoning_parser_config: unknown key(s) {unknown}; known: ['end', 'start']")
        if name == "tags" and not {"start", "end"} <= set(config):
            raise ValueError("reasoning_parser 'tags' needs reasoning_parser_config with its 'start' and 'end' "
                             "strings, e.g. {\"start\": \"<think>\", \"end\": \"</think>\"}")
        return cls(name, **config)

    def applies(self, chat_template_kwargs: dict[str, Any] | None) -> bool:
        """Whether a request's output has reasoning to split (``qwen3``: not with ``enable_thinking: false``)."""
        return not (self.name == "qwen3" and (chat_template_kwargs or {}).get("enable_thinking") is False)

    def split(self, text: str, done: bool = True) -> tuple[str, str | None]:
        """``(reasoning, content)`` of ``text``; ``content`` is ``None`` while no end tag has been seen. With
        ``done`` false (``text`` may still grow), text that may become a tag is left out of both."""
        begin = 0
        if text.startswith(self.start):
            begin = len(self.start)
        elif not done and self.start.startswith(text):
            return "", None
        end = text.find(self.end, begin)
        if end >= 0:
            return text[begin:end], text[end + len(self.end):]
        hold = 0 if done else _partial_tag(text, begin, self.end)
        return text[begin:len(text) - hold], None


def _partial_tag(text: str, begin: int, tag: str) -> int:
    """Length of the longest suffix of ``text[begin:]`` that is a proper prefix of ``tag``."""
    for n in range(min(len(tag) - 1, len(text) - begin), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


class ReasoningStream:
    """One streamed choice's reasoning and answer, delta by delta, in time linear in the text: what
    :meth:`ReasoningParser.split` gives for the text so far, sent once.

    Args:
        parser: the server's parser.
    """

    def __init__(self, parser: ReasoningParser):
        self.parser = parser
        self._head: str | None = ""  # text that may still be the start tag; None once decided
        self._pending = ""  # reasoning held back: it may be the start of the end tag
        self._answering = False  # the end tag was seen

    def next(self, delta: str, done: bool) -> tuple[str, str | None]:
        """Add ``delta`` (the choice's next text; ``done``: its last) and return the reasoning and content not
        sent yet; content is ``None`` until the end tag has been seen."""
        if self._answering:
            return "", delta
        start, end = self.parser.start, self.parser.end
        if self._head is not None:
            head = self._head + delta
            if not done and start.startswith(head) and head != start:
                self._head = head
                return "", None
            self._head, delta = None, head.removeprefix(start)
        text = self._pending + delta
        found = text.find(end)
        if found >= 0:
            self._pending, self._answering = "", True
            return text[:found], text[found + len(end):]
        hold = 0 if done else _partial_tag(text, 0, end)
        self._pending = text[len(text) - hold:]
        return text[:len(text) - hold], None
