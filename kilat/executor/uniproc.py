"""The in-process executor (``distributed_executor_backend="uni"``): one worker in the engine core's process."""

from __future__ import annotations

from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from kilat.config import EngineConfig
from kilat.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from kilat.executor.abstract import Executor
from kilat.executor.worker import Worker


class UniProcExecutor(Executor):
    """Runs one :class:`Worker` in this process (vLLM's ``UniProcExecutor``). A step is a function call made when
    the step is collected (so a failure surfaces at :meth:`collect`); under async scheduling on CUDA it is run at
    once on a thread of its own, so that the engine core schedules the next step while the device computes (torch
    releases the GIL while it waits for the device), and :meth:`collect` waits for it.

    Not on the CPU: the model's OpenMP threads hold every core there, and a second thread that runs torch's
    parallel ops gives libgomp more threads than cores, so that every thread stops spin-waiting between ops (a
    batch-1 decode step of the embedded model took 10.3 ms on that thread against 3.4 ms inline:
    docs/benchmarks.md, "Async scheduling").

    Args:
        config: validated engine configuration.

    Raises:
        ValueError: as :class:`Worker`.
    """

    def __init__(self, config: EngineConfig):
        super().__init__(config)
        self.worker = Worker(config)
        self.info = self.worker.info
        self._submitted: deque[SchedulerOutput | Future[ModelRunnerOutput]] = deque()
        self._thread = ThreadPoolExecutor(1, "kilat-step") \
            if config.scheduler.async_scheduling and torch.device(config.device).type == "cuda" else None

    def submit(self, sched: SchedulerOutput) -> None:
        self._submitted.append(sched if self._thread is None else self._thread.submit(self.worker.execute_model, sched))

    def collect(self) -> ModelRunnerOutput:
        step = self._submitted.popleft()
        return step.result() if isinstance(step, Future) else self.worker.execute_model(step)

    def shutdown(self) -> None:
        """Wait for a step in flight, then finish the worker's queued work (the worker lives and dies with this
        process)."""
        if self._thread is not None:
            self._thread.shutdown()
        self.worker.shutdown()
