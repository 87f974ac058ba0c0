"""The engine core's side of structured outputs: compile grammars in background threads, keep one xgrammar
matcher per constrained request, fill the step's token bitmask and advance the matchers.

A request's grammar compiles in a thread pool as soon as it is added; the scheduler leaves it waiting (and
runs others) until :attr:`GrammarState.ready`. Compiled grammars are cached by their spec, so repeated
schemas compile once. Rows of unconstrained requests are never touched: a batch without constrained rows
builds no bitmask at all.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
import xgrammar as xgr

from kilat.sampling_params import StructuredOutputsParams
from kilat.structured_outputs.grammar import compile_grammar

logger = logging.getLogger("kilat")


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

    def shutdown(self) -> None:
        """Stop the compilation threads (pending compilations are dropped)."""
        self._pool.shutdown(wait=False, cancel_futures=True)


def build_bitmask(grammars: list[GrammarState | None], vocab_size: int) -> torch.Tensor | None:
    """The step's token bitmask for rows whose request is constrained, or ``None`` if none is.

    Args:
        grammars: per sampled row, its request's grammar state (ready) or ``None``.
        vocab_size: logit columns.

    Returns:
        int32 ``[len(grammars), ceil(vocab_size / 32)]`` (bit set = token allowed; unconstrained rows allow
        every token), on the CPU.
    """
    if all(g is None for g in grammars):
        return None
    bitmask = xgr.allocate_token_bitmask(len(grammars), vocab_size)
    for row, grammar in enumerate(grammars):
        if grammar is not None:
            grammar.matcher.fill_next_token_bitmask(bitmask, row)
    return bitmask


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """Return a copy of float32 ``logits [B, V]`` with disallowed tokens at ``-inf``."""
    masked = logits.clone()
    xgr.apply_token_bitmask_inplace(masked, bitmask.to(logits.device, non_blocking=True))
    return masked
