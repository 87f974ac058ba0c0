"""This process's place in the tensor-parallel group and its collectives (vLLM's ``parallel_state``).

A worker process serves one rank of one model, so the group is process-wide state, set once by
:func:`init_tensor_parallel` before the model is built. Without it (one rank, the ``uni`` executor) every
collective is the identity and layers hold whole weights.

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
    """One rank's view of the tensor-parallel group.

    Attributes:
        rank: this process's rank in ``[0, world_size)``.
        world_size: ranks that split every layer (``tensor_parallel_size``).
    """

    rank: int = 0
    world_size: int = 1


_GROUP = TensorParallelGroup()
_SHM: shm_all_reduce.ShmAllReduce | None = None

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


def _any_rank(failed: bool) -> bool:
    """Whether ``failed`` holds on any rank (an all-reduce: every rank calls it)."""
    flag = torch.tensor([float(failed)])
    dist.all_reduce(flag)
    return bool(flag.item())


def _init_shm(rank: int, world_size: int) -> shm_all_reduce.ShmAllReduce | None:
    """The group's shared-memory all-reduce, or ``None`` (its C++ op is off or did not build, or a rank could not
    map the buffer: every rank then falls back to gloo together). Collective: every rank calls it. Rank 0 creates
    the buffer before the others open it, and removes its name once every rank has it mapped (or none will)."""
    from kilat.model_executor.native import load_extension

    ops = load_extension("shm_all_reduce")
    if _any_rank(ops is None):
        return None
    name = [f"kilat-tp-{os.getpid()}-{time.time_ns()}" if rank == 0 else None]
    dist.broadcast_object_list(name, src=0)
    shm = _map_shm(ops, rank, world_size, name[0]) if rank == 0 else None
    if _any_rank(rank == 0 and shm is None):
        return None
    if rank:
        shm = _map_shm(ops, rank, world_size, name[0])
    failed = _any_rank(shm is None)
    if rank == 0:
        shm.unlink()
    return None if failed else shm


def init_tensor_parallel(rank: int, world_size: int, init_method: str, device: torch.device) -> None:
    """Join the ``world_size``-rank group as ``rank`` (blocks until every rank has joined).

    On the CPU it also sets up the shared-memory all-reduce (module docs).

    Args:
        rank: this process's rank.
        world_size: ``tensor_parallel_size``.
        init_method: the rendezvous, e.g. ``tcp://127.0.0.1:PORT`` (``torch.distributed.init_process_group``).
        device: the worker's device: gloo on the CPU, NCCL on CUDA (where the rank also picks its GPU).
    """
    global _GROUP, _SHM
    if world_size > 1:
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size)
        if device.type == "cpu":
            _SHM = _init_shm(rank, world_size)
        logger.info("tensor parallel: rank %d of %d joined (%s%s)", rank, world_size, backend,
                    ", shared-memory all-reduce" if _SHM is not None else "")
    _GROUP = TensorParallelGroup(rank, world_size)


def get_tp_group() -> TensorParallelGroup:
    """This process's tensor-parallel rank and size (rank 0 of 1 before :func:`init_tensor_parallel`)."""
    return _GROUP


def tensor_model_parallel_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """The sum of ``x`` over the ranks, in place (``x`` itself with one rank)."""
    if _GROUP.world_size > 1 and not (_SHM is not None and _SHM.all_reduce(x)):
        dist.all_reduce(x)
    return x


def tensor_model_parallel_all_gather(x: torch.Tensor) -> torch.Tensor:
    """The ranks' ``x [..., n]`` joined along the last dimension, in rank order: ``[..., world_size * n]``."""
    if _GROUP.world_size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(_GROUP.world_size)]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=-1)
