"""The KV offload tier (``kv_offloading_size`` + ``kv_offloading_path``): prefix-cache blocks persisted on disk.

Policy (scheduler side):

- **Save**: when a request's blocks are about to be freed (it finished, was aborted or preempted), each of its
  full, computed blocks whose hash the tier lacks is saved. The worker copies the block out at the start of the
  next step, before that step's forward can overwrite it, and a background thread writes the file. The tier is
  LRU: a save beyond ``kv_offloading_size`` deletes the least recently used blocks first.
- **Load**: a waiting request whose prompt continues past its local prefix-cache hit with blocks the tier holds
  gets those blocks allocated and waits (``WAITING_FOR_REMOTE_KVS``) while the worker reads and checks them at the
  start of the next step; then it is scheduled from the first block that did not load (a missing, truncated or
  corrupt file is recomputed, never decoded from, and leaves the tier).

Files live in ``kv_offloading_path/<namespace>/``, the namespace being a hash of what makes blocks
interchangeable (model, dtypes, block size and bytes per block), so a restarted engine of the same model finds
its blocks and another model never reads them.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from kilat.core.block_hash import BlockHash
from kilat.kv_connector.base import (
    KVCacheSpec,
    KVConnectorBase,
    KVConnectorMetadata,
    KVConnectorOutput,
    KVConnectorRole,
)
from kilat.kv_connector.block_io import BlockIO, kv_namespace
from kilat.kv_connector.disk_store import CorruptBlockError, DiskBlockStore

if TYPE_CHECKING:
    from kilat.config import EngineConfig
    from kilat.core.request import Request
    from kilat.core.scheduler_output import SchedulerOutput

logger = logging.getLogger("kilat")

TIER = "disk"
"""The tier's name in the metrics."""


@dataclass
class OffloadingMetadata(KVConnectorMetadata):
    """One step's jobs.

    Attributes:
        writes: in the order the scheduler side decided them, ``(block id, hash)`` to copy out (before the
            forward) and save, or ``(-1, hash)`` to delete; the writer thread runs them in this order, so a hash
            evicted then saved again within a step ends up stored.
        loads: request id → ``(block id, hash)`` of its blocks to read, in token order.
    """

    writes: list[tuple[int, BlockHash]] = field(default_factory=list)
    loads: dict[str, list[tuple[int, BlockHash]]] = field(default_factory=dict)


class OffloadingConnector(KVConnectorBase):
    """Saves freed prefix-cache blocks to a disk tier and loads them back on a prefix hit (module docs).

    Raises:
        OSError: the tier's directory cannot be created.
    """

    def __init__(self, config: EngineConfig, role: KVConnectorRole, kv_cache_spec: KVCacheSpec):
        super().__init__(config, role, kv_cache_spec)
        directory = f"{config.cache.kv_offloading_path}/{kv_namespace(config, kv_cache_spec)}"
        self.store = DiskBlockStore(directory, kv_cache_spec.bytes_per_block)
        if role is KVConnectorRole.SCHEDULER:
            self._init_scheduler()
        else:
            self._init_worker()

    # ---- scheduler side ----
    def _init_scheduler(self) -> None:
        """The scheduler side: the tier's LRU index, read from the directory (trimmed to the capacity)."""
        self.capacity = max(1, int(self.config.cache.kv_offloading_size * 2**30) // self.store.file_bytes)
        self.index: OrderedDict[BlockHash, None] = OrderedDict.fromkeys(self.store.scan())  # LRU first
        for block_hash in list(self.index)[:max(0, len(self.index) - self.capacity)]:
            del self.index[block_hash]
            self.store.delete(block_hash)
        self._meta = OffloadingMetadata()
        self._loading: dict[int, BlockHash] = {}  # block id → hash, of loads sent and not yet reported
        logger.info("KV offload tier: %s, %d of %d blocks (%.2f GiB) stored", self.store.directory, len(self.index),
                    self.capacity, self.config.cache.kv_offloading_size)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        """The tier's run of the prompt's blocks right after the local hit (never the last token's block)."""
        bs = self.kv_cache_spec.block_size
        first, last = num_computed_tokens // bs, (request.num_tokens - 1) // bs
        count = 0
        while first + count < last and request.block_hashes[first + count] in self.index:
            count += 1
        return count * bs, count > 0

    def update_state_after_alloc(self, request: Request, block_ids: list[int], num_external_tokens: int) -> None:
        """Queue the loads of the offered blocks (``block_ids`` start at the first one)."""
        bs = self.kv_cache_spec.block_size
        first = request.num_computed_tokens // bs
        hashes = request.block_hashes[first:first + num_external_tokens // bs]
        jobs = list(zip(block_ids, hashes, strict=False))
        for block_id, block_hash in jobs:
            self.index.move_to_end(block_hash)
            self._loading[block_id] = block_hash
        self._meta.loads[request.request_id] = jobs

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Queue the saves of the request's full computed blocks the tier lacks (freeing is not delayed: the worker
        copies them out before the next forward)."""
        num_full = min(len(block_ids), request.num_computed_tokens // self.kv_cache_spec.block_size,
                       len(request.block_hashes))
        for block_id, block_hash in zip(block_ids[:num_full], request.block_hashes[:num_full], strict=True):
            if block_hash in self.index:
                self.index.move_to_end(block_hash)
                continue
            self.index[block_hash] = None
            self._meta.writes.append((block_id, block_hash))
            while len(self.index) > self.capacity:
                evicted, _ = self.index.popitem(last=False)
                self._meta.writes.append((-1, evicted))
        return False, None

    def has_pending_work(self) -> bool:
        """Whether saves, deletes or loads wait for the next step."""
        return bool(self._meta.writes or self._meta.loads)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> OffloadingMetadata | None:
        """The jobs gathered since the last step (``None`` when there are none)."""
        if not self.has_pending_work():
            return None
        meta, self._meta = self._meta, OffloadingMetadata()
        return meta

    def requeue_connector_meta(self, metadata: KVConnectorMetadata) -> None:
        """Put an unsent step's writes and loads back in front of the jobs gathered since."""
        assert isinstance(metadata, OffloadingMetadata)
        self._meta.writes[:0] = metadata.writes
        self._meta.loads = {**metadata.loads, **self._meta.loads}

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """Forget the blocks that failed to load (their files are gone or bad). The worker runs a step's loads
        within that step, so every load sent has been reported once its step's output is here."""
        for block_id in connector_output.invalid_block_ids:
            block_hash = self._loading.get(block_id)
            if block_hash is not None and block_hash in self.index:
                del self.index[block_hash]
                self._meta.writes.append((-1, block_hash))
        self._loading.clear()

    # ---- worker side ----
    def _init_worker(self) -> None:
        """The worker side: the KV tensors (registered later), the writer thread and its queue."""
        self._io = BlockIO(self.kv_cache_spec)
        self._pending: dict[BlockHash, bytes] = {}  # the latest payload queued per hash, not yet on disk
        self._lock = threading.Lock()
        self._jobs: queue.Queue[tuple[BlockHash, bytes | None] | None] = queue.Queue()  # payload None: delete
        self._out = KVConnectorOutput()
        self._writer = threading.Thread(target=self._write_loop, name="kilat-kv-offload", daemon=True)
        self._writer.start()

    def register_kv_caches(self, kv_caches: list[torch.Tensor]) -> None:
        """Raises:
            ValueError: the tensors' bytes per block differ from ``kv_cache_spec.bytes_per_block``."""
        self._io.register(kv_caches)

    def start_load_kv(self) -> None:
        """Copy out this step's saves (before the forward can overwrite them) and queue them and the deletes in
        order, then read and check its loads; a request's loads stop at its first bad block (reported in
        ``invalid_block_ids``; the blocks after it are not loaded, and stay in the tier)."""
        meta = self._metadata
        if not isinstance(meta, OffloadingMetadata):
            return
        for block_id, block_hash in meta.writes:
            payload = None if block_id < 0 else self._io.read(block_id)
            with self._lock:
                if payload is None:
                    self._pending.pop(block_hash, None)
                else:
                    self._pending[block_hash] = payload
            self._jobs.put((block_hash, payload))
            if payload is not None:
                self._count("saved", len(payload))
        for request_id, jobs in meta.loads.items():
            for block_id, block_hash in jobs:
                try:
                    with self._lock:
                        payload = self._pending.get(block_hash)
                    payload = payload if payload is not None else self.store.read(block_hash)
                    self._io.write(block_id, payload)
                except Exception as e:  # noqa: BLE001 - corrupt, unreadable or anything: the block is recomputed
                    logger.warning("KV offload tier: %s; recomputing it", e,
                                   exc_info=not isinstance(e, CorruptBlockError))
                    self._out.invalid_block_ids.add(block_id)
                    break
                self._count("loaded", len(payload))
            self._out.finished_recving.add(request_id)

    def _count(self, verb: str, nbytes: int) -> None:
        """Add one block of ``nbytes`` to this step's ``<tier>_<verb>_{blocks,bytes}`` counters."""
        stats = self._out.stats
        for unit, amount in (("blocks", 1), ("bytes", nbytes)):
            key = f"{TIER}_{verb}_{unit}"
            stats[key] = stats.get(key, 0) + amount

    def get_finished(self, finished_req_ids: set[str]) -> KVConnectorOutput:
        """This step's loads (``finished_recving``, ``invalid_block_ids``) and transfer counters."""
        out, self._out = self._out, KVConnectorOutput()
        return out

    def _write_loop(self) -> None:
        """The background writer: saves and deletes in the order they were queued. A failure is logged and the
        block is then simply missing (a later load finds that out and recomputes it)."""
        while (job := self._jobs.get()) is not None:
            block_hash, payload = job
            try:
                if payload is None:
                    self.store.delete(block_hash)
                else:
                    self.store.write(block_hash, payload)
            except Exception as e:  # noqa: BLE001 - the thread must outlive a bad write
                logger.warning("KV offload tier: writing block %s failed: %s", block_hash.hex()[:16], e)
            finally:
                with self._lock:
                    if payload is not None and self._pending.get(block_hash) is payload:
                        del self._pending[block_hash]

    def shutdown(self) -> None:
        """Finish the queued writes, then stop the writer thread."""
        if self.role is KVConnectorRole.WORKER and self._writer.is_alive():
            self._jobs.put(None)
            self._writer.join(timeout=30)
