"""This process's place among the ranks of one model, its collectives and its pipeline sends (vLLM's
``parallel_state``).

A worker process serves one rank of one model, so its tensor-parallel group and pipeline stage are process-wide
state, set once by :func:`init_distributed` before the model is built. Without it (one rank, the ``uni``
executor) every collective is the identity and layers hold whole weights.

Collectives go through ``torch.distributed`` (gloo on the CPU, NCCL on CUDA), except that on the CPU the
all-reduce of up to :data:`SHM_MAX_ELEMS` elements goes through shared memory
(:class:`~kilat.distributed.shm_all_reduce.ShmAllReduce`, a C++ op): gloo's latency made tensor parallelism 7x
slower than one rank. ``KILAT_SHM_ALL_REDUCE=torch`` (or the op failing to build) leaves gloo alone.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from kilat.distributed import shm_all_reduce

logger = logging.getLogger("kilat")


@dataclass(frozen=True)
class TensorParallelGroup:
    """One rank's view of its tensor-parallel group (the ranks of its pipeline stage).

    Attributes:
        rank: this process's rank in the group, in ``[0, world_size)``.
        world_size: ranks that split every layer (``tensor_parallel_size``).
        group: the ``torch.distributed`` process group of those ranks (``None`` with one rank).
    """

    rank: int = 0
    world_size: int = 1
    group: Any = None


@dataclass(frozen=True)
class PipelineParallelGroup:
    """One rank's place in the pipeline (Huang et al., 2019, "GPipe": contiguous layer ranges per stage).

    Attributes:
        rank: this process's stage, in ``[0, world_size)``.
        world_size: stages (``pipeline_parallel_size``).
        prev_rank, next_rank: global ranks of the same tensor-parallel rank in the previous and next stage (the
            peers it receives hidden states from and sends them to), or ``None`` at the ends.
    """

    rank: int = 0
    world_size: int = 1
    prev_rank: int | None = None
    next_rank: int | None = None

    @property
    def is_first(self) -> bool:
        """Whether this stage embeds the tokens."""
        return self.rank == 0

    @property
    def is_last(self) -> bool:
        """Whether this stage computes the logits and samples."""
        return self.rank == self.world_size - 1


_TP = TensorParallelGroup()
_PP = PipelineParallelGroup()
_SHM: shm_all_reduce.ShmAllReduce | None = None
_SENDS: list[tuple[Any, torch.Tensor]] = []  # this rank's unfinished sends to the next stage, with their buffers

SHM_MAX_ELEMS = 1 << 20
"""Most elements one shared-memory all-reduce takes (4 MiB per rank and buffer; ``[1820, 576]`` hidden states);
larger tensors go through gloo."""


def _map_shm(ops: Any, rank: int, world_size: int, name: str) -> shm_all_reduce.ShmAllReduce | None:
    """This rank's mapping of the group's shared buffer, or ``None`` (logged) when it cannot be made."""
    try:
        return shm_all_reduce.ShmAllReduce(ops, rank, world_size, name, SHM_MAX_ELEMS)
    except OSError as e:
        logger.warning("tensor parallel: rank %d cannot map the shared-memory all-reduce (%s); gloo only", rank, e)
        return None


def _any_rank(failed: bool, group: Any) -> bool:
    """Whether ``failed`` holds on any rank of ``group`` (an all-reduce: every rank of it calls it)."""
    flag = torch.tensor([float(failed)])
    dist.all_reduce(flag, group=group)
    return bool(flag.item())


def _init_shm(tp: TensorParallelGroup, leader: int) -> shm_all_reduce.ShmAllReduce | None:
    """The group's shared-memory all-reduce, or ``None`` (its C++ op is off or did not build, or a rank could not
    map the buffer: every rank of the group then falls back to gloo together). Collective: every rank of the group
    calls it. Its rank 0 (global rank ``leader``) creates the buffer before the others open it, and removes its
    name once every rank has it mapped (or none will)."""
    from kilat.model_executor.native import load_extension

    rank, group = tp.rank, tp.group
    ops = load_extension("shm_all_reduce")
    if _any_rank(ops is None, group):
        return None
    name = [f"kilat-tp-{os.getpid()}-{time.time_ns()}" if rank == 0 else None]
    dist.broadcast_object_list(name, src=leader, group=group)
    shm = _map_shm(ops, rank, tp.world_size, name[0]) if rank == 0 else None
    if _any_rank(rank == 0 and shm is None, group):
        return None
    if rank:
        shm = _map_shm(ops, rank, tp.world_size, name[0])
    failed = _any_rank(shm is None, group)
    if rank == 0:
        shm.unlink()
    return None if failed else shm


def init_distributed(rank: int, tensor_parallel_size: int, pipeline_parallel_size: int, init_method: str,
                     device: torch.device) -> None:
    """Join the ``tensor_parallel_size * pipeline_parallel_size``-rank world as ``rank`` (blocks until every rank
    has joined) and form the tensor-parallel groups, one per stage (ranks numbered stage-major, as
    :class:`~kilat.config.ParallelConfig` says).

    On the CPU each tensor-parallel group also sets up its shared-memory all-reduce (module docs).

    Args:
        rank: this process's global rank.
        tensor_parallel_size, pipeline_parallel_size: the split.
        init_method: the rendezvous, e.g. ``tcp://127.0.0.1:PORT`` (``torch.distributed.init_process_group``).
        device: the worker's device: gloo on the CPU, NCCL on CUDA (where the rank also picks its GPU).
    """
    global _TP, _PP, _SHM
    tp, pp = tensor_parallel_size, pipeline_parallel_size
    stage, tp_rank = divmod(rank, tp)
    if tp * pp > 1:
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=tp * pp)
        group = None
        if tp > 1:  # every rank takes part in forming every stage's group
            for s in range(pp):
                ranks = list(range(s * tp, (s + 1) * tp))
                made = dist.new_group(ranks) if pp > 1 else dist.group.WORLD
                group = made if s == stage else group
        _TP = TensorParallelGroup(tp_rank, tp, group)
        if device.type == "cpu" and tp > 1:
            _SHM = _init_shm(_TP, stage * tp)
        logger.info("distributed: rank %d of %d joined (%s): stage %d of %d, tensor-parallel rank %d of %d%s", rank,
                    tp * pp, backend, stage, pp, tp_rank, tp, ", shared-memory all-reduce" if _SHM is not None else "")
    _PP = PipelineParallelGroup(stage, pp, rank - tp if stage > 0 else None, rank + tp if stage < pp - 1 else None)


def get_tp_group() -> TensorParallelGroup:
    """This process's tensor-parallel rank and size (rank 0 of 1 before :func:`init_distributed`)."""
    return _TP


def get_pp_group() -> PipelineParallelGroup:
    """This process's pipeline stage (stage 0 of 1 before :func:`init_distributed`)."""
    return _PP


def tensor_model_parallel_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """The sum of ``x`` over the tensor-parallel ranks, in place (``x`` itself with one rank)."""
    if _TP.world_size > 1 and not (_SHM is not None and _SHM.all_reduce(x)):
        dist.all_reduce(x, group=_TP.group)
    return x


def tensor_model_parallel_all_gather(x: torch.Tensor) -> torch.Tensor:
    """The tensor-parallel ranks' ``x [..., n]`` joined along the last dimension, in rank order:
    ``[..., world_size * n]``."""
    if _TP.world_size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(_TP.world_size)]
    dist.all_gather(parts, x.contiguous(), group=_TP.group)
    return torch.cat(parts, dim=-1)


def send_to_next_stage(x: torch.Tensor) -> None:
    """Send ``x`` to the next stage's peer without waiting for it to arrive (the buffer is kept until it has;
    the previous send is waited for first, so at most one step's hidden states are in transit per rank).

    Raises:
        RuntimeError: this is the last stage.
    """
    if _PP.next_rank is None:
        raise RuntimeError("the last pipeline stage has no next stage")
    while _SENDS:
        _SENDS.pop()[0].wait()
    x = x.contiguous()
    _SENDS.append((dist.isend(x, dst=_PP.next_rank), x))


def recv_from_prev_stage(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Receive the previous stage's ``shape`` tensor of ``dtype`` (blocks until it arrives).

    Raises:
        RuntimeError: this is the first stage.
    """
    if _PP.prev_rank is None:
        raise RuntimeError("the first pipeline stage has no previous stage")
    x = torch.empty(shape, dtype=dtype, device=device)
    dist.recv(x, src=_PP.prev_rank)
    return x
