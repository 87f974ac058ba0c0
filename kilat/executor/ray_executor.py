"""The Ray executor (``distributed_executor_backend="ray"``): each worker a Ray actor, on one machine or across
machines joined into a Ray cluster (the multi-node path; vLLM's ``RayDistributedExecutor``).

1. The executor joins the Ray cluster named by ``RAY_ADDRESS`` (``auto``: the one ``ray start`` runs on this
   machine), or starts a private one-machine cluster when none is named (even when ``ray start`` left one
   running here). With ``data_parallel_size`` above 1 and no ``RAY_ADDRESS``, each engine core starts its own.
2. It reserves one bundle per rank in a placement group (``{"CPU": 1}``, plus ``{"GPU": 1}`` on CUDA; strategy
   ``PACK``: fill a machine before the next) and waits up to :data:`PLACEMENT_TIMEOUT_S` for the cluster to grant
   it, then starts one :class:`RayWorker` actor per bundle, in rank order.
3. Rank 0's actor names the rendezvous: its node's IP and a free port. Every actor then builds its
   :class:`~kilat.executor.worker.Worker` (joining the ranks over that address: gloo on CPUs, NCCL on GPUs) and
   returns its :class:`~kilat.executor.abstract.WorkerInfo`.
4. A step is ``execute_model`` called on every actor with the same :class:`SchedulerOutput`, put in the object
   store once; an actor runs its calls in order, so up to ``pipeline_parallel_size`` steps may be submitted
   before the oldest is collected.

Failure rules are ``mp``'s: a dead actor (its process or its machine gone) raises
:class:`~kilat.executor.abstract.WorkerDiedError` when its result is awaited, as does, with several ranks, an
exception in any rank; after that the executor refuses every step. Actors die with the engine core (Ray ends a
driver's actors when it exits).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import signal
import socket
import threading
from collections import deque
from typing import Any

from kilat.config import EngineConfig
from kilat.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from kilat.executor.abstract import Executor, WorkerDiedError, WorkerInfo, combine_infos

logger = logging.getLogger("kilat")

PLACEMENT_TIMEOUT_S = 120.0
"""Most seconds to wait for the cluster to grant the ranks' resources."""


class RayWorker:
    """One rank's :class:`~kilat.executor.worker.Worker` inside a Ray actor (created with ``ray.remote``)."""

    def __init__(self) -> None:
        self.worker: Any = None
        self.is_output = False

    def rendezvous(self) -> str:
        """``tcp://IP:PORT`` on this actor's node, with a port free now (rank 0's: the ranks' rendezvous)."""
        import ray

        ip = ray.util.get_node_ip_address()
        with socket.socket() as s:
            s.bind((ip, 0))
            return f"tcp://{ip}:{s.getsockname()[1]}"

    def load(self, config: EngineConfig, rank: int, distributed_init_method: str) -> WorkerInfo:
        """Build the rank's worker (Ray makes the one GPU it granted device 0) and return its info."""
        from kilat.executor.worker import Worker

        self.worker = Worker(config, rank, distributed_init_method, device_index=0)
        self.is_output = rank == config.parallel.output_rank
        return self.worker.info

    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput | None:
        """One step; only the output rank's result is sent back."""
        result = self.worker.execute_model(sched)
        return result if self.is_output else None


class RayExecutor(Executor):
    """Runs each worker in a Ray actor (module docs).

    Args:
        config: validated engine configuration.

    Attributes:
        max_concurrent_batches: ``pipeline_parallel_size``.

    Raises:
        ValueError: as :class:`~kilat.executor.worker.Worker`, raised again here (the actors are stopped).
        RuntimeError: the cluster did not grant the ranks' resources within :data:`PLACEMENT_TIMEOUT_S`.
        WorkerDiedError: an actor died while it loaded the model.
    """

    def __init__(self, config: EngineConfig):
        import ray
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        super().__init__(config)
        parallel = config.parallel
        self.world_size = parallel.world_size
        self.output_rank = parallel.output_rank
        self.max_concurrent_batches = parallel.pipeline_parallel_size
        self._ray = ray
        self._started_ray = not ray.is_initialized()
        self._group: Any = None
        self._remove_group = remove_placement_group
        self.actors: list[Any] = []
        self._pending: deque[list[Any]] = deque()
        if self._started_ray:
            address = os.environ.get("RAY_ADDRESS")
            # a private cluster counts at least one CPU per rank (Ray's CPUs are reservations, not cores)
            private = {"address": "local", "num_cpus": max(os.cpu_count() or 1, self.world_size)}
            on_term = signal.getsignal(signal.SIGTERM)
            ray.init(**({"address": address} if address else private), include_dashboard=False,
                     configure_logging=False)
            if threading.current_thread() is threading.main_thread():
                signal.signal(signal.SIGTERM, on_term)  # ray.init installs its own; the engine core's decides
        bundle = {"CPU": 1, **({"GPU": 1} if config.device == "cuda" else {})}
        try:
            self._group = placement_group([bundle] * self.world_size, strategy="PACK")
            if not self._group.wait(PLACEMENT_TIMEOUT_S):
                raise RuntimeError(f"the Ray cluster did not grant {self.world_size} x {bundle} within "
                                   f"{PLACEMENT_TIMEOUT_S:.0f} s (ray status shows what it has)")
            actor = ray.remote(num_cpus=1, num_gpus=bundle.get("GPU", 0))(RayWorker)
            self.actors = [actor.options(scheduling_strategy=PlacementGroupSchedulingStrategy(
                placement_group=self._group, placement_group_bundle_index=rank)).remote()
                for rank in range(self.world_size)]
            address = ray.get(self.actors[0].rendezvous.remote())
            config = dataclasses.replace(config, frontend_pid=None)  # an actor's parent is Ray's, not kilat's
            infos = self._get([a.load.remote(config, rank, address) for rank, a in enumerate(self.actors)],
                              loading=True)
            self.info = combine_infos(infos, parallel)
        except BaseException:
            self.shutdown()
            raise
        logger.info("executor ray: %d actor(s) in placement group %s", self.world_size, self._group.id.hex())

    def _get(self, refs: list[Any], loading: bool = False) -> list[Any]:
        """The actors' results of one call, by rank.

        Raises:
            WorkerDiedError: an actor died (or Ray lost it, its node or its results), or (several ranks, after
                loading) raised.
            Exception: the exception a rank raised (while loading, or with one rank).
        """
        ray = self._ray
        try:
            return ray.get(refs)
        except ray.exceptions.RayTaskError as e:
            cause = e.as_instanceof_cause()
            if self.world_size > 1 and not loading:
                raise WorkerDiedError(f"a Ray worker failed ({type(cause).__name__}: {cause}); the model's ranks "
                                      f"are out of step") from e
            raise cause from None
        except ray.exceptions.RayError as e:  # an actor, its node, the object store or the cluster is gone
            raise WorkerDiedError(f"a Ray worker died ({type(e).__name__}: {e})") from e

    def submit(self, sched: SchedulerOutput) -> None:
        """Call ``execute_model`` on every actor (the step put in the object store once).

        Raises:
            WorkerDiedError: after a call that left the actors in an unknown state.
        """
        self._check_usable()
        try:
            step = self._ray.put(sched)
            self._pending.append([a.execute_model.remote(step) for a in self.actors])
        except self._ray.exceptions.RayError as e:
            self._broken = f"the step could not be sent ({type(e).__name__}: {e})"
            raise WorkerDiedError(self._broken) from e

    def collect(self) -> ModelRunnerOutput:
        """The output rank's result of the oldest submitted step.

        Raises:
            WorkerDiedError: as :meth:`_get`, and as :meth:`submit`.
            Exception: the exception the one actor raised (one rank; the engine goes on).
        """
        self._check_usable()
        return self._wait_for(lambda: self._get(self._pending.popleft()))[self.output_rank]

    def shutdown(self) -> None:
        """Kill the actors, release the placement group, and stop Ray if this executor started it (each step even
        when an earlier one fails: the cluster may be gone). Idempotent."""
        ray = self._ray
        if not ray.is_initialized():
            return
        actors, group, self.actors, self._group = self.actors, self._group, [], None
        for actor in actors:
            with contextlib.suppress(Exception):
                ray.kill(actor)
        if group is not None:
            with contextlib.suppress(Exception):
                self._remove_group(group)
        if self._started_ray:
            ray.shutdown()
