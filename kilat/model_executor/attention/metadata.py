"""Per-step attention metadata, built once per step and shared by every layer."""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

T = TypeVar("T")

_GROUP_GROWTH = 1.5
"""A decode group closes when the next (longer) decode would pad it past this factor of its shortest."""
_MIN_GROUP = 8
"""Decodes a group holds before it may close (fewer, larger attention calls beat padding savings)."""


@dataclass
class DecodePlan:
    """A group of the step's decodes (requests with exactly one new token), attended together in one batched
    call: of similar length (:attr:`AttentionMetadata.decodes`, for the gather path) or all of them
    (:attr:`AttentionMetadata.decode_batch`, for kernels that read the cache in place).

    Their context is gathered whole blocks at a time (one contiguous ``block_size`` run per index), which
    moves the same bytes as a per-slot gather in far fewer, larger copies; grouping by length keeps the
    padding to the group's longest small.

    Attributes:
        rows: their rows in the flattened batch: a ``slice`` when contiguous, else int64 indices.
        block_ids: int64 ``[num_decodes * num_blocks]``, each decode's first ``num_blocks`` block ids (past
            its own blocks: block 0 as padding, masked out).
        seq_lens: int64 ``[num_decodes]``.
        max_seq_len: the longest of ``seq_lens``.
        padded_len: ``num_blocks * block_size`` >= ``max_seq_len``, the key length of the gathered context.
    """

    rows: slice | torch.Tensor
    block_ids: torch.Tensor
    seq_lens: torch.Tensor
    max_seq_len: int
    padded_len: int

    @classmethod
    def build_groups(cls, decodes: list[int], seq_lens: list[int], table: torch.Tensor, start_loc: torch.Tensor,
                     block_size: int, device: torch.device | str) -> list[DecodePlan]:
        """Plan the decodes ``decodes`` (request indices) of a batch with block ``table`` (int64, CPU).

        Decodes are sorted by length and cut into groups of at least ``_MIN_GROUP`` whose longest is at
        most ``_GROUP_GROWTH`` times their shortest (the last group takes what is left).
        """
        order = sorted(decodes, key=lambda r: seq_lens[r])
        groups: list[list[int]] = [[]]
        for r in order:
            group = groups[-1]
            if len(group) >= _MIN_GROUP and seq_lens[r] > _GROUP_GROWTH * seq_lens[group[0]]:
                groups.append([])
            groups[-1].append(r)
        if len(groups) == 1:
            groups = [decodes]
        return [cls.build(g, seq_lens, table, start_loc, block_size, device) for g in groups]

    @classmethod
    def build(cls, decodes: list[int], seq_lens: list[int], table: torch.Tensor, start_loc: torch.Tensor,
              block_size: int, device: torch.device | str) -> DecodePlan:
        """Plan the decodes ``decodes`` (request indices, in this order) as one group."""
        num_decodes = len(decodes)
        index = torch.tensor(decodes, dtype=torch.int64)
        # Consecutive requests with one new token each occupy consecutive rows.
        if decodes == list(range(decodes[0], decodes[0] + num_decodes)):
            first = int(start_loc[decodes[0]])
            rows: slice | torch.Tensor = slice(first, first + num_decodes)
        else:
            rows = start_loc[index].to(device)
        max_seq_len = max(seq_lens[r] for r in decodes)
        num_blocks = -(-max_seq_len // block_size)
        block_ids = table[index][:, :num_blocks].reshape(-1)
        lens = torch.tensor([seq_lens[r] for r in decodes], dtype=torch.int64)
        return cls(rows, block_ids.to(device), lens.to(device), max_seq_len, num_blocks * block_size)


@dataclass
class PrefillPlan:
    """A request with more than one new token; the reference backend attends it on its own.

    Attributes:
        start, end: rows ``[start, end)`` of its new tokens in the flattened batch.
        context_len: tokens already in the KV cache before this step (``seq_len - query_len``).
        seq_len: context + new tokens.
        slots: int64 ``[seq_len]`` cache slots of all its positions, or ``None`` when ``context_len == 0``
            (the keys are then exactly the step's new keys and need no gather).
    """

    start: int
    end: int
    context_len: int
    seq_len: int
    slots: torch.Tensor | None


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

    Backends derive what else they need once per step through :meth:`cached` (the reference backend's
    :attr:`decodes` and :attr:`prefills` plans, the Triton backend's tiles), from :attr:`host`.

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
    _cache: dict[Hashable, Any] = field(default_factory=dict, repr=False)

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
        for r, (q, s, bt) in enumerate(zip(query_lens, seq_lens, block_tables, strict=True)):
            if not 1 <= q <= s:
                raise ValueError(f"request {r}: need 1 <= query_len <= seq_len, got {q} and {s}")
            if len(bt) * block_size < s:
                raise ValueError(f"request {r}: {len(bt)} blocks of {block_size} cannot hold {s} tokens")

        max_blocks = max(len(bt) for bt in block_tables)
        table = torch.tensor([bt + [0] * (max_blocks - len(bt)) for bt in block_tables], dtype=torch.int64)
        q_t = torch.tensor(query_lens, dtype=torch.int64)
        s_t = torch.tensor(seq_lens, dtype=torch.int64)
        start_loc = torch.zeros(num_reqs + 1, dtype=torch.int64)
        torch.cumsum(q_t, 0, out=start_loc[1:])

        # Request r's new tokens are its positions seq_len - query_len ... seq_len - 1.
        req = torch.repeat_interleave(torch.arange(num_reqs), q_t)
        pos = torch.arange(req.shape[0]) - start_loc[req] + (s_t - q_t)[req]
        slot_mapping = _slots(table[req, pos // block_size], pos, block_size)

        return cls(
            query_start_loc=start_loc.to(device=device, dtype=torch.int32),
            seq_lens=s_t.to(device=device, dtype=torch.int32),
            block_table=table.to(device=device, dtype=torch.int32),
            slot_mapping=slot_mapping.to(device),
            max_query_len=max(query_lens),
            max_seq_len=max(seq_lens),
            block_size=block_size,
            num_decode_tokens=sum(q == 1 for q in query_lens),
            host=HostBatch(list(query_lens), list(seq_lens), table, start_loc),
        )

    def cached(self, key: Hashable, compute: Callable[[], T]) -> T:
        """``compute()`` once per step (the first layer that asks); later layers get the same object."""
        if key not in self._cache:
            self._cache[key] = compute()
        return self._cache[key]

    def require_host(self) -> HostBatch:
        """The host batch.

        Raises:
            RuntimeError: for CUDA-graph metadata, which has none.
        """
        if self.host is None:
            raise RuntimeError("this metadata has no host batch (CUDA-graph buffers); plans need one")
        return self.host

    def _decode_requests(self) -> list[int]:
        """Indices of the requests with exactly one new token (the decodes), in batch order."""
        return [r for r, q in enumerate(self.require_host().query_lens) if q == 1]

    @property
    def decodes(self) -> list[DecodePlan]:
        """The decodes in length groups, one :class:`DecodePlan` each (empty when there are none)."""
        def plan() -> list[DecodePlan]:
            host, decodes = self.require_host(), self._decode_requests()
            if not decodes:
                return []
            return DecodePlan.build_groups(decodes, host.seq_lens, host.block_table, host.query_start_loc,
                                           self.block_size, self.slot_mapping.device)
        return self.cached("decodes", plan)

    @property
    def decode_batch(self) -> DecodePlan | None:
        """Every decode as one :class:`DecodePlan`, in batch order (``None`` when there are none): for kernels
        that read each context in place, where grouping by length saves nothing."""
        def plan() -> DecodePlan | None:
            host, decodes = self.require_host(), self._decode_requests()
            if not decodes:
                return None
            return DecodePlan.build(decodes, host.seq_lens, host.block_table, host.query_start_loc, self.block_size,
                                    self.slot_mapping.device)
        return self.cached("decode_batch", plan)

    @property
    def prefills(self) -> list[PrefillPlan]:
        """One :class:`PrefillPlan` per request with more than one new token, in batch order."""
        def plan() -> list[PrefillPlan]:
            host = self.require_host()
            starts = host.query_start_loc.tolist()
            plans = []
            for r, (q, s) in enumerate(zip(host.query_lens, host.seq_lens, strict=True)):
                if q > 1:
                    slots = None
                    if s > q:
                        positions = torch.arange(s)
                        slots = _slots(host.block_table[r, positions // self.block_size], positions,
                                       self.block_size).to(self.slot_mapping.device)
                    plans.append(PrefillPlan(starts[r], starts[r + 1], s - q, s, slots))
            return plans
        return self.cached("prefills", plan)

    def decode_mask(self, group: int = 0, sliding_window: int | None = None) -> torch.Tensor | None:
        """Key mask of decode group ``group``, bool ``[num_decodes, 1, 1, padded_len]`` (True = attend).

        ``None`` when every decode of the group sees all ``padded_len`` keys. With ``sliding_window`` ``w``
        the token at position ``p`` sees keys ``p - w < j <= p`` (as HF's ``sliding_window_overlay``).
        Cached: computed once per step, group and window, not per layer.
        """
        plan = self.decodes[group]
        window = _effective_window(sliding_window, plan.max_seq_len)

        def mask() -> torch.Tensor | None:
            if window is None and bool((plan.seq_lens == plan.padded_len).all()):
                return None
            keys = torch.arange(plan.padded_len, device=plan.seq_lens.device)
            allowed = keys < plan.seq_lens[:, None]
            if window is not None:
                allowed &= keys > (plan.seq_lens[:, None] - 1 - window)
            return allowed[:, None, None, :]
        return self.cached(("decode_mask", group, window), mask)

    def prefill_mask(self, index: int, sliding_window: int | None = None) -> torch.Tensor | None:
        """Causal mask of ``prefills[index]``, bool ``[query_len, seq_len]`` (True = attend).

        New token ``i`` (position ``context_len + i``) sees keys ``0..context_len + i`` (and, with a sliding
        window ``w``, only those after ``context_len + i - w``). ``None`` when a plain top-left causal mask
        is exact (no context, window not binding), so SDPA can use ``is_causal=True``. Cached per step.
        """
        plan = self.prefills[index]
        window = _effective_window(sliding_window, plan.seq_len)

        def mask() -> torch.Tensor | None:
            if plan.context_len == 0 and window is None:
                return None
            device = self.slot_mapping.device
            query_pos = torch.arange(plan.context_len, plan.seq_len, device=device)[:, None]
            keys = torch.arange(plan.seq_len, device=device)
            allowed = keys <= query_pos
            if window is not None:
                allowed &= keys > query_pos - window
            return allowed
        return self.cached(("prefill_mask", index, window), mask)


def _effective_window(sliding_window: int | None, seq_len: int) -> int | None:
    """The window, or ``None`` when it cannot exclude any key of a ``seq_len``-token sequence."""
    return sliding_window if sliding_window is not None and sliding_window < seq_len else None


def _slots(block_ids: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """Cache slots ``block_id * block_size + position % block_size`` (int64, shape of ``positions``)."""
    return block_ids * block_size + positions % block_size
