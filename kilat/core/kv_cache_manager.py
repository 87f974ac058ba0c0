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
"""

from __future__ import annotations

from kilat.core.block_hash import BlockHash, extend_block_hashes
from kilat.core.block_pool import BlockPool, KVBlock
from kilat.core.request import Request


class KVCacheManager:
    """Allocates and frees the KV blocks of requests.

    Args:
        num_blocks: physical blocks in the cache.
        block_size: token slots per block.
        enable_caching: automatic prefix caching.
        sliding_window: free blocks behind this window (every attention layer's, the largest:
            :func:`~kilat.core.sliding_window.kv_sliding_window`), or ``None`` to keep every block. With a window the
            pool reserves its null block.

    Raises:
        ValueError: ``sliding_window`` below 1, or too few blocks (naming the field).

    Counters ``prefix_queries`` / ``prefix_hits`` count prompt tokens and prompt tokens served from the
    cache, once per request at its first admission (docs/metrics.md: hit rate = cached prompt tokens / prompt
    tokens).
    """

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool, sliding_window: int | None = None):
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1, got {sliding_window}")
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.sliding_window = sliding_window
        self.pool = BlockPool(num_blocks, enable_caching, null_block=sliding_window is not None)
        self.req_blocks: dict[str, list[KVBlock]] = {}
        self._num_cached_blocks: dict[str, int] = {}
        self._num_null_blocks: dict[str, int] = {}  # leading null blocks of each request's table
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

    def uses_prefix_cache(self, request: Request) -> bool:
        """Whether the request may reuse cached blocks: caching is on and it does not want prompt logprobs
        (which need its whole prompt computed)."""
        return self.enable_caching and request.sampling_params.prompt_logprobs is None

    def get_computed_blocks(self, request: Request) -> tuple[list[KVBlock], int]:
        """Longest run of cached full blocks that prefixes the request, and the tokens they cover.

        The run stops before the block holding the request's last token. Requests that want prompt
        logprobs compute their whole prompt, so they get no hits. With a sliding window, the run is the
        longest prefix whose last blocks the window sees are cached, led by null blocks (module docs).
        """
        if not self.uses_prefix_cache(request):
            return [], 0
        hashes = self.block_hashes(request)[:(request.num_tokens - 1) // self.block_size]
        if self.sliding_window is not None:
            hits = self._window_hit(hashes)
            return hits, len(hits) * self.block_size
        hits: list[KVBlock] = []
        for key in hashes:
            block = self.pool.get_cached_block(key)
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    def _window_hit(self, hashes: list[BlockHash]) -> list[KVBlock]:
        """The blocks of the longest prefix of ``hashes`` whose last ``ceil((w - 1) / block_size)`` blocks (at
        least one) are cached, the ones before them null; or the cached run from the first block when no such
        prefix exists (searched from the end, as vLLM's sliding-window manager does)."""
        assert self.sliding_window is not None and self.pool.null_block is not None
        needed = max(1, -(-(self.sliding_window - 1) // self.block_size))
        run: list[KVBlock] = []  # the cached blocks just found, last first
        for i in range(len(hashes) - 1, -1, -1):
            block = self.pool.get_cached_block(hashes[i])
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
                       computed_blocks: list[KVBlock] | None = None, num_lookahead_tokens: int = 0,
                       cache: bool = True) -> bool:
        """Make room for ``num_new_tokens`` more tokens after the computed ones, plus ``num_lookahead_tokens``
        slots after them (where a draft model writes the KV of its drafts).

        ``computed_blocks`` (prefix-cache hits from :meth:`get_computed_blocks`, for a request being
        admitted) are taken first. ``cache=False`` leaves the new full blocks out of the prefix cache (a KV
        connector has yet to load them; a later allocation registers them). With a sliding window, the running
        request's blocks behind its window are freed first. Returns False, changing nothing else, when too few
        blocks are free.
        """
        computed_blocks = computed_blocks or []
        blocks = self.req_blocks.get(request.request_id, [])
        if blocks and self.sliding_window is not None:
            self._free_behind_window(request, blocks)
        num_computed = request.num_computed_tokens + len(computed_blocks) * self.block_size
        num_required = -(-(num_computed + num_new_tokens + num_lookahead_tokens) // self.block_size)
        num_needed = num_required - len(blocks) - len(computed_blocks)
        num_reusable_free = sum(1 for b in computed_blocks if b.ref_cnt == 0)
        if num_needed > self.pool.num_free_blocks - num_reusable_free:
            return False
        self.pool.touch(computed_blocks)
        blocks = self.req_blocks.setdefault(request.request_id, blocks)
        if computed_blocks and not blocks and self.sliding_window is not None:  # a window's hit: nulls lead
            self._num_null_blocks[request.request_id] = sum(b is self.pool.null_block for b in computed_blocks)
        blocks.extend(computed_blocks)
        if num_needed > 0:
            blocks.extend(self.pool.get_new_blocks(num_needed))
        if self.enable_caching and cache:
            self.cache_full_blocks(request, num_computed + num_new_tokens)
        return True

    def _free_behind_window(self, request: Request, blocks: list[KVBlock]) -> None:
        """Free the request's blocks that lie wholly before ``num_computed_tokens - sliding_window + 1`` (no token
        from ``num_computed_tokens`` on sees their keys), oldest first, after registering them in the prefix
        cache; the null block takes their places in ``blocks``."""
        assert self.sliding_window is not None and self.pool.null_block is not None
        rid = request.request_id
        start = self._num_null_blocks.get(rid, 0)
        end = min(len(blocks), max(0, request.num_computed_tokens - self.sliding_window + 1) // self.block_size)
        if end <= start:
            return
        if self.enable_caching:
            self.cache_full_blocks(request, request.num_computed_tokens)
        behind = blocks[start:end]
        blocks[start:end] = [self.pool.null_block] * (end - start)
        self._num_null_blocks[rid] = end
        self.pool.free_blocks(behind)

    def num_null_blocks(self, request: Request) -> int:
        """Leading entries of the request's block table that are the null block (its window left them
        behind); 0 without a sliding window."""
        return self._num_null_blocks.get(request.request_id, 0)

    def cache_full_blocks(self, request: Request, num_tokens: int) -> None:
        """Register the request's newly full blocks (up to ``num_tokens`` known tokens)."""
        start = self._num_cached_blocks.get(request.request_id, 0)
        end = min(num_tokens, request.num_tokens) // self.block_size
        if end <= start:
            return
        hashes = self.block_hashes(request)
        blocks = self.req_blocks[request.request_id]
        for i in range(start, end):
            self.pool.cache_block(blocks[i], hashes[i])
        self._num_cached_blocks[request.request_id] = end

    def free_tail(self, request: Request, num_slots: int) -> int:
        """Free the request's blocks past its first ``num_slots`` token slots, e.g. those that held only rejected
        draft tokens. Such blocks hold no known token, so none is in the prefix cache. Returns how many
        became free."""
        blocks = self.req_blocks.get(request.request_id, [])
        keep = -(-num_slots // self.block_size)
        tail = blocks[keep:]
        del blocks[keep:]
        return self.pool.free_blocks(tail[::-1])

    def free(self, request: Request) -> int:
        """Release all of the request's blocks (tail first). Returns how many became free."""
        blocks = self.req_blocks.pop(request.request_id, [])
        self._num_cached_blocks.pop(request.request_id, None)
        self._num_null_blocks.pop(request.request_id, None)
        return self.pool.free_blocks(blocks[::-1])

    def get_block_ids(self, request: Request, start: int = 0) -> list[int]:
        """Physical block ids of the request in token order, from its ``start``-th block on."""
        return [b.block_id for b in self.req_blocks.get(request.request_id, [])[start:]]

    def num_blocks(self, request: Request) -> int:
        """How many entries the request's block table has (null blocks included)."""
        return len(self.req_blocks.get(request.request_id, ()))
