"""The in-process executor (``distributed_executor_backend="uni"``): one worker in the engine core's process."""

from __future__ import annotations

from kilat.config import EngineConfig
from kilat.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from kilat.executor.abstract import Executor
from kilat.executor.worker import Worker


class UniProcExecutor(Executor):
    """Runs one :class:`Worker` in this process: a step is a function call (vLLM's ``UniProcExecutor``).

    Args:
        config: validated engine configuration.

    Raises:
        ValueError: as :class:`Worker`.
    """

    def __init__(self, config: EngineConfig):
        super().__init__(config)
        self.worker = Worker(config)
        self.info = self.worker.info

    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        return self.worker.execute_model(sched)

    def shutdown(self) -> None:
        """Nothing to stop: the worker lives and dies with this process."""
