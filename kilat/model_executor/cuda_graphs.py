"""CUDA graphs for decode steps: capture once per batch size, then replay with the step's inputs copied in.

A decode step (every request has one new token) launches the same kernels every time; on a host that
launches kernels slowly, replaying one captured graph replaces hundreds of launches. Graphs are captured for
batch sizes 1, 2, 4, then every multiple of 8 up to ``max_num_seqs`` (and ``max_num_seqs`` itself); a step
is padded to the next captured size with rows that have ``seq_len`` 0 and slot -1, which the attention
kernels skip. All captured graphs share one memory pool and read the same static input buffers
(Nvidia's CUDA graphs through ``torch.cuda.graph``).
"""

from __future__ import annotations

import bisect
import logging
import time

import torch
from torch import nn

from kilat.model_executor.attention.backends import AttentionBackend
from kilat.model_executor.attention.metadata import AttentionMetadata
from kilat.model_executor.forward_context import ForwardContext, set_forward_context

logger = logging.getLogger("kilat")


def capture_sizes(max_num_seqs: int) -> list[int]:
    """Batch sizes to capture: 1, 2, 4, then multiples of 8 up to ``max_num_seqs``, and ``max_num_seqs``.

    Raises:
        ValueError: if ``max_num_seqs < 1``.
    """
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
    sizes = {s for s in (1, 2, 4) if s <= max_num_seqs} | set(range(8, max_num_seqs + 1, 8)) | {max_num_seqs}
    return sorted(sizes)


class CUDAGraphRunner:
    """Decode forwards captured per batch size.

    Args:
        model: the loaded model (``forward(input_ids, positions) -> hidden``).
        kv_caches: the engine's KV cache tensors (captured by address: never reallocate them).
        backend: a graphable attention backend.
        fused_kernels: whether the captured steps use the fused Triton kernels.
        block_size: token slots per KV block.
        max_model_len: longest context in tokens; sizes the block table and fixes the decode kernel's grid.
        max_num_seqs: largest batch to capture.
        device: a CUDA device.
        kv_scales: the scales of an int8/fp8 KV cache (captured by address too), or ``None``.

    Attributes:
        sizes: the captured batch sizes, ascending.
        num_replays: decode steps run through a graph so far.

    Raises:
        ValueError: if ``backend`` cannot be captured.
    """

    def __init__(self, model: nn.Module, kv_caches: list[torch.Tensor], backend: AttentionBackend,
                 fused_kernels: bool, block_size: int, max_model_len: int, max_num_seqs: int,
                 device: torch.device, kv_scales: list[torch.Tensor] | None = None) -> None:
        if not backend.graphable:
            raise ValueError(f"the {backend.name!r} attention backend cannot be captured in CUDA graphs")
        self.sizes = capture_sizes(max_num_seqs)
        self.block_size = block_size
        largest = self.sizes[-1]
        max_blocks = -(-max_model_len // block_size)
        self.input_ids = torch.zeros(largest, dtype=torch.long, device=device)
        self.positions = torch.zeros(largest, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((largest,), -1, dtype=torch.long, device=device)
        self.seq_lens = torch.zeros(largest, dtype=torch.int32, device=device)
        self.block_table = torch.zeros(largest, max_blocks, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(largest + 1, dtype=torch.int32, device=device)
        self.num_replays = 0
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        started = time.perf_counter()
        pool = None
        with torch.inference_mode():
            for size in reversed(self.sizes):
                meta = AttentionMetadata(self.query_start_loc[:size + 1], self.seq_lens[:size], self.block_table[:size],
                                         self.slot_mapping[:size], max_query_len=1, max_seq_len=max_model_len,
                                         block_size=block_size, num_decode_tokens=size)
                with set_forward_context(ForwardContext(meta, kv_caches, backend, fused_kernels, kv_scales)):
                    model(self.input_ids[:size], self.positions[:size])
                    torch.cuda.synchronize(device)
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool=pool):
                        self.outputs[size] = model(self.input_ids[:size], self.positions[:size])
                pool = graph.pool()
                self.graphs[size] = graph
        torch.cuda.synchronize(device)
        logger.info("captured CUDA graphs for %d decode batch sizes (1..%d) in %.1f s", len(self.sizes), largest,
                    time.perf_counter() - started)

    @property
    def max_batch_size(self) -> int:
        """The largest captured batch."""
        return self.sizes[-1]

    def run(self, input_ids: list[int], positions: list[int], seq_lens: list[int],
            block_tables: list[list[int]]) -> torch.Tensor:
        """Replay the graph of the smallest captured size >= ``len(input_ids)`` on one decode per request.

        Args:
            input_ids, positions: the new token and its position, one per request.
            seq_lens: context + 1 per request.
            block_tables: each request's KV block ids (enough for its ``seq_len``).

        Returns:
            Hidden states ``[num_reqs, hidden_size]`` (a view of the graph's output: read before the next run).
        """
        num_reqs = len(input_ids)
        size = self.sizes[bisect.bisect_left(self.sizes, num_reqs)]
        bs = self.block_size
        slots = [table[p // bs] * bs + p % bs for table, p in zip(block_tables, positions, strict=True)]
        pad = size - num_reqs
        rows = torch.tensor([input_ids + [0] * pad, positions + [0] * pad, slots + [-1] * pad,
                             seq_lens + [0] * pad], dtype=torch.long)
        self.input_ids[:size].copy_(rows[0])
        self.positions[:size].copy_(rows[1])
        self.slot_mapping[:size].copy_(rows[2])
        self.seq_lens[:size].copy_(rows[3])
        width = max(len(t) for t in block_tables)
        table = torch.tensor([t + [0] * (width - len(t)) for t in block_tables], dtype=torch.int32)
        self.block_table[:num_reqs, :width].copy_(table)
        self.graphs[size].replay()
        self.num_replays += 1
        return self.outputs[size][:num_reqs]
