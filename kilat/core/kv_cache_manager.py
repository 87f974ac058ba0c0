"""Per-request KV block lists on top of the :class:`BlockPool`, with automatic prefix caching.

Full blocks are keyed by their content-addressed hash (:mod:`kilat.core.block_hash`: the parent's hash, the
block's tokens and, on the first block, the request's ``cache_salt``), so a key names the whole prefix up to
and including its block. A lookup never covers a request's last known token: its logits must be
computed to sample the next token.
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

    Counters ``prefix_queries`` / ``prefix_hits`` count prompt tokens and prompt tokens served from the
    cache, once per request at its first admission (docs/metrics.md: hit rate = cached prompt tokens / prompt
    tokens).
    """

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool):
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, enable_caching)
        self.req_blocks: dict[str, list[KVBlock]] = {}
        self._num_cached_blocks: dict[str, int] = {}
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
        logprobs compute their whole prompt, so they get no hits.
        """
        if not self.uses_prefix_cache(request):
            return [], 0
        hashes = self.block_hashes(request)
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[KVBlock] = []
        for key in hashes[:max_blocks]:
            block = self.pool.get_cached_block(key)
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

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
        connector has yet to load them; a later allocation registers them). Returns False, changing nothing,
        when too few blocks are free.
        """
        computed_blocks = computed_blocks or []
        blocks = self.req_blocks.get(request.request_id, [])
        num_computed = request.num_computed_tokens + len(computed_blocks) * self.block_size
        num_required = -(-(num_computed + num_new_tokens + num_lookahead_tokens) // self.block_size)
        num_needed = num_required - len(blocks) - len(computed_blocks)
        num_reusable_free = sum(1 for b in computed_blocks if b.ref_cnt == 0)
        if num_needed > self.pool.num_free_blocks - num_reusable_free:
            return False
        self.pool.touch(computed_blocks)
        blocks = self.req_blocks.setdefault(request.request_id, blocks)
        blocks.extend(computed_blocks)
        if num_needed > 0:
            blocks.extend(self.pool.get_new_blocks(num_needed))
        if self.enable_caching and cache:
            self.cache_full_blocks(request, num_computed + num_new_tokens)
        return True

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
        return self.pool.free_blocks(blocks[::-1])

    def get_block_ids(self, request: Request, start: int = 0) -> list[int]:
        """Physical block ids of the request in token order, from its ``start``-th block on."""
        return [b.block_id for b in self.req_blocks.get(request.request_id, [])[start:]]

    def num_blocks(self, request: Request) -> int:
        """How many blocks the request holds."""
        return len(self.req_blocks.get(request.request_id, ()))
