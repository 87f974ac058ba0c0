"""The synchronous engine: input processing, the engine core in-process, and output processing."""

from __future__ import annotations

import itertools
import selectors
import time
import weakref
from typing import Any

from kilat.config import EngineArgs
from kilat.core.engine_core import TRANSFER_POLL_S, EngineCore
from kilat.core.request import RequestStatus
from kilat.engine.input_processor import PromptType
from kilat.engine.processors import build_processors
from kilat.outputs import RequestOutput
from kilat.sampling_params import SamplingParams

_GRAMMAR_WAIT_S = 1.0
"""Most seconds :meth:`LLMEngine.step` sleeps for a grammar compile to end before it steps anyway."""


class LLMEngine:
    """Adds requests and steps them to completion in the calling thread.

    Args:
        engine_args: flat engine arguments (vLLM names).

    Raises:
        ValueError: an invalid argument, named (``data_parallel_size`` above 1: one engine runs here).
    """

    def __init__(self, engine_args: EngineArgs):
        self.config = engine_args.create_engine_config()
        if self.config.parallel.data_parallel_size > 1:
            raise ValueError(f"data_parallel_size ({self.config.parallel.data_parallel_size}) is for kilat serve "
                             f"(engine cores behind one server); the offline LLM runs one engine")
        self.core = EngineCore(self.config)
        self.hf_config = self.core.info.hf_config
        self.tokenizer, self.input_processor, self.output_processor = build_processors(
            self.config.model, self.hf_config, self.core.max_model_len,
            None if self.config.kv_transfer is None else self.config.kv_transfer.kv_role,
            self.config.scheduler.scheduling_policy)
        self._ids = itertools.count()
        # a dropped engine stops its grammar compile workers too (they are processes of their own)
        self._finalizer = weakref.finalize(self, self.core.shutdown)

    def shutdown(self) -> None:
        """Stop the grammar compile workers (processes) and threads, and the executor's worker processes.
        Idempotent; also done when the engine is garbage-collected or the interpreter exits."""
        self._finalizer()

    @property
    def stats(self) -> Any:
        """The core's :class:`~kilat.metrics.stats.EngineStats`."""
        return self.core.stats

    def new_request_id(self) -> str:
        """A fresh, unique request id."""
        return str(next(self._ids))

    def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams,
                    add_special_tokens: bool = True) -> None:
        """Validate and queue one request.

        Raises:
            ValueError: the prompt or parameters are invalid for this model (nothing is queued).
        """
        text, ids, params, core_requests = self.input_processor.process(request_id, prompt, params,
                                                                        add_special_tokens)
        self.output_processor.add_request(request_id, text, ids, params, core_requests)
        self.core.add_requests(core_requests)

    def abort_request(self, request_ids: list[str]) -> None:
        """Abort requests by their user-visible ids, freeing their KV blocks."""
        for rid in request_ids:
            self.core.abort_requests(self.output_processor.abort_request(rid))

    def has_unfinished_requests(self) -> bool:
        """True while any request is in flight."""
        return len(self.output_processor) > 0 or self.core.has_unfinished_requests()

    def step(self) -> list[RequestOutput]:
        """Run one engine step; return the requests it updated. While every request only waits for its grammar
        to compile, it first sleeps until a compile ends (at most ``_GRAMMAR_WAIT_S``) instead of spinning; while
        only KV transfers are in flight, ``TRANSFER_POLL_S``. A step also frees the blocks a prefill instance
        kept for a decode instance once they were pulled (an offline producer frees them on its next step)."""
        fd = self.core.grammar_wakeup_fd
        if fd is not None and self.core.has_unfinished_requests() and self.core.waits_only_for_grammars():
            with selectors.DefaultSelector() as selector:
                selector.register(fd, selectors.EVENT_READ)
                selector.select(_GRAMMAR_WAIT_S)
            self.core.drain_grammar_wakeups()
        elif self.core.waits_only_for_transfers():
            time.sleep(TRANSFER_POLL_S)
        outputs, to_abort = self.output_processor.process_outputs(self.core.step())
        if to_abort:
            self.core.abort_requests(to_abort, RequestStatus.FINISHED_STOPPED)
        return outputs
