"""Disaggregated prefill/decode over TCP: ``--kv-transfer-config '{"kv_connector": "TcpConnector", "kv_role":
..., "kv_ip": ..., "kv_port": ...}'`` (:class:`~kilat.config.KVTransferConfig`).

The flow (a proxy such as ``kilat proxy`` drives it, passing ``kv_transfer_params`` as vLLM's proxies do):

1. The proxy sends the request to the **producer** (prefill instance) with ``max_tokens`` 1 and
   ``kv_transfer_params`` ``{"do_remote_decode": true}``. When it finishes, the producer keeps the blocks of its
   prompt (:meth:`TcpConnector.request_finished` delays their freeing) and returns ``kv_transfer_params``
   ``{"do_remote_prefill": true, "remote_engine_id", "remote_host", "remote_port", "remote_request_id"}``.
2. The proxy sends the original request, with those ``kv_transfer_params``, to the **consumer** (decode
   instance). Its scheduler finds the prompt's local prefix-cache hit first; the full blocks after it (never
   the one holding the last prompt token, whose logits the consumer computes) are allocated, the request waits
   (``WAITING_FOR_REMOTE_KVS``), and a worker thread pulls them (:mod:`kilat.kv_connector.tcp_wire`) while the
   engine keeps decoding other requests. The pulled blocks join the consumer's prefix cache and the request is
   scheduled from there, computing at most one block of the prompt itself. A full local hit pulls nothing but
   still tells the producer it may free the blocks.
3. The producer frees the blocks once it has sent them (or the pull failed), or after
   ``abort_request_timeout`` seconds without a pull.

Failure rules: whatever goes wrong with a pull — the producer is gone or refuses (unknown or expired request,
different model or KV layout, different prompt: the content hashes differ), a timeout
(``transfer_timeout`` per read or write), a truncated transfer, a block whose CRC-32 does not match — the
consumer keeps the blocks that arrived intact before it and computes the rest of the prompt itself; no request
ever decodes from a bad block, and the answer is the same. A consumer request aborted while pulling keeps its
blocks until the pull ends, then frees them; the producer frees its side when the connection closes.

Blocks are read and written by :class:`~kilat.kv_connector.block_io.BlockIO` from the server and pull threads,
while the engine steps: the blocks a transfer touches belong to no running request (held after their request
finished on the producer, allocated outside the prefix cache on the consumer).
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from kilat.core.block_hash import BlockHash, block_hashes
from kilat.core.request import RequestStatus
from kilat.kv_connector.base import (
    KVCacheSpec,
    KVConnectorBase,
    KVConnectorMetadata,
    KVConnectorOutput,
    KVConnectorRole,
)
from kilat.kv_connector.block_io import BlockIO, kv_namespace
from kilat.kv_connector.tcp_wire import (
    CRC_BYTES,
    PROTOCOL_VERSION,
    TransferError,
    block_record,
    check_block_record,
    recv_exactly,
    recv_frame,
    send_frame,
)

if TYPE_CHECKING:
    from kilat.config import EngineConfig
    from kilat.core.request import Request
    from kilat.core.scheduler_output import SchedulerOutput

logger = logging.getLogger("kilat")

TIER = "tcp"
"""The transfers' name in the ``kilat:kv_offload_*`` metrics (``tier="tcp"``)."""

REGISTER_WAIT_S = 5.0
"""Seconds a producer waits for a pulled request's blocks to be handed to it (they are, one engine step after
the request finished, which the consumer can beat)."""

MAX_CONNECTIONS = 64
"""Pulls a producer serves at once; more are refused (and their consumers compute the prompt)."""

MAX_ENDED = 4096
"""Requests a producer remembers having let go of (a pull of one is refused at once, not after
:data:`REGISTER_WAIT_S`)."""

MAX_PULLS = 4
"""Pulls a consumer runs at once; more wait for a free thread."""


@dataclass
class PullJob:
    """One pull by a consumer (plain data).

    Attributes:
        request_id: the consumer's request.
        host, port: the producer's address.
        remote_engine_id, remote_request_id: the producer's engine and request.
        first_block: the index in the prompt of the first block wanted.
        block_ids: the consumer's blocks to fill, in token order (empty: only tell the producer to free).
        hashes: their content hashes.
    """

    request_id: str
    host: str
    port: int
    remote_engine_id: str
    remote_request_id: str
    first_block: int
    block_ids: list[int]
    hashes: list[BlockHash]


@dataclass
class TcpConnectorMetadata(KVConnectorMetadata):
    """One step's jobs.

    Attributes:
        sends: producer: request id → (its prompt's full blocks, their hashes) to keep for a pull.
        pulls: consumer: the pulls to start (those of no block only free the producer's copy).
        cancels: consumer: requests (aborted) whose pull to stop.
    """

    sends: dict[str, tuple[list[int], list[BlockHash]]] = field(default_factory=dict)
    pulls: list[PullJob] = field(default_factory=list)
    cancels: list[str] = field(default_factory=list)


@dataclass
class _Held:
    """A producer's request whose blocks wait for their pull."""

    block_ids: list[int]
    hashes: list[BlockHash]
    deadline: float
    claimed: bool = False


class TcpConnector(KVConnectorBase):
    """Moves a prompt's KV from a prefill instance to a decode instance over TCP (module docs).

    Raises:
        OSError: a producer cannot listen on ``kv_ip:kv_port`` (the port is taken, say).
    """

    def __init__(self, config: EngineConfig, role: KVConnectorRole, kv_cache_spec: KVCacheSpec):
        super().__init__(config, role, kv_cache_spec)
        assert config.kv_transfer is not None
        self.transfer = config.kv_transfer
        self.namespace = kv_namespace(config, kv_cache_spec, portable=True)
        if role is KVConnectorRole.SCHEDULER:
            self._meta = TcpConnectorMetadata()
            self._in_flight: set[str] = set()  # pulls and sends whose end the worker has not reported
            self._pulled: set[str] = set()  # consumer requests whose one pull (or release) was sent
        else:
            self._init_worker()

    # ---- scheduler side ----
    def _pull_job(self, request: Request, first: int, block_ids: list[int]) -> PullJob:
        params = request.kv_transfer_params or {}
        self._pulled.add(request.request_id)
        return PullJob(request.request_id, params["remote_host"], params["remote_port"], params["remote_engine_id"],
                       params["remote_request_id"], first, block_ids,
                       list(request.block_hashes[first:first + len(block_ids)]))

    def _wants_pull(self, request: Request) -> bool:
        params = request.kv_transfer_params
        return (self.transfer.is_consumer and params is not None and bool(params.get("do_remote_prefill"))
                and request.index == 0 and request.request_id not in self._pulled)  # n > 1: siblings reuse its KV

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        """A consumer request with a producer to pull from: the prompt's full blocks after the local hit, except
        the one holding the last prompt token (asynchronous). With none left, the producer is told to free its
        copy. Each request pulls once (a preempted one computes its prompt again)."""
        if not self._wants_pull(request):
            return 0, False
        bs = self.kv_cache_spec.block_size
        first, last = num_computed_tokens // bs, (request.num_prompt_tokens - 1) // bs
        if last <= first:
            self._meta.pulls.append(self._pull_job(request, first, []))
            return 0, False
        return (last - first) * bs, True

    def update_state_after_alloc(self, request: Request, block_ids: list[int], num_external_tokens: int) -> None:
        """Queue the pull into the allocated blocks."""
        first = request.num_computed_tokens // self.kv_cache_spec.block_size
        self._meta.pulls.append(self._pull_job(request, first,
                                               block_ids[:num_external_tokens // self.kv_cache_spec.block_size]))
        self._in_flight.add(request.request_id)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """A producer request asked for remote decode that reached its ``max_tokens`` keeps its prompt's full
        blocks and returns where to pull them (one ended otherwise, by EOS, a stop string or an abort, keeps
        nothing: its client may never see the params); a consumer request aborted while pulling stops the pull,
        and one that ended before its pull frees the producer's copy."""
        if not request.is_finished:  # preempted
            return False, None
        rid = request.request_id
        if rid in self._in_flight:  # aborted while pulling: stop it (the blocks are freed when it is reported)
            self._meta.cancels.append(rid)
        elif self._wants_pull(request):
            self._meta.pulls.append(self._pull_job(request, 0, []))
        self._pulled.discard(rid)
        params = request.kv_transfer_params
        bs = self.kv_cache_spec.block_size
        num_full = min(len(block_ids), request.num_prompt_tokens // bs, request.num_computed_tokens // bs)
        if (not self.transfer.is_producer or params is None or not params.get("do_remote_decode")
                or request.status != RequestStatus.FINISHED_LENGTH or num_full == 0):
            return False, None  # as vLLM: only a request that ran to its max_tokens (the proxy's 1) is handed on
        hashes = block_hashes(request.prompt_token_ids[:num_full * bs], bs, request.cache_salt)
        self._meta.sends[rid] = (block_ids[:num_full], hashes)
        self._in_flight.add(rid)
        return True, {"do_remote_prefill": True, "do_remote_decode": False,
                      "remote_engine_id": self.transfer.engine_id, "remote_host": self.transfer.kv_ip,
                      "remote_port": self.transfer.kv_port, "remote_request_id": rid}

    def has_pending_work(self) -> bool:
        """Whether sends to register, pulls to start or stop wait for the next step."""
        return bool(self._meta.sends or self._meta.pulls or self._meta.cancels)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> TcpConnectorMetadata | None:
        """The new jobs; also (empty) while transfers are in flight, so the step polls the worker."""
        if not self.has_pending_work() and not self._in_flight:
            return None
        meta, self._meta = self._meta, TcpConnectorMetadata()
        return meta

    def requeue_connector_meta(self, metadata: KVConnectorMetadata) -> None:
        """Put an unsent step's sends, pulls and cancels back in front of the jobs gathered since."""
        assert isinstance(metadata, TcpConnectorMetadata)
        self._meta.sends = {**metadata.sends, **self._meta.sends}
        self._meta.pulls[:0] = metadata.pulls
        self._meta.cancels[:0] = metadata.cancels

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """Forget the transfers that ended."""
        self._in_flight -= connector_output.finished_recving | connector_output.finished_sending

    # ---- worker side ----
    def _init_worker(self) -> None:
        """The worker side: the KV tensors (registered later), the pull threads and, on a producer, the server.

        Raises:
            OSError: the producer cannot listen on ``kv_ip:kv_port``.
        """
        self._io = BlockIO(self.kv_cache_spec)
        self._lock = threading.Condition()
        self._held: dict[str, _Held] = {}
        self._ended: OrderedDict[str, None] = OrderedDict()  # the latest requests whose blocks were let go
        self._out = KVConnectorOutput()
        self._pool = ThreadPoolExecutor(max_workers=MAX_PULLS, thread_name_prefix="kilat-kv-pull")
        self._pulling: dict[str, socket.socket | None] = {}  # request id → its pull's connection (None: not yet)
        self._cancelled: set[str] = set()  # pulls to stop
        self._closed = False
        self._server: socket.socket | None = None
        if self.transfer.is_producer:
            try:
                self._server = socket.create_server((self.transfer.kv_ip, self.transfer.kv_port), backlog=64)
            except OSError as e:
                raise OSError(e.errno, f"kv_transfer_config: cannot listen on {self.transfer.kv_ip}:"
                                       f"{self.transfer.kv_port} ({e.strerror}); give another kv_port") from e
            self._connections = threading.BoundedSemaphore(MAX_CONNECTIONS)
            threading.Thread(target=self._serve, name="kilat-kv-server", daemon=True).start()
            logger.info("KV transfer: %s serving blocks on %s:%d (engine %s)", self.transfer.kv_role,
                        self.transfer.kv_ip, self.transfer.kv_port, self.transfer.engine_id)

    def register_kv_caches(self, kv_caches: list[torch.Tensor]) -> None:
        """Raises:
            ValueError: the tensors' bytes per block differ from ``kv_cache_spec.bytes_per_block``."""
        self._io.register(kv_caches)

    def start_load_kv(self) -> None:
        """Hand this step's kept blocks to the server, free those whose pull timed out, start the pulls."""
        meta = self._metadata
        if not isinstance(meta, TcpConnectorMetadata):
            return
        now = time.monotonic()
        timeout = self.transfer.extra("abort_request_timeout")
        with self._lock:
            for rid, (block_ids, hashes) in meta.sends.items():
                self._held[rid] = _Held(block_ids, hashes, now + timeout)
            if meta.sends:
                self._lock.notify_all()
            for rid in [rid for rid, held in self._held.items() if held.deadline < now and not held.claimed]:
                logger.warning("KV transfer: request %s was not pulled within abort_request_timeout (%g s); "
                               "freeing its blocks", rid, timeout)
                self._let_go(rid)
        for job in meta.pulls:
            if job.block_ids:
                with self._lock:
                    self._pulling[job.request_id] = None
            self._pool.submit(self._pull, job)
        with self._lock:
            for rid in meta.cancels:
                if rid in self._pulling:
                    self._cancelled.add(rid)
                    if (conn := self._pulling[rid]) is not None:
                        with contextlib.suppress(OSError):
                            conn.shutdown(socket.SHUT_RDWR)  # wakes the pull thread's recv

    def get_finished(self, finished_req_ids: set[str]) -> KVConnectorOutput:
        """The transfers that ended since the last call, and their counters."""
        with self._lock:
            out, self._out = self._out, KVConnectorOutput()
        return out

    def _count(self, verb: str, blocks: int, nbytes: int) -> None:
        """Add to the ``tcp_<verb>_{blocks,bytes}`` counters (call with the lock held)."""
        stats = self._out.stats
        for unit, amount in (("blocks", blocks), ("bytes", nbytes)):
            key = f"{TIER}_{verb}_{unit}"
            stats[key] = stats.get(key, 0) + amount

    def _let_go(self, rid: str) -> None:
        """The producer is done with a kept request: report it so its blocks are freed, and remember it for a
        while (a late pull of it is refused at once). Call with the lock held."""
        if self._held.pop(rid, None) is not None:
            self._out.finished_sending.add(rid)
            self._ended[rid] = None
            while len(self._ended) > MAX_ENDED:
                self._ended.popitem(last=False)
            self._lock.notify_all()

    def _serve(self) -> None:
        """The producer's accept loop: one thread per pull, at most :data:`MAX_CONNECTIONS` at once."""
        assert self._server is not None
        while not self._closed:
            try:
                conn, _ = self._server.accept()
            except OSError as e:
                if not self._closed:  # e.g. out of file descriptors: try again shortly
                    logger.warning("KV transfer: accepting a pull failed: %s", e)
                    time.sleep(0.1)
                continue
            if not self._connections.acquire(blocking=False):
                conn.close()
                continue
            threading.Thread(target=self._send, args=(conn,), name="kilat-kv-send", daemon=True).start()

    def _claim(self, header: dict[str, Any]) -> tuple[str, _Held]:
        """The held request a pull names, marked as being sent.

        Raises:
            TransferError: a different protocol version, model or KV layout, or engine; an unknown, expired or
                already pulled request.
        """
        if header.get("version") != PROTOCOL_VERSION:
            raise TransferError(f"protocol version {header.get('version')!r}, this producer speaks {PROTOCOL_VERSION}")
        if header.get("namespace") != self.namespace:
            raise TransferError("the consumer's model or KV cache layout differs from this producer's")
        if header.get("engine_id") != self.transfer.engine_id:
            raise TransferError(f"this producer is engine {self.transfer.engine_id}, not {header.get('engine_id')!r}")
        rid = header.get("request_id")
        with self._lock:
            self._lock.wait_for(lambda: rid in self._held or rid in self._ended, timeout=REGISTER_WAIT_S)
            held = self._held.get(rid)
            if held is None or held.claimed:
                raise TransferError(f"request {rid!r} is unknown here (expired, already pulled, or never kept)")
            held.claimed = True
        return rid, held

    def _send(self, conn: socket.socket) -> None:
        """Serve one pull (tcp_wire's protocol); then the request's blocks may be freed, whatever happened."""
        rid = None
        named: object = None
        answered = False
        try:
            timeout = self.transfer.extra("transfer_timeout")
            conn.settimeout(timeout)
            header = recv_frame(conn, deadline=time.monotonic() + timeout)
            named = header.get("request_id")
            rid, held = self._claim(header)
            first, wanted = header.get("first_block"), header.get("hashes")
            if not isinstance(first, int) or not isinstance(wanted, list) or first < 0 \
                    or held.hashes[first:first + len(wanted)] != [bytes.fromhex(h) for h in wanted]:
                raise TransferError("the blocks asked for are not this request's (its prompt or cache_salt differs)")
            block_ids = held.block_ids[first:first + len(wanted)]
            send_frame(conn, {"ok": True, "num_blocks": len(block_ids),
                              "bytes_per_block": self.kv_cache_spec.bytes_per_block})
            answered = True
            for block_id in block_ids:
                conn.sendall(block_record(self._io.read(block_id)))
            with self._lock:
                self._count("sent", len(block_ids), len(block_ids) * self.kv_cache_spec.bytes_per_block)
        except (OSError, TransferError, ValueError, TypeError) as e:
            logger.warning("KV transfer: a pull of request %r failed: %s", named, e)
            if not answered:
                with contextlib.suppress(OSError):
                    send_frame(conn, {"ok": False, "error": str(e)})
        finally:
            conn.close()
            self._connections.release()
            if rid is not None:
                with self._lock:
                    self._let_go(rid)

    def _pull(self, job: PullJob) -> None:
        """Run one pull on a pool thread; the blocks that did not arrive intact are reported invalid."""
        size = self.kv_cache_spec.bytes_per_block
        loaded = 0
        try:
            timeout = self.transfer.extra("transfer_timeout")
            with socket.create_connection((job.host, job.port), timeout=timeout) as conn:
                conn.settimeout(timeout)
                with self._lock:
                    cancelled = job.request_id in self._cancelled
                # sent before a cancel can shut the connection: the producer always hears of the pull, and frees
                # its copy when the connection closes instead of after abort_request_timeout
                send_frame(conn, {"version": PROTOCOL_VERSION, "namespace": self.namespace,
                                  "engine_id": job.remote_engine_id, "request_id": job.remote_request_id,
                                  "first_block": job.first_block,
                                  "hashes": [] if cancelled else [h.hex() for h in job.hashes]})
                if cancelled:  # aborted before it started: only tell the producer to free its copy
                    recv_frame(conn)
                    raise TransferError("the request was aborted")
                with self._lock:
                    if job.request_id in self._cancelled:  # aborted while the request went out
                        raise TransferError("the request was aborted")
                    if job.block_ids:
                        self._pulling[job.request_id] = conn
                reply = recv_frame(conn)
                if reply.get("ok") is not True:
                    raise TransferError(f"the producer refused: {reply.get('error')}")
                if reply.get("num_blocks") != len(job.block_ids) or reply.get("bytes_per_block") != size:
                    raise TransferError(f"the producer offers {reply.get('num_blocks')} blocks of "
                                        f"{reply.get('bytes_per_block')} bytes, not {len(job.block_ids)} of {size}")
                for i, block_id in enumerate(job.block_ids):
                    self._io.write(block_id, check_block_record(recv_exactly(conn, size + CRC_BYTES), i))
                    loaded += 1
        except (OSError, TransferError) as e:
            if job.request_id in self._cancelled:
                logger.info("KV transfer: stopped the pull of request %s (aborted)", job.request_id)
            elif job.block_ids:
                logger.warning("KV transfer: pulling request %s's KV from %s:%d failed after %d of %d blocks (%s); "
                               "computing the rest", job.request_id, job.host, job.port, loaded,
                               len(job.block_ids), e)
        except Exception:  # noqa: BLE001 - a pool thread's error would vanish; report the pull as failed
            logger.exception("KV transfer: pulling request %s's KV failed", job.request_id)
        finally:
            if job.block_ids:
                with self._lock:
                    self._pulling.pop(job.request_id, None)
                    self._cancelled.discard(job.request_id)
                    self._out.finished_recving.add(job.request_id)
                    self._out.invalid_block_ids.update(job.block_ids[loaded:])
                    self._count("received", loaded, loaded * size)

    def shutdown(self) -> None:
        """Stop serving and pulling (blocks still held are simply dropped with the engine)."""
        if self.role is KVConnectorRole.WORKER and not self._closed:
            self._closed = True
            if self._server is not None:
                with contextlib.suppress(OSError):
                    self._server.shutdown(socket.SHUT_RDWR)  # wakes the accept() of the server thread
                self._server.close()
            self._pool.shutdown(wait=False, cancel_futures=True)
            with self._lock:
                self._cancelled.update(self._pulling)
                for conn in self._pulling.values():
                    if conn is not None:
                        with contextlib.suppress(OSError):
                            conn.shutdown(socket.SHUT_RDWR)
