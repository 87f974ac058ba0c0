"""The in-process executor (``distributed_executor_backend="uni"``): one worker in the engine core's process."""

from __future__ import annotations

from collections import deque

from kilat.config import EngineConfig
from kilat.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from kilat.executor.abstract import Executor
from kilat.executor.worker import Worker


class UniProcExecutor(Executor):
    """Runs one :class:`Worker` in this process: a step is a function call (vLLM's ``UniProcExecutor``), made when
    the step is collected (so a failure surfaces at :meth:`collect`).

    Args:
        config: validated engine configuration.

    Raises:
        ValueError: as :class:`Worker`.
    """

    def __init__(self, config: EngineConfig):
        super().__init__(config)
        self.worker = Worker(config)
        self.info = self.worker.info
        self._submitted: deque[SchedulerOutput] = deque()

    def submit(self, sched: SchedulerOutput) -> None:
        self._submitted.append(sched)

    def collect(self) -> ModelRunnerOutput:
        return self.worker.execute_model(self._submitted.popleft())

    def shutdown(self) -> None:
        """Finish the worker's queued work (the worker lives and dies with this process)."""
        self.worker.shutdown()
