"""The shared-memory all-reduce of tensor-parallel ranks on one host: every rank gets the exact float32 sum in
rank order, over hundreds of calls of varying sizes (both alternating buffers reused), in float32 and bfloat16,
with more ranks than cores; tensors past its size go through gloo and give the same sums."""

from __future__ import annotations

import multiprocessing
import socket
from typing import Any

import torch

from kilat.distributed import parallel_state


def _rank(rank: int, world: int, port: int, out: Any) -> None:
    torch.set_num_threads(1)
    parallel_state.init_distributed(rank, world, 1, f"tcp://127.0.0.1:{port}", torch.device("cpu"))
    used_shm = parallel_state._SHM is not None
    sizes = torch.Generator().manual_seed(0)
    errors = 0
    for step in range(200):
        n = int(torch.randint(1, 5000, (1,), generator=sizes))
        if step == 151:
            n = parallel_state.SHM_MAX_ELEMS + 1  # past the shared buffer: gloo
        dtype = torch.bfloat16 if step % 3 == 0 else torch.float32
        parts = [torch.randn(n, generator=torch.Generator().manual_seed(1000 * step + r)).to(dtype)
                 for r in range(world)]
        want = parts[0].float()
        for part in parts[1:]:
            want = want + part.float()
        x = parts[rank].clone()
        parallel_state.tensor_model_parallel_all_reduce(x)
        tolerance = 1e-5 if n > parallel_state.SHM_MAX_ELEMS else 0  # gloo sums in its own order
        errors += not torch.allclose(x.float(), want.to(dtype).float(), rtol=tolerance, atol=tolerance)
    out.put((rank, used_shm, errors))


def test_every_rank_gets_the_sum():
    """Three ranks on two cores (waiting ranks must yield); two ranks run it in tests/test_tensor_parallel.py."""
    world = 3
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, world, port, out)) for r in range(world)]
    for p in procs:
        p.start()
    results = sorted(out.get(timeout=120) for _ in range(world))
    for p in procs:
        p.join(30)
    assert results == [(r, True, 0) for r in range(world)]
