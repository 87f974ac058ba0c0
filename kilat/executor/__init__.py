"""Executors: where the model's workers run, behind one interface (vLLM's executor classes).

The engine core hands an executor a :class:`~kilat.core.scheduler_output.SchedulerOutput` per step and gets a
:class:`~kilat.core.scheduler_output.ModelRunnerOutput` back; whether the worker runs in the same process
(``uni``), in a process of its own (``mp``) or in a Ray actor on any machine of a Ray cluster (``ray``) is
invisible to the core. Backends are imported on first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kilat.executor.abstract import Executor

EXECUTOR_BACKENDS = {
    "uni": "kilat.executor.uniproc:UniProcExecutor",
    "mp": "kilat.executor.multiproc:MultiprocExecutor",
    "ray": "kilat.executor.ray_executor:RayExecutor",
}
"""``distributed_executor_backend`` name → ``module:class`` of its executor."""


def get_executor_class(name: str) -> type[Executor]:
    """The executor class of backend ``name`` (a key of :data:`EXECUTOR_BACKENDS`), imported now.

    Raises:
        KeyError: an unknown name (:class:`~kilat.config.ParallelConfig` refuses those first).
    """
    module, cls = EXECUTOR_BACKENDS[name].split(":")
    return getattr(importlib.import_module(module), cls)
