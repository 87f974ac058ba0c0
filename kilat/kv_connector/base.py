"""The KV-connector interface (vLLM's ``KVConnectorBase_V1``: the same method names and roles).

One connector class has two sides, built twice from the same :class:`~kilat.config.EngineConfig`: the
*scheduler* side lives in the engine core next to the :class:`~kilat.core.scheduler.Scheduler` and decides what
moves; the *worker* side lives next to each model runner, holds the KV cache tensors and moves the bytes. They
talk only through plain data: the scheduler side's :class:`KVConnectorMetadata` rides in each step's
``SchedulerOutput.kv_connector_metadata``, and the worker side's :class:`KVConnectorOutput` comes back in
``ModelRunnerOutput.kv_connector_output``.

A step, with a connector:

1. Scheduler, admitting a waiting request after its local prefix-cache hit of ``num_computed_tokens``:
   :meth:`get_num_new_matched_tokens` → how many more prompt tokens the connector can supply. The scheduler
   allocates their blocks (outside the prefix cache), calls :meth:`update_state_after_alloc` and parks the
   request (``WAITING_FOR_REMOTE_KVS``) until the worker reports it in ``finished_recving``; the blocks up to
   the first of ``invalid_block_ids`` then join the prefix cache and the request is admitted again, finding
   them as a local hit (kilat runs every load this way, asynchronously: the offload tier's within the step that
   carries it, a pull from another engine over as many steps as it takes).
2. Scheduler, at the end of ``schedule()``: :meth:`build_connector_meta` → this step's jobs.
3. Worker (``ModelRunner.execute``), before the forward: :meth:`bind_connector_metadata`,
   :meth:`start_load_kv`; after it :meth:`get_finished`, :meth:`clear_connector_metadata`. (vLLM's layer-wise
   hooks, ``wait_for_layer_load`` and ``save_kv_layer``, come with the first connector that streams layers.)
4. Scheduler, with the step's output: :meth:`update_connector_output` (a step that failed before it was sent:
   :meth:`requeue_connector_meta`); before it frees a request's blocks
   (finished, aborted or preempted): :meth:`request_finished`, which may delay the freeing (vLLM's ``True``:
   a prefill instance keeps them for its decode instance) until the worker reports the request in
   ``finished_sending``; its ``kv_transfer_params`` reach the client with the request's finish.

While loads or sends are in flight and nothing else runs, the engine core polls the workers with empty steps
(every few milliseconds, :data:`kilat.core.engine_core.TRANSFER_POLL_S`), for which
:meth:`build_connector_meta` returns metadata even without new jobs. A parked request that is aborted keeps its
blocks until its load is reported, so that a late write never lands in a block that was handed on; the worker
side must report every load it was sent, whatever happens to it.

Without a connector (``None``, the default) none of this runs: no cost.
"""

from __future__ import annotations

import enum
import importlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from kilat.config import EngineConfig
    from kilat.core.request import Request
    from kilat.core.scheduler_output import SchedulerOutput


@dataclass(frozen=True)
class KVCacheSpec:
    """The KV cache as both sides of a connector see it (plain data).

    Attributes:
        num_blocks: blocks in the engine's cache.
        block_size: tokens per block.
        bytes_per_block: bytes of one block over every KV tensor (all layers' keys and values, their scales, a
            draft model's).
        dtype: the model's dtype (``"float32"``, ...).
        kv_cache_dtype: the KV cache's storage dtype.
    """

    num_blocks: int
    block_size: int
    bytes_per_block: int
    dtype: str
    kv_cache_dtype: str


class KVConnectorRole(enum.Enum):
    """Which side of a connector an instance is."""

    SCHEDULER = "scheduler"
    WORKER = "worker"


@dataclass
class KVConnectorMetadata:
    """One step's jobs from the scheduler side to the worker side (plain data; each connector subclasses it)."""


@dataclass
class KVConnectorOutput:
    """What the worker side reports after a step (vLLM's ``KVConnectorOutput``).

    Attributes:
        finished_recving: requests whose asynchronous load ended (successfully or not).
        finished_sending: requests whose delayed blocks (:meth:`KVConnectorBase.request_finished` returned
            True) may now be freed: their transfer ended, failed or timed out.
        invalid_block_ids: blocks whose load failed (missing, truncated or corrupt data): the scheduler
            recomputes them.
        stats: counters of this step's transfers (connector-defined names → numbers), summed into the
            engine's metrics.
    """

    finished_recving: set[str] = field(default_factory=set)
    finished_sending: set[str] = field(default_factory=set)
    invalid_block_ids: set[int] = field(default_factory=set)
    stats: dict[str, float] = field(default_factory=dict)


class KVConnectorBase:
    """A connector that does nothing; subclasses override what they need (module docstring for the order).

    Args:
        config: the engine's validated configuration.
        role: which side this instance is.
        kv_cache_spec: the engine's KV cache.
    """

    def __init__(self, config: EngineConfig, role: KVConnectorRole, kv_cache_spec: KVCacheSpec):
        self.config = config
        self.role = role
        self.kv_cache_spec = kv_cache_spec
        self._metadata: KVConnectorMetadata | None = None

    # ---- scheduler side ----
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        """Prompt tokens after the first ``num_computed_tokens`` (the local hit, a multiple of the block size)
        whose KV the connector can supply, and whether they arrive asynchronously. Never the last prompt token
        (its logits must be computed)."""
        return 0, False

    def update_state_after_alloc(self, request: Request, block_ids: list[int], num_external_tokens: int) -> None:
        """The blocks allocated for the ``num_external_tokens`` tokens :meth:`get_num_new_matched_tokens`
        offered (``block_ids``, in token order)."""

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata | None:
        """This step's jobs for the worker side (``None``: nothing to do); resets the scheduler side's per-step
        state."""
        return None

    def requeue_connector_meta(self, metadata: KVConnectorMetadata) -> None:
        """A step carrying ``metadata`` (from :meth:`build_connector_meta`) never reached the workers (it failed
        before it was sent): queue its jobs again, ahead of those gathered since, so the next step carries
        them (a load that is never run would leave its request waiting for good)."""

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """Learn what the worker side did in a step."""

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """A request ended (or was preempted) and its blocks (``block_ids``, in token order) are about to be
        freed. Returns vLLM's pair: whether to delay freeing them until the worker side reports the request in
        ``finished_sending`` (never for a preempted request), and the ``kv_transfer_params`` for the client
        (``None``: none)."""
        return False, None

    def has_pending_work(self) -> bool:
        """Whether :meth:`build_connector_meta` has jobs even if no request is scheduled (the engine then runs
        a step anyway)."""
        return False

    # ---- worker side ----
    def register_kv_caches(self, kv_caches: list[torch.Tensor]) -> None:
        """The runner's KV cache tensors, every one with the block index on dimension 1 (``[2, num_blocks,
        ...]``: keys and values of each layer, their scales, a draft model's)."""

    def bind_connector_metadata(self, metadata: KVConnectorMetadata | None) -> None:
        """This step's jobs, before the forward."""
        self._metadata = metadata

    def clear_connector_metadata(self) -> None:
        """After the step."""
        self._metadata = None

    def start_load_kv(self) -> None:
        """Begin (or, for a synchronous connector, do) this step's loads and saves of whole blocks."""

    def get_finished(self, finished_req_ids: set[str]) -> KVConnectorOutput:
        """What finished since the last call (``finished_req_ids``: requests that ended this step)."""
        return KVConnectorOutput()

    def shutdown(self) -> None:
        """Release threads and files."""


KV_CONNECTORS: dict[str, str] = {
    "OffloadingConnector": "kilat.kv_connector.offloading:OffloadingConnector",
    "TcpConnector": "kilat.kv_connector.tcp:TcpConnector",
}
"""Connector name (``EngineConfig.kv_connector_name``) → ``module:class``, imported on first use."""


def create_kv_connector(config: EngineConfig, role: KVConnectorRole,
                        kv_cache_spec: KVCacheSpec) -> KVConnectorBase | None:
    """The configured connector's ``role`` side, or ``None`` when none is configured."""
    name = config.kv_connector_name
    if name is None:
        return None
    module, cls = KV_CONNECTORS[name].split(":")
    return getattr(importlib.import_module(module), cls)(config, role, kv_cache_spec)
