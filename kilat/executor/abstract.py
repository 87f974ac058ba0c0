"""The executor interface and the plain data its workers report."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

from kilat.config import EngineConfig
from kilat.core.scheduler_output import ModelRunnerOutput, SchedulerOutput


@dataclass(frozen=True)
class WorkerInfo:
    """What the engine core needs to know of the loaded model and its KV cache, reported by the worker that
    returns the outputs (plain data: it crosses process boundaries).

    Attributes:
        hf_config: the model's transformers config.
        dtype: the model (activation) dtype's name (``"bfloat16"``, ``"float32"``, ...).
        weight_bytes: bytes of this worker's weights as stored (``kilat.bench.mbu.weight_bytes``; one rank's).
        kv_bytes_per_token: bytes one token's K and V take in this worker's cache, scales included.
        max_model_len: longest context in tokens, capped by the model's positions and the KV cache.
        num_blocks: KV blocks allocated.
        num_lookahead_tokens: KV slots the scheduler reserves after a request's last token for drafts.
        kv_cache_dtype: the KV cache's storage dtype name (``"bfloat16"``, ``"int8"``, ...).
        bytes_per_block: bytes one KV block takes over all layers (scales and a draft model's cache included).
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


class WorkerDiedError(RuntimeError):
    """A worker process exited, or one of several tensor-parallel ranks raised (the others may wait in a
    collective forever): the engine cannot go on (served, the engine-core process exits and the frontend
    restarts it)."""


class Executor(ABC):
    """Runs the model's workers and hands each step to them (vLLM's ``Executor``).

    Args:
        config: validated engine configuration.

    Attributes:
        info: what the output worker reported once the model was loaded.

    Raises:
        ValueError: an invalid model or configuration found while loading, as the model runner raises it.
    """

    info: WorkerInfo

    def __init__(self, config: EngineConfig):
        self.config = config

    @abstractmethod
    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step on every worker; return the output worker's result.

        Raises:
            WorkerDiedError: a worker process is gone, or (several ranks) one raised: the engine cannot go on.
            Exception: the step raised in the one worker (its requests fail; the engine goes on).
        """

    @abstractmethod
    def shutdown(self) -> None:
        """Stop the workers and release what they hold. Idempotent."""
