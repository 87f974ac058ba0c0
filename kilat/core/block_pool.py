"""The pool of paged KV blocks: ref counts, an LRU free queue and the prefix-cache hash map.

Every :class:`KVBlock` is created once at start-up. A block with ref count 0 sits in the free queue
(least recently freed first); if it still carries a prefix hash it stays findable in the cache until it
is handed out again (PagedAttention, Kwon et al., SOSP 2023; automatic prefix caching as in vLLM).

A pool for sliding-window attention reserves block :data:`NULL_BLOCK_ID` as the *null block* (vLLM's): it stands
in a request's block table for the blocks its window no longer sees. It is never handed out, cached or freed, and
never written (no slot maps to it), so it keeps the zeros the KV cache was allocated with: a kernel that gathers
whole block tables reads finite values there, which its window mask then drops.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from kilat.core.block_hash import BlockHash

NULL_BLOCK_ID = 0
"""The null block's id (module docs)."""


@dataclass
class KVBlock:
    """One physical block of ``block_size`` token slots.

    Attributes:
        block_id: index into the KV cache tensors.
        ref_cnt: number of requests holding the block.
        block_hash: prefix-cache key once the block is full and cached, else ``None``.
    """

    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None


class BlockPool:
    """All KV blocks of the engine.

    Args:
        num_blocks: number of physical blocks (>= 1; >= 2 with ``null_block``).
        enable_caching: keep full blocks findable by prefix hash after they are freed.
        null_block: reserve block :data:`NULL_BLOCK_ID` as the null block (module docs).

    Attributes:
        null_block: the null block, or ``None``.

    Raises:
        ValueError: too few blocks (naming ``num_blocks``).
    """

    def __init__(self, num_blocks: int, enable_caching: bool, null_block: bool = False):
        if num_blocks < 1 + null_block:
            raise ValueError(f"num_blocks must be >= {1 + null_block}, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, KVBlock] = OrderedDict((b.block_id, b) for b in self.blocks)
        self._cached: dict[BlockHash, KVBlock] = {}
        self.null_block: KVBlock | None = None
        if null_block:
            self.null_block = self._free.pop(NULL_BLOCK_ID)
            self.null_block.ref_cnt = 1  # held for good: never free, never a reusable cache hit

    @property
    def num_usable_blocks(self) -> int:
        """Blocks requests can hold: all but the null block."""
        return self.num_blocks - (self.null_block is not None)

    @property
    def num_free_blocks(self) -> int:
        """Blocks with ref count 0 (cached or not)."""
        return len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of the usable blocks held by requests, in [0, 1]."""
        return 1.0 - len(self._free) / self.num_usable_blocks

    def get_cached_block(self, block_hash: BlockHash) -> KVBlock | None:
        """The cached block with this key, or ``None``."""
        return self._cached.get(block_hash)

    def get_new_blocks(self, num: int) -> list[KVBlock]:
        """Take ``num`` blocks from the head of the free queue (evicting their cache entries).

        Raises:
            ValueError: fewer than ``num`` blocks are free.
        """
        if num > len(self._free):
            raise ValueError(f"cannot take {num} blocks: only {len(self._free)} free")
        out = []
        for _ in range(num):
            _, block = self._free.popitem(last=False)
            assert block.ref_cnt == 0, "a free block must have ref count 0"
            if block.block_hash is not None:
                self._cached.pop(block.block_hash, None)
                block.block_hash = None
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take a reference to cache-hit blocks, removing free ones from the free queue (the null block is
        skipped)."""
        for block in blocks:
            if block is self.null_block:
                continue
            if block.ref_cnt == 0:
                del self._free[block.block_id]
            block.ref_cnt += 1

    def cache_block(self, block: KVBlock, block_hash: BlockHash) -> None:
        """Register a full block under its prefix key (first writer wins on duplicates; never the null block)."""
        if not self.enable_caching or block.block_hash is not None or block is self.null_block:
            return
        if block_hash in self._cached:
            return
        block.block_hash = block_hash
        self._cached[block_hash] = block

    def free_blocks(self, blocks: Sequence[KVBlock]) -> int:
        """Drop one reference to each block; blocks reaching 0 join the free queue.

        Pass a request's blocks in reverse order so that its tail is evicted before its prefix. The null block
        is skipped. Returns the number of blocks that became free.
        """
        freed = 0
        for block in blocks:
            if block is self.null_block:
                continue
            assert block.ref_cnt > 0, "freeing a block that is not held"
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free[block.block_id] = block
                freed += 1
        return freed

    def reset_prefix_cache(self) -> None:
        """Forget every cached hash (blocks in use keep their contents)."""
        for block in self._cached.values():
            block.block_hash = None
        self._cached.clear()
