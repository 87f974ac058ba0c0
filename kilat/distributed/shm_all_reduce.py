"""A sum all-reduce through shared memory for tensor-parallel ranks on one host (the CPU fast path).

gloo takes 0.3-3 ms for the few kilobytes a decode step reduces (docs/benchmarks.md, "Executors and tensor
parallelism"): its I/O thread and sockets dominate. Here every rank copies its tensor into its own slot of a
shared buffer, publishes a sequence number in a flag, waits until every rank's flag shows that number, and sums
the slots in rank order, so that every rank gets bit-identical results; all of it is one C++ op
(``kilat/csrc/shm_all_reduce.cpp``: release/acquire atomics on the flags, two buffers alternating by the
sequence number's parity). Values are summed in float32 whatever the tensor's dtype.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import torch


class ShmAllReduce:
    """Sum all-reduce of CPU tensors of up to ``max_elems`` elements among ``world_size`` ranks of one host.

    Args:
        ops: ``torch.ops.kilat_shm_<isa>`` (:func:`kilat.model_executor.native.load_extension`).
        rank, world_size: this process's rank and the ranks.
        name: the shared-memory file's name under ``/dev/shm``, the same on every rank; rank 0 creates it
            with its pages reserved (zero-filled), so the others must open it after rank 0's constructor returned
            (e.g. after a barrier).
        max_elems: most elements one call reduces (larger tensors go elsewhere: :meth:`all_reduce` returns
            ``False``).

    Raises:
        OSError: the file cannot be created, reserved or opened (``/dev/shm`` full or missing; rank 0 then
            leaves no file behind).
    """

    def __init__(self, ops: Any, rank: int, world_size: int, name: str, max_elems: int):
        self._ops, self.rank, self.max_elems = ops, rank, max_elems
        self.path = os.path.join("/dev/shm", name)
        flag_bytes = 2 * world_size * 8
        size = flag_bytes + 2 * world_size * max_elems * 4
        if rank == 0:  # reserve the pages now: a sparse file on a full tmpfs would SIGBUS at the first write
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                os.posix_fallocate(fd, 0, size)
            except OSError:
                os.unlink(self.path)
                raise
            finally:
                os.close(fd)
        mapped = np.memmap(self.path, dtype=np.uint8, mode="r+", shape=(size,))
        self._flags = torch.from_numpy(mapped[:flag_bytes].view(np.int64)).view(2, world_size)
        self._slots = torch.from_numpy(mapped[flag_bytes:].view(np.float32)).view(2, world_size, max_elems)
        self._seq = 0

    def unlink(self) -> None:
        """Remove the file's name (rank 0, once every rank has opened it); the mappings stay valid."""
        os.unlink(self.path)

    def all_reduce(self, x: torch.Tensor) -> bool:
        """Replace ``x`` with the sum over the ranks (every rank calls it with the same shape); ``False`` (``x``
        untouched) when it is larger than ``max_elems`` or not a contiguous CPU tensor."""
        if x.numel() > self.max_elems or x.device.type != "cpu" or not x.is_contiguous():
            return False
        self._seq += 1
        self._ops.all_reduce(x, self._slots, self._flags, self.rank, self._seq)
        return True
