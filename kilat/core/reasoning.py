"""A reasoning request's thinking phase in the engine core: counting its reasoning tokens, forcing the end of
reasoning once a thinking budget is spent, and holding its structured-output grammar until the answer starts.

The server's reasoning parser (:mod:`kilat.entrypoints.openai.reasoning`) marks a chat request whose output it
will split by putting ``{"end_token_ids": [...], "thinking_token_budget": k | None}`` in
``SamplingParams.extra_args["reasoning"]``: the token ids of its end tag (the tag as the tokenizer encodes it on
its own) and the request's budget (vLLM's ``thinking_token_budget``). The engine then treats the output as
reasoning from its first token until those ids appear in it; the reasoning tokens are the output tokens before
them. With a budget ``k``, once ``k`` reasoning tokens were sampled without the end ids, the next tokens are
forced to the end ids (one bitmask row allowing one token each: the same path as structured outputs), so the
reasoning has at most ``k`` tokens and the end tag follows. A structured-output grammar applies to the answer
only: it is neither applied nor advanced until the end ids are complete.

A model that writes the end tag with other tokens than its standalone encoding (a text tag split differently)
is not seen to have ended its reasoning here: its grammar stays off and a budget still forces the tag. Models
whose end tag is one special token (DeepSeek-R1's and Qwen3's ``</think>``) always match.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

REASONING_KEY = "reasoning"
"""The ``SamplingParams.extra_args`` key the server's reasoning parser sets."""


def reasoning_token_count(output_token_ids: Sequence[int], end_token_ids: Sequence[int]) -> int:
    """Output tokens before the first occurrence of ``end_token_ids`` (all of them when it does not occur)."""
    n = len(end_token_ids)
    for i in range(len(output_token_ids) - n + 1):
        if list(output_token_ids[i:i + n]) == list(end_token_ids):
            return i
    return len(output_token_ids)


class ReasoningState:
    """One request's thinking phase (module docs).

    Args:
        end_token_ids: the end tag's ids, at least one.
        budget: most reasoning tokens before the end tag is forced, or ``None``.

    Attributes:
        open: still reasoning (the end ids not yet complete).
        num_reasoning_tokens: output tokens sampled while reasoning, before the end ids began.

    Raises:
        ValueError: no end ids, or a negative budget (naming ``thinking_token_budget``).
    """

    def __init__(self, end_token_ids: Sequence[int], budget: int | None = None) -> None:
        if not end_token_ids:
            raise ValueError("extra_args.reasoning.end_token_ids must hold at least one token id")
        if budget is not None and (not isinstance(budget, int) or isinstance(budget, bool) or budget < 0):
            raise ValueError(f"thinking_token_budget must be an integer >= 0, got {budget!r}")
        self.end_token_ids = list(end_token_ids)
        self.budget = budget
        self.open = True
        self.num_reasoning_tokens = 0
        self._tail: list[int] = []  # the last len(end) - 1 tokens, to find the end ids across tokens
        self._forced = 0  # end ids forced so far

    @classmethod
    def from_extra_args(cls, extra_args: dict[str, Any] | None) -> ReasoningState | None:
        """The state that ``extra_args["reasoning"]`` asks for, or ``None``.

        Raises:
            ValueError: a malformed entry (naming it).
        """
        spec = (extra_args or {}).get(REASONING_KEY)
        if spec is None:
            return None
        if not isinstance(spec, dict) or set(spec) - {"end_token_ids", "thinking_token_budget"}:
            raise ValueError("extra_args.reasoning must be {'end_token_ids': [int, ...], 'thinking_token_budget': "
                             f"int | None}}, got {spec!r:.120}")
        ids = spec.get("end_token_ids")
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise ValueError(f"extra_args.reasoning.end_token_ids must be a list of token ids, got {ids!r:.80}")
        return cls(ids, spec.get("thinking_token_budget"))

    @property
    def forced_token(self) -> int | None:
        """The token the next sample must be: the next end id once the budget is spent, else ``None``."""
        if not self.open or self.budget is None or (self._forced == 0 and self.num_reasoning_tokens < self.budget):
            return None
        return self.end_token_ids[self._forced]

    def accept(self, token_id: int) -> None:
        """Record a sampled token of the thinking phase (call only while :attr:`open`)."""
        end = self.end_token_ids
        if self.forced_token is not None:
            self._forced += 1
            self.open = self._forced < len(end)
            return
        window = self._tail + [token_id]
        if window[-len(end):] == end:
            self.open = False
            self.num_reasoning_tokens -= len(end) - 1  # the tag's earlier tokens were counted as reasoning
            return
        self.num_reasoning_tokens += 1
        self._tail = window[-(len(end) - 1):] if len(end) > 1 else []

    def fill_rows(self, drafts: list[int], bitmask: torch.Tensor, row0: int) -> list[int]:
        """Bitmask rows for a forced step (the structured-output row layout of
        :func:`~kilat.structured_outputs.manager.build_bitmask`): row ``row0`` allows only the forced token, and
        each following row only the next end id while the drafts match the forced ones. Returns the filled
        rows."""
        forced = self.end_token_ids[self._forced:]
        rows = []
        for i, token in enumerate(forced[:1 + len(drafts)]):
            if i and drafts[i - 1] != forced[i - 1]:
                break
            bitmask[row0 + i].zero_()
            bitmask[row0 + i, token >> 5] = _bit(token & 31)
            rows.append(row0 + i)
        return rows


def _bit(position: int) -> int:
    """The int32 word with bit ``position`` set (xgrammar's bitmask words are signed)."""
    return (1 << position) - (1 << 32 if position == 31 else 0)
