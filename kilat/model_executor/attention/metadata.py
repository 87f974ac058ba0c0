"""Per-step attention metadata common to every backend, built once per step and shared by every layer.

Each backend turns it into its own step metadata (:meth:`~kilat.model_executor.attention.backends.AttentionBackend.
build_metadata`): the plans of the torch and CPU backends (:mod:`.plans`), the Triton backend's tiles.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class HostBatch:
    """The step's batch as plain host data, kept for planning on the host (reference plans, Triton tiles).

    Attributes:
        query_lens, seq_lens: per request, as given to :meth:`AttentionMetadata.build`.
        block_table: int64 ``[num_reqs, max_blocks]`` on the CPU.
        query_start_loc: int64 ``[num_reqs + 1]`` on the CPU.
    """

    query_lens: list[int]
    seq_lens: list[int]
    block_table: torch.Tensor
    query_start_loc: torch.Tensor


@dataclass
class AttentionMetadata:
    """What every attention layer needs to know about one step's batch.

    A batch holds ``num_reqs`` requests; request ``r`` has ``query_len[r]`` new tokens, which are the last
    positions of its ``seq_len[r]`` tokens. Its new tokens occupy rows
    ``query_start_loc[r]:query_start_loc[r + 1]`` of the flattened batch. The slot of position ``p`` is
    ``block_table[r][p // block_size] * block_size + p % block_size``.

    Backends derive what else they need from it (and from :attr:`host`) in their own step metadata.

    Attributes:
        query_start_loc: int32 ``[num_reqs + 1]``, cumulative new-token counts (cu_seqlens).
        seq_lens: int32 ``[num_reqs]``, context + new tokens per request (0 for a padding row).
        block_table: int32 ``[num_reqs, max_blocks]``, KV block ids per request, padded with block 0.
        slot_mapping: int64 ``[num_new_tokens]``, cache slot of every new token (-1: padding, not written).
        max_query_len: most new tokens of one request.
        max_seq_len: longest ``seq_len`` (an upper bound, e.g. ``max_model_len``, for captured CUDA graphs).
        block_size: token slots per KV block.
        num_decode_tokens: number of requests with exactly one new token ("decodes").
        host: the batch on the host, or ``None`` for the static buffers of a captured CUDA graph (decodes
            only, for backends that need no host planning).
    """

    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    slot_mapping: torch.Tensor
    max_query_len: int
    max_seq_len: int
    block_size: int
    num_decode_tokens: int
    host: HostBatch | None = None

    @property
    def num_reqs(self) -> int:
        """Number of requests in the batch."""
        return self.seq_lens.shape[0]

    @classmethod
    def build(cls, query_lens: list[int], seq_lens: list[int], block_tables: list[list[int]],
              block_size: int, device: torch.device | str) -> AttentionMetadata:
        """Build the metadata of one step (once; every layer reuses it).

        Args:
            query_lens: new tokens per request (>= 1).
            seq_lens: context + new tokens per request (>= its query_len).
            block_tables: KV block ids per request, enough to hold ``seq_len`` tokens.
            block_size: token slots per block.
            device: where the tensors live.

        Raises:
            ValueError: on mismatched list lengths, an empty batch, a query longer than its sequence, or a
                block table too short for its sequence.
        """
        num_reqs = len(query_lens)
        if num_reqs == 0 or len(seq_lens) != num_reqs or len(block_tables) != num_reqs:
            raise ValueError(f"need one query_len, seq_len and block table per request, got {len(query_lens)}, "
                             f"{len(seq_lens)}, {len(block_tables)}")
        q = np.array(query_lens, dtype=np.int64)
        s = np.array(seq_lens, dtype=np.int64)
        num_blocks = np.fromiter(map(len, block_tables), dtype=np.int64, count=num_reqs)
        bad = (q < 1) | (q > s) | (num_blocks * block_size < s)
        if bad.any():
            r = int(bad.argmax())
            if not 1 <= query_lens[r] <= seq_lens[r]:
                raise ValueError(f"request {r}: need 1 <= query_len <= seq_len, got {query_lens[r]} and {seq_lens[r]}")
            raise ValueError(f"request {r}: {num_blocks[r]} blocks of {block_size} cannot hold {seq_lens[r]} tokens")

        # the tables padded with block 0, filled row by row through one mask
        table = np.zeros((num_reqs, int(num_blocks.max())), dtype=np.int64)
        table[np.arange(table.shape[1]) < num_blocks[:, None]] = np.fromiter(
            itertools.chain.from_iterable(block_tables), dtype=np.int64, count=int(num_blocks.sum()))
        start_loc = np.zeros(num_reqs + 1, dtype=np.int64)
        np.cumsum(q, out=start_loc[1:])
        max_query_len = int(q.max())
        # Request r's new tokens are its positions seq_len - query_len ... seq_len - 1.
        if max_query_len == 1:
            req, pos = np.arange(num_reqs), s - 1
        else:
            req = np.repeat(np.arange(num_reqs), q)
            pos = np.arange(req.shape[0]) - start_loc[req] + (s - q)[req]
        slot_mapping = cache_slots(table[req, pos // block_size], pos, block_size)
        host_table, host_start = torch.from_numpy(table), torch.from_numpy(start_loc)
        device = torch.device(device)
        return cls(
            query_start_loc=_on_device(start_loc.astype(np.int32), device),
            seq_lens=_on_device(s.astype(np.int32), device),
            block_table=_on_device(table.astype(np.int32), device),
            slot_mapping=_on_device(slot_mapping, device),
            max_query_len=max_query_len,
            max_seq_len=int(s.max()),
            block_size=block_size,
            num_decode_tokens=int((q == 1).sum()),
            host=HostBatch(list(query_lens), list(seq_lens), host_table, host_start),
        )

    def require_host(self) -> HostBatch:
        """The host batch.

        Raises:
            RuntimeError: for CUDA-graph metadata, which has none.
        """
        if self.host is None:
            raise RuntimeError("this metadata has no host batch (CUDA-graph buffers); plans need one")
        return self.host


def _on_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """``array`` as a tensor on ``device`` (sharing its memory on the CPU)."""
    t = torch.from_numpy(array)
    return t if device.type == "cpu" else t.to(device)


def cache_slots(block_ids: torch.Tensor | np.ndarray, positions: torch.Tensor | np.ndarray,
                block_size: int) -> torch.Tensor | np.ndarray:
    """Cache slots ``block_id * block_size + position % block_size`` (int64, shape of ``positions``; tensors or
    numpy arrays, returned as the inputs are)."""
    return block_ids * block_size + positions % block_size
