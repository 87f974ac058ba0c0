"""The host-side plans of the torch reference attention backend: its step metadata.

:class:`StepPlans` (built by the backend's ``build_metadata`` from the common
:class:`~kilat.model_executor.attention.metadata.AttentionMetadata`) computes each plan the first time a layer asks
for it and hands every later layer of the step the same object: decode groups for the gather path, one plan per
prefill, and the masks.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from kilat.model_executor.attention.metadata import AttentionMetadata, cache_slots

T = TypeVar("T")

_GROUP_GROWTH = 1.5
"""A decode group closes when the next (longer) decode would pad it past this factor of its shortest."""
_MIN_GROUP = 8
"""Decodes a group holds before it may close (fewer, larger attention calls beat padding savings)."""


@dataclass
class DecodePlan:
    """A group of the step's decodes (requests with exactly one new token) of similar length
    (:attr:`StepPlans.decodes`), attended together in one batched call.

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
    """A request with more than one new token; the torch backend attends it on its own.

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
class StepPlans:
    """The torch backend's metadata of one step: plans over its common metadata, each computed once.

    Attributes:
        common: the step's :class:`AttentionMetadata` (with its host batch: these plans are made on the host).
    """

    common: AttentionMetadata
    _cache: dict[Hashable, Any] = field(default_factory=dict, repr=False)

    def _cached(self, key: Hashable, compute: Callable[[], T]) -> T:
        """``compute()`` once per step (the first layer that asks); later layers get the same object."""
        if key not in self._cache:
            self._cache[key] = compute()
        return self._cache[key]

    def _decode_requests(self) -> list[int]:
        """Indices of the requests with exactly one new token (the decodes), in batch order."""
        return [r for r, q in enumerate(self.common.require_host().query_lens) if q == 1]

    @property
    def decodes(self) -> list[DecodePlan]:
        """The decodes in length groups, one :class:`DecodePlan` each (empty when there are none)."""
        def plan() -> list[DecodePlan]:
            host, decodes = self.common.require_host(), self._decode_requests()
            if not decodes:
                return []
            return DecodePlan.build_groups(decodes, host.seq_lens, host.block_table, host.query_start_loc,
                                           self.common.block_size, self.common.slot_mapping.device)
        return self._cached("decodes", plan)

    @property
    def prefills(self) -> list[PrefillPlan]:
        """One :class:`PrefillPlan` per request with more than one new token, in batch order."""
        def plan() -> list[PrefillPlan]:
            host = self.common.require_host()
            starts = host.query_start_loc.tolist()
            plans = []
            for r, (q, s) in enumerate(zip(host.query_lens, host.seq_lens, strict=True)):
                if q > 1:
                    slots = None
                    if s > q:
                        positions = torch.arange(s)
                        block_size = self.common.block_size
                        slots = cache_slots(host.block_table[r, positions // block_size], positions,
                                            block_size).to(self.common.slot_mapping.device)
                    plans.append(PrefillPlan(starts[r], starts[r + 1], s - q, s, slots))
            return plans
        return self._cached("prefills", plan)

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
        return self._cached(("decode_mask", group, window), mask)

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
            device = self.common.slot_mapping.device
            query_pos = torch.arange(plan.context_len, plan.seq_len, device=device)[:, None]
            keys = torch.arange(plan.seq_len, device=device)
            allowed = keys <= query_pos
            if window is not None:
                allowed &= keys > query_pos - window
            return allowed
        return self._cached(("prefill_mask", index, window), mask)


def _effective_window(sliding_window: int | None, seq_len: int) -> int | None:
    """The window, or ``None`` when it cannot exclude any key of a ``seq_len``-token sequence."""
    return sliding_window if sliding_window is not None and sliding_window < seq_len else None
