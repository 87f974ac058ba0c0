"""Which engine core serves a request under data parallelism (``data_parallel_size`` > 1): cache-aware routing.

Each engine core keeps its own prefix cache, so a prompt whose prefix one engine has cached is cheaper there
(SGLang's cache-aware router; vLLM's DP load balancer weighs only load). The router keeps, per engine, an
approximate index of the prompt blocks it sent there: the hashes of each prompt's full blocks of ``block_size``
tokens (the engine's own prefix-cache keys, :mod:`kilat.core.block_hash`, ``cache_salt`` included), least
recently used first, at most as many as the engine has KV blocks (it cannot cache more). For a new request:

1. The engine whose index holds the longest run of the prompt's leading block hashes is the candidate (ties: the
   less loaded).
2. When that run is at least one block and the candidate's load is within :data:`BALANCE_ABS_THRESHOLD` requests
   of the least loaded engine's, the request goes there: the prefix hit is worth it.
3. Otherwise it goes to the least loaded engine (ties taken in turn).

Load is the number of unfinished core requests the frontend sent an engine (its waiting plus running requests,
known here at once rather than at the engine's next step). An engine that is down takes nothing, and its index
is dropped when it dies (a restarted core starts with an empty cache). Without prefix caching only load counts.
"""

from __future__ import annotations

from collections import OrderedDict

from kilat.core.block_hash import BlockHash, block_hashes

BALANCE_ABS_THRESHOLD = 32
"""Most requests by which a prefix-cache candidate may exceed the least loaded engine's load (SGLang's router's
default ``balance_abs_threshold``): beyond it, queueing behind the others costs more than recomputing the prefix."""


class PrefixRouter:
    """Chooses an engine core per request (module docs).

    Args:
        num_engines: engine cores (``data_parallel_size``).
        block_size: tokens per KV block (``CacheConfig.block_size``).
        cache_aware: whether the engines cache prefixes (``CacheConfig.enable_prefix_caching``); without, every
            request goes to the least loaded engine.

    Attributes:
        load: unfinished core requests per engine.
    """

    def __init__(self, num_engines: int, block_size: int, cache_aware: bool = True):
        self.block_size = block_size
        self.cache_aware = cache_aware
        self.load = [0] * num_engines
        self._index: list[OrderedDict[BlockHash, None]] = [OrderedDict() for _ in range(num_engines)]
        self._capacity = [0] * num_engines
        self._turn = 0

    def engine_ready(self, engine: int, num_blocks: int) -> None:
        """Engine ``engine`` (re)started with ``num_blocks`` KV blocks: an empty cache, nothing in flight."""
        self._capacity[engine] = num_blocks
        self._index[engine].clear()
        self.load[engine] = 0

    def choose(self, prompt_token_ids: list[int], up: list[bool], cache_salt: str | None = None) -> int:
        """The engine for a prompt (of a request with ``cache_salt``), among those ``up``; its blocks are recorded
        in that engine's index.

        Raises:
            ValueError: no engine is up.
        """
        engines = [e for e, ok in enumerate(up) if ok]
        if not engines:
            raise ValueError("no engine core is up")
        hashes = block_hashes(prompt_token_ids, self.block_size, cache_salt) if self.cache_aware else []
        matched = {e: self._matched(e, hashes) for e in engines}
        least = min(self.load[e] for e in engines)
        best = max(engines, key=lambda e: (matched[e], -self.load[e]))
        if matched[best] == 0 or self.load[best] - least > BALANCE_ABS_THRESHOLD:
            idle = [e for e in engines if self.load[e] == least]
            best = idle[self._turn % len(idle)]
            self._turn += 1
        self._record(best, hashes)
        return best

    def _matched(self, engine: int, hashes: list[BlockHash]) -> int:
        """How many leading blocks of a prompt the engine's index holds."""
        index = self._index[engine]
        count = 0
        for h in hashes:
            if h not in index:
                break
            count += 1
        return count

    def _record(self, engine: int, hashes: list[BlockHash]) -> None:
        """Mark a prompt's blocks as most recently used on ``engine``, evicting the least recently used beyond
        its KV blocks."""
        index = self._index[engine]
        for h in hashes:
            index[h] = None
            index.move_to_end(h)
        while len(index) > self._capacity[engine]:
            index.popitem(last=False)
