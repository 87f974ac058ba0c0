"""The executor interface and the plain data its workers report."""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from kilat.config import EngineConfig
from kilat.core.kv_cache_groups import KVCacheGroup
from kilat.core.scheduler_output import ModelRunnerOutput, SchedulerOutput


@dataclass(frozen=True)
class WorkerInfo:
    """What the engine core needs to know of the loaded model and its KV cache, reported by the worker that
    returns the outputs (plain data: it crosses process boundaries).

    Attributes:
        hf_config: the model's transformers config.
        dtype: the model (activation) dtype's name (``"bfloat16"``, ``"float32"``, ...).
        weight_bytes: bytes of the weights as stored (``kilat.bench.mbu.weight_bytes``): one tensor-parallel rank's,
            over every pipeline stage.
        kv_bytes_per_token: bytes one token's K and V take in the cache of one tensor-parallel rank (every
            pipeline stage's layers), scales included.
        max_model_len: longest context in tokens, capped by the model's positions and the KV cache.
        num_blocks: KV blocks allocated.
        num_lookahead_tokens: KV slots the scheduler reserves after a request's last token for drafts.
        kv_cache_dtype: the KV cache's storage dtype name (``"bfloat16"``, ``"int8"``, ...).
        bytes_per_block: bytes one KV block takes over all layers of one tensor-parallel rank (scales and a draft
            model's cache included).
        sliding_windows: the attention window of each KV cache (``None``: full attention): each pipeline stage's
            layers then its draft model's, in stage order (:func:`~kilat.core.sliding_window.kv_sliding_window`).
        kv_cache_groups: the output rank's KV-cache groups (:mod:`kilat.core.kv_cache_groups`): several only for a
            hybrid model on one pipeline stage (every rank then plans the same ones).
    """

    hf_config: Any
    dtype: str
    weight_bytes: int
    kv_bytes_per_token: float
    max_model_len: int
    num_blocks: int
    num_lookahead_tokens: int
    kv_cache_dtype: str
    bytes_per_block: int
    sliding_windows: tuple[int | None, ...] = ()
    kv_cache_groups: tuple[KVCacheGroup, ...] = ()


def combine_infos(infos: list[WorkerInfo], parallel: Any) -> WorkerInfo:
    """The engine's view of every rank's info (by rank, ``parallel`` a :class:`~kilat.config.ParallelConfig`): the
    output rank's, with the fewest KV blocks any rank has (ranks may size their caches apart: CUDA profiling), and
    weight and KV sizes added up over the pipeline stages (tensor-parallel rank 0 of each), and the stages' sliding
    windows in stage order."""
    stages = infos[::parallel.tensor_parallel_size]
    return dataclasses.replace(infos[parallel.output_rank], num_blocks=min(i.num_blocks for i in infos),
                               weight_bytes=sum(i.weight_bytes for i in stages),
                               kv_bytes_per_token=sum(i.kv_bytes_per_token for i in stages),
                               bytes_per_block=sum(i.bytes_per_block for i in stages),
                               sliding_windows=tuple(w for i in stages for w in i.sliding_windows))


T = TypeVar("T")


class WorkerDiedError(RuntimeError):
    """A worker process exited, or one of several tensor-parallel ranks raised (the others may wait in a
    collective forever): the engine cannot go on (served, the engine-core process exits and the frontend
    restarts it)."""


class Executor(ABC):
    """Runs the model's workers and hands each step to them (vLLM's ``Executor``).

    A step is :meth:`submit` then :meth:`collect`; several steps may be submitted before the oldest is collected
    (pipeline parallelism keeps :attr:`max_concurrent_batches`, one per stage, in flight; async scheduling two), and
    outputs come back in submission order.

    Args:
        config: validated engine configuration.

    Attributes:
        info: what the output worker reported once the model was loaded.
        max_concurrent_batches: steps that may be in flight at once (1: each is collected before the next).

    Raises:
        ValueError: an invalid model or configuration found while loading, as the model runner raises it.
    """

    info: WorkerInfo
    max_concurrent_batches: int = 1

    def __init__(self, config: EngineConfig):
        self.config = config
        self._broken: str | None = None  # why the workers are in an unknown state, once they are

    def _check_usable(self) -> None:
        """Raise :class:`WorkerDiedError` after a call that left the workers in an unknown state."""
        if self._broken is not None:
            raise WorkerDiedError(f"the workers are unusable: {self._broken}")

    def _wait_for(self, wait: Callable[[], T]) -> T:
        """``wait()`` (a step's results), marking the workers unusable when it raises :class:`WorkerDiedError` or
        is interrupted (``KeyboardInterrupt``: the step's results may still come, out of step with the next)."""
        try:
            return wait()
        except BaseException as e:
            if isinstance(e, WorkerDiedError):
                self._broken = str(e)
            elif not isinstance(e, Exception):
                self._broken = f"interrupted ({type(e).__name__}) while waiting for a step"
            raise

    @abstractmethod
    def submit(self, sched: SchedulerOutput) -> None:
        """Hand one step to the workers (:meth:`collect` returns its output).

        Raises:
            WorkerDiedError: the workers are gone or unusable.
        """

    @abstractmethod
    def collect(self) -> ModelRunnerOutput:
        """The output of the oldest submitted step not yet collected (waits for it).

        Raises:
            WorkerDiedError: a worker process is gone, or (several ranks) one raised: the engine cannot go on.
            Exception: the step raised in the one worker (its requests fail; the engine goes on).
        """

    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step on every worker; return the output worker's result (:meth:`submit`, :meth:`collect`)."""
        self.submit(sched)
        return self.collect()

    @abstractmethod
    def shutdown(self) -> None:
        """Stop the workers and release what they hold. Idempotent."""
