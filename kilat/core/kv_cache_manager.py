"""Per-request KV block lists on top of the :class:`BlockPool`, with automatic prefix caching.

Full blocks are keyed by their content-addressed hash (:mod:`kilat.core.block_hash`: the parent's hash, the
block's tokens and, on the first block, the request's ``cache_salt``), so a key names the whole prefix up to
and including its block. A lookup never covers a request's last known token: its logits must be
computed to sample the next token.

With a sliding window ``w`` on every attention layer (:mod:`kilat.core.sliding_window`), a running request's
blocks that lie wholly before ``num_computed_tokens - w + 1`` are freed as it advances (still cached, joining the
free queue's LRU order) and their places in its block table point at the pool's null block, so a request holds a
window's worth of blocks instead of its whole context. A prefix-cache hit then needs only the blocks its window
sees before the hit point: the longest prefix whose last ``ceil((w - 1) / block_size)`` blocks are cached
(vLLM's sliding-window lookup; the block hashes chain, so a cached block vouches for the whole prefix before
it), the blocks before them standing in as null blocks.

A hybrid model's layers are split into KV-cache groups (:mod:`kilat.core.kv_cache_groups`), each with its own
block table per request and its own window (or none), all drawing blocks from one pool; a group's blocks are
cached under keys of their own. A prefix hit must hold in every group: the hit is the longest prefix that each
group can serve (a full group its whole run, a sliding group the blocks its window sees), found by shortening the
candidate until all agree (vLLM's hybrid lookup).
"""

from __future__ import annotations

from collections.abc import Sequence

from kilat.core.block_hash import BlockHash, extend_block_hashes
from kilat.core.block_pool import BlockPool, KVBlock
from kilat.core.request import Request


class KVCacheManager:
    """Allocates and frees the KV blocks of requests, one block table per KV-cache group.

    Args:
        num_blocks: physical blocks in the cache.
        block_size: token slots per block.
        enable_caching: automatic prefix caching.
        sliding_windows: each KV-cache group's window, by which its blocks behind the window are freed, or
            ``None`` for a group that keeps every block (:func:`~kilat.core.kv_cache_groups.plan_kv_cache_groups`);
            one entry per group, ``(None,)`` for one group of full attention. With a window the pool reserves its
            null block.

    Raises:
        ValueError: no group, more than 255, a window below 1, or too few blocks (naming the field).

    Counters ``prefix_queries`` / ``prefix_hits`` count prompt tokens and prompt tokens served from the
    cache, once per request at its first admission (docs/metrics.md: hit rate = cached prompt tokens / prompt
    tokens).
    """

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool,
                 sliding_windows: Sequence[int | None] = (None,)):
        if not 1 <= len(sliding_windows) <= 255:
            raise ValueError(f"sliding_windows must name 1 to 255 KV-cache groups, got {len(sliding_windows)}")
        if any(w is not None and w < 1 for w in sliding_windows):
            raise ValueError(f"sliding_window must be >= 1, got {min(w for w in sliding_windows if w is not None)}")
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.sliding_windows = tuple(sliding_windows)
        self.num_groups = len(self.sliding_windows)
        self._no_windows = all(w is None for w in self.sliding_windows)
        self.pool = BlockPool(num_blocks, enable_caching,
                              null_block=any(w is not None for w in self.sliding_windows))
        self.req_blocks: dict[str, list[list[KVBlock]]] = {}  # request id -> its block table of each group
        self._num_cached_blocks: dict[str, list[int]] = {}
        self._num_null_blocks: dict[str, list[int]] = {}  # leading null blocks of each group's table
        self.prefix_queries = 0
        self.prefix_hits = 0

    @property
    def usage(self) -> float:
        """Fraction of KV blocks in use, in [0, 1]."""
        return self.pool.usage

    @property
    def num_free_blocks(self) -> int:
        """Blocks not held by any request."""
        return self.pool.num_free_blocks

    def block_hashes(self, request: Request) -> list[BlockHash]:
        """Keys of the request's full blocks (``request.block_hashes``, extended as its tokens grow)."""
        return extend_block_hashes(request.block_hashes, request.all_token_ids, self.block_size, request.cache_salt)

    def _key(self, group: int, block_hash: BlockHash) -> BlockHash:
        """The prefix-cache key of a group's block: the block hash itself for group 0 (what KV connectors see),
        tagged with the group's number for the others (their blocks hold other layers' KV)."""
        return block_hash if group == 0 else block_hash + bytes([group])

    def uses_prefix_cache(self, request: Request) -> bool:
        """Whether the request may reuse cached blocks: caching is on and it does not want prompt logprobs
        (which need its whole prompt computed)."""
        return self.enable_caching and request.sampling_params.prompt_logprobs is None

    def get_computed_blocks(self, request: Request) -> tuple[list[list[KVBlock]], int]:
        """Each group's cached blocks of the longest prefix of the request that every group can serve, and the
        tokens they cover.

        The prefix stops before the block holding the request's last token. Requests that want prompt
        logprobs compute their whole prompt, so they get no hits. A full-attention group serves a run of cached
        full blocks; a sliding group the prefixes whose last blocks its window sees are cached, led by null
        blocks (module docs).
        """
        if not self.uses_prefix_cache(request):
            return [[] for _ in range(self.num_groups)], 0
        hashes = self.block_hashes(request)[:(request.num_tokens - 1) // self.block_size]
        length = len(hashes)
        while True:
            hits = [self._group_hit(g, hashes[:length]) for g in range(self.num_groups)]
            shortest = min(len(h) for h in hits)
            if shortest == length:
                return hits, length * self.block_size
            length = shortest

    def _group_hit(self, group: int, hashes: list[BlockHash]) -> list[KVBlock]:
        """Group ``group``'s blocks of the longest prefix of ``hashes`` it can serve."""
        window = self.sliding_windows[group]
        if window is not None:
            return self._window_hit(group, window, hashes)
        hits: list[KVBlock] = []
        for key in hashes:
            block = self.pool.get_cached_block(self._key(group, key))
            if block is None:
                break
            hits.append(block)
        return hits

    def _window_hit(self, group: int, window: int, hashes: list[BlockHash]) -> list[KVBlock]:
        """The blocks of the longest prefix of ``hashes`` whose last ``ceil((w - 1) / block_size)`` blocks (at
        least one) are cached, the ones before them null; or the cached run from the first block when no such
        prefix exists (searched from the end, as vLLM's sliding-window manager does)."""
        assert self.pool.null_block is not None
        needed = max(1, -(-(window - 1) // self.block_size))
        run: list[KVBlock] = []  # the cached blocks just found, last first
        for i in range(len(hashes) - 1, -1, -1):
            block = self.pool.get_cached_block(self._key(group, hashes[i]))
            if block is None:
                run = []
            else:
                run.append(block)
                if len(run) == needed:
                    return [self.pool.null_block] * i + run[::-1]
        return run[::-1]  # empty, or a run that reaches the first block

    def record_prefix_query(self, num_prompt_tokens: int, num_hit_tokens: int) -> None:
        """Count one request's first admission: its prompt tokens and those served from the cache."""
        if self.enable_caching:
            self.prefix_queries += num_prompt_tokens
            self.prefix_hits += min(num_hit_tokens, num_prompt_tokens)

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       computed_blocks: list[list[KVBlock]] | None = None, num_lookahead_tokens: int = 0,
                       cache: bool = True, num_reserved_blocks: int = 0) -> bool:
        """Make room in every group's table for ``num_new_tokens`` more tokens after the computed ones, plus
        ``num_lookahead_tokens`` slots after them (where a draft model writes the KV of its drafts).

        ``computed_blocks`` (each group's prefix-cache hits from :meth:`get_computed_blocks`, for a request being
        admitted) are taken first. ``cache=False`` leaves the new full blocks out of the prefix cache (a KV
        connector has yet to load them; a later allocation registers them). With a sliding window, the running
        request's blocks behind a group's window are freed first. Returns False, changing nothing else, when too
        few blocks are free for all the groups together, leaving ``num_reserved_blocks`` free (the scheduler's
        admission headroom).
        """
        rid = request.request_id
        tables = self.req_blocks.get(rid)
        if tables is not None and not computed_blocks and not num_reserved_blocks and self._no_windows:
            # the common decode step: every table already holds the new slots
            num_required = -(-(request.num_computed_tokens + num_new_tokens + num_lookahead_tokens) // self.block_size)
            if all(len(table) >= num_required for table in tables):
                if self.enable_caching and cache:
                    self.cache_full_blocks(request, request.num_computed_tokens + num_new_tokens)
                return True
        computed = computed_blocks or [[] for _ in range(self.num_groups)]
        if tables is not None:
            for group, window in enumerate(self.sliding_windows):
                if window is not None:
                    self._free_behind_window(request, group, window, tables[group])
        num_computed = request.num_computed_tokens + len(computed[0]) * self.block_size
        num_required = -(-(num_computed + num_new_tokens + num_lookahead_tokens) // self.block_size)
        needed = [num_required - (len(tables[g]) if tables is not None else 0) - len(computed[g])
                  for g in range(self.num_groups)]
        num_reusable_free = sum(1 for hits in computed for b in hits if b.ref_cnt == 0)
        if sum(max(0, n) for n in needed) > self.pool.num_free_blocks - num_reusable_free - num_reserved_blocks:
            return False
        for hits in computed:
            self.pool.touch(hits)
        if tables is None:
            tables = self.req_blocks[rid] = [[] for _ in range(self.num_groups)]
            if any(computed) and self.pool.null_block is not None:  # a window's hit: nulls lead
                self._num_null_blocks[rid] = [sum(b is self.pool.null_block for b in hits) for hits in computed]
        for table, hits, num_needed in zip(tables, computed, needed, strict=True):
            table.extend(hits)
            if num_needed > 0:
                table.extend(self.pool.get_new_blocks(num_needed))
        if self.enable_caching and cache:
            self.cache_full_blocks(request, num_computed + num_new_tokens)
        return True

    def _free_behind_window(self, request: Request, group: int, window: int, blocks: list[KVBlock]) -> None:
        """Free the group's blocks of the request that lie wholly before ``num_computed_tokens - window + 1`` (no
        token from ``num_computed_tokens`` on sees their keys), oldest first, after registering them in the prefix
        cache; the null block takes their places in ``blocks``."""
        assert self.pool.null_block is not None
        rid = request.request_id
        nulls = self._num_null_blocks.setdefault(rid, [0] * self.num_groups)
        start = nulls[group]
        end = min(len(blocks), max(0, request.num_computed_tokens - window + 1) // self.block_size)
        if end <= start:
            return
        if self.enable_caching:
            self.cache_full_blocks(request, request.num_computed_tokens)
        behind = blocks[start:end]
        blocks[start:end] = [self.pool.null_block] * (end - start)
        nulls[group] = end
        self.pool.free_blocks(behind)

    def num_null_blocks(self, request: Request, group: int = 0) -> int:
        """Leading entries of the request's block table in ``group`` that are the null block (its window left
        them behind); 0 without a sliding window."""
        nulls = self._num_null_blocks.get(request.request_id)
        return 0 if nulls is None else nulls[group]

    def cache_full_blocks(self, request: Request, num_tokens: int) -> None:
        """Register the request's newly full blocks (up to ``num_tokens`` known tokens) of every group."""
        rid = request.request_id
        end = min(num_tokens, request.num_tokens) // self.block_size
        cached = self._num_cached_blocks.setdefault(rid, [0] * self.num_groups)
        if all(end <= start for start in cached):
            return
        hashes = self.block_hashes(request)
        for group, table in enumerate(self.req_blocks[rid]):
            for i in range(cached[group], min(end, len(table))):
                self.pool.cache_block(table[i], self._key(group, hashes[i]))
            cached[group] = max(cached[group], min(end, len(table)))

    def free_tail(self, request: Request, num_slots: int) -> int:
        """Free the request's blocks past its first ``num_slots`` token slots in every group, e.g. those that held
        only rejected draft tokens. Such blocks hold no known token, so none is in the prefix cache. Returns how
        many became free."""
        keep = -(-num_slots // self.block_size)
        freed = 0
        for table in self.req_blocks.get(request.request_id, ()):
            tail = table[keep:]
            del table[keep:]
            freed += self.pool.free_blocks(tail[::-1])
        return freed

    def free(self, request: Request) -> int:
        """Release all of the request's blocks (each group's tail first). Returns how many became free."""
        tables = self.req_blocks.pop(request.request_id, [])
        self._num_cached_blocks.pop(request.request_id, None)
        self._num_null_blocks.pop(request.request_id, None)
        return sum(self.pool.free_blocks(table[::-1]) for table in tables)

    def get_block_ids(self, request: Request, start: int = 0, group: int = 0) -> list[int]:
        """Physical block ids of the request's table in ``group``, in token order, from its ``start``-th block on."""
        tables = self.req_blocks.get(request.request_id)
        return [] if tables is None else [b.block_id for b in tables[group][start:]]

    def num_blocks(self, request: Request, group: int = 0) -> int:
        """How many entries the request's block table in ``group`` has (null blocks included)."""
        tables = self.req_blocks.get(request.request_id)
        return 0 if tables is None else len(tables[group])
