"""The engine core's side of structured outputs: compile grammars in background threads, keep one xgrammar
matcher per constrained request, fill the step's token bitmask and advance the matchers.

A request's grammar compiles in a thread pool as soon as it is added; the scheduler leaves it waiting (and
runs others) until :attr:`GrammarState.ready`. Compiled grammars are cached by their spec, so repeated
schemas compile once. Rows of unconstrained requests are never touched: a batch without constrained rows
builds no bitmask at all.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch
import xgrammar as xgr

from kilat.sampling_params import StructuredOutputsParams
from kilat.structured_outputs.grammar import compile_grammar


class GrammarState:
    """One constrained request's grammar: compiling (a future), then a matcher fed with its tokens.

    Args:
        future: the compiled grammar, being computed.

    Attributes:
        error: why compilation failed, or ``None``.
        rejected: a sampled token broke the grammar (the request then ends with finish reason ``abort``).
    """

    def __init__(self, future: Future[xgr.CompiledGrammar]):
        self._future = future
        self._matcher: xgr.GrammarMatcher | None = None
        self.error: str | None = None
        self.rejected = False

    @property
    def ready(self) -> bool:
        """True once compilation finished (successfully or not: see :attr:`error`)."""
        if self._matcher is not None or self.error is not None:
            return True
        if not self._future.done():
            return False
        try:
            self._matcher = xgr.GrammarMatcher(self._future.result())
        except Exception as e:  # a grammar the frontend's parse check let through but compilation rejects
            self.error = f"structured_outputs: grammar compilation failed: {e}"
        return True

    @property
    def matcher(self) -> xgr.GrammarMatcher:
        """The request's matcher (only once :attr:`ready` without :attr:`error`)."""
        if self._matcher is None:
            raise RuntimeError("the grammar is not compiled yet")
        return self._matcher

    def accept(self, token_id: int) -> None:
        """Advance the matcher by a sampled token; a token the grammar rejects sets :attr:`rejected`."""
        if not self.matcher.accept_token(token_id):
            self.rejected = True

    @property
    def terminated(self) -> bool:
        """True once the grammar is complete and its stop token was accepted."""
        return self._matcher is not None and self._matcher.is_terminated()


class StructuredOutputManager:
    """Compiles grammars for one model's tokenizer, in the background.

    Args:
        tokenizer_loader: returns the model's transformers tokenizer (called once, on the first request).
        vocab_size: the model's vocabulary (logit columns; may exceed the tokenizer's).
        max_threads: compilation threads.
    """

    def __init__(self, tokenizer_loader: Any, vocab_size: int, max_threads: int = 2):
        self._tokenizer_loader = tokenizer_loader
        self.vocab_size = vocab_size
        self._compiler: xgr.GrammarCompiler | None = None
        self._pool = ThreadPoolExecutor(max_workers=max_threads, thread_name_prefix="kilat-grammar")

    def _get_compiler(self) -> xgr.GrammarCompiler:
        if self._compiler is None:
            tokenizer = self._tokenizer_loader()
            info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=self.vocab_size)
            self._compiler = xgr.GrammarCompiler(info, max_threads=1)
        return self._compiler

    def submit(self, params: StructuredOutputsParams) -> GrammarState:
        """Start compiling ``params``'s grammar; returns at once."""
        return GrammarState(self._pool.submit(lambda: compile_grammar(self._get_compiler(), params)))


@dataclass
class TokenBitmask:
    """The step's allowed tokens for its constrained rows.

    Attributes:
        bitmask: int32 ``[num_rows, ceil(vocab_size / 32)]`` on the CPU, xgrammar's layout (bit set = allowed);
            only the rows in ``rows`` are filled.
        rows: the constrained rows.
    """

    bitmask: torch.Tensor
    rows: list[int]


def build_bitmask(grammars: list[GrammarState | None], vocab_size: int,
                  drafts: list[list[int]] | None = None) -> TokenBitmask | None:
    """The step's token bitmask, or ``None`` when no row is constrained.

    Args:
        grammars: per sampled request, its grammar state (ready) or ``None``.
        vocab_size: logit columns.
        drafts: per request, its draft tokens (speculative decoding); ``None`` means none. A request has
            ``1 + len(drafts)`` rows: the tokens allowed after its known tokens, then after each draft. Rows
            after a draft the grammar rejects (or after one that completes it) stay unconstrained: the
            verification stops at that draft, since its own row forbids it.
    """
    if all(g is None for g in grammars):
        return None
    drafts = drafts if drafts is not None else [[] for _ in grammars]
    bitmask = xgr.allocate_token_bitmask(sum(1 + len(d) for d in drafts), vocab_size)
    rows: list[int] = []
    row0 = 0
    for grammar, tokens in zip(grammars, drafts, strict=True):
        if grammar is not None:
            rows.extend(_fill_rows(grammar.matcher, tokens, bitmask, row0))
        row0 += 1 + len(tokens)
    return TokenBitmask(bitmask, rows)


def _fill_rows(matcher: xgr.GrammarMatcher, drafts: list[int], bitmask: torch.Tensor, row0: int) -> list[int]:
    """Fill row ``row0`` from the matcher's state, then one row after each draft it accepts (until one completes
    the grammar); roll the matcher back to where it was. Returns the filled rows."""
    matcher.fill_next_token_bitmask(bitmask, row0)
    filled = [row0]
    accepted = 0
    for token in drafts:
        if not matcher.accept_token(token):
            break
        accepted += 1
        if matcher.is_terminated():
            break
        matcher.fill_next_token_bitmask(bitmask, row0 + accepted)
        filled.append(row0 + accepted)
    if accepted:
        matcher.rollback(accepted)
    return filled


def apply_bitmask_(logits: torch.Tensor, mask: TokenBitmask, rows: list[int]) -> None:
    """Set the disallowed tokens of ``rows`` (constrained rows) of float32 ``logits [B, V]`` to ``-inf``, in
    place; other rows are not touched."""
    xgr.apply_token_bitmask_inplace(logits, mask.bitmask.to(logits.device, non_blocking=True), indices=rows)


def allowed_argmax(logits: torch.Tensor, mask: TokenBitmask, rows: list[int], candidates: int = 16
                   ) -> dict[int, int]:
    """Greedy picks of constrained ``rows`` without masking them: the most likely of each row's top
    ``candidates`` tokens that its grammar allows. A row whose top candidates are all forbidden is left out
    (the caller masks and samples it); the pick equals the argmax of the masked row.

    Returns:
        row -> token id.
    """
    if not rows:
        return {}
    index = torch.tensor(rows, dtype=torch.long)
    sub = logits if len(rows) == logits.shape[0] else logits.index_select(0, index.to(logits.device))
    values, ids = sub.topk(min(candidates, logits.shape[1]), dim=-1)
    values, ids = values.cpu(), ids.cpu()
    words = mask.bitmask.index_select(0, index).gather(1, ids >> 5)
    allowed = (((words >> (ids & 31).to(torch.int32)) & 1) == 1) & (values > float("-inf"))
    first = allowed.to(torch.int8).argmax(dim=1)
    picks = ids.gather(1, first[:, None])[:, 0].tolist()
    found = allowed.any(dim=1).tolist()
    return {row: pick for row, pick, ok in zip(rows, picks, found, strict=True) if ok}
