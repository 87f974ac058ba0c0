"""The data-parallel router: a prompt goes to the engine that holds the longest run of its leading blocks when that
is at least one block and the engine is not overloaded, else to the least loaded engine in turn; down engines
take nothing; a restarted engine starts with an empty index; the index of an engine is bounded by its KV blocks."""

from __future__ import annotations

import pytest

from kilat.engine.dp_router import BALANCE_ABS_THRESHOLD, PrefixRouter

SHARED = list(range(100, 132))  # two blocks of 16


def _router(num_engines: int = 2, num_blocks: int = 64) -> PrefixRouter:
    router = PrefixRouter(num_engines, 16)
    for engine in range(num_engines):
        router.engine_ready(engine, num_blocks)
    return router


def test_shared_prefixes_stick_to_their_engine_and_new_ones_spread():
    router = _router()
    up = [True, True]
    assert router.choose(SHARED + [1], up) == 0  # nothing cached: least loaded, in turn
    assert router.choose([7] * 40, up) == 1
    for suffix in range(5):  # the loads stay within the threshold: the cached prefix wins every time
        router.load[0] += 1
        assert router.choose(SHARED + [suffix], up) == 0
    assert router.choose([8] * 40, up) == 1  # a new prefix goes to the least loaded engine


def test_a_salted_prompt_does_not_follow_the_unsalted_prefix():
    router = _router()
    up = [True, True]
    assert router.choose(SHARED + [1], up) == 0
    router.load[0] += 1
    assert router.choose(SHARED + [2], up, cache_salt="tenant-a") == 1  # no match under its salt: least loaded
    router.load[1] += 2
    assert router.choose(SHARED + [3], up, cache_salt="tenant-a") == 1  # its own salt's blocks are on 1


def test_a_short_match_is_not_worth_it():
    router = _router()
    router.choose(list(range(16)) + [1], [True, True])  # engine 0 holds one block
    router.load[0] = 1
    assert router.choose(list(range(10)), [True, True]) == 1  # shares no full block: least loaded


def test_an_overloaded_engine_loses_its_prefix_hits():
    router = _router()
    up = [True, True]
    assert router.choose(SHARED, up) == 0
    router.load[0] = BALANCE_ABS_THRESHOLD
    assert router.choose(SHARED, up) == 0  # at the threshold: still worth it
    router.load[0] = BALANCE_ABS_THRESHOLD + 1
    assert router.choose(SHARED, up) == 1


def test_down_engines_take_nothing_and_restart_empty():
    router = _router()
    assert router.choose(SHARED, [True, True]) == 0
    assert router.choose(SHARED, [False, True]) == 1
    router.engine_ready(1, 64)  # restarted: its cache (and the index of it) is empty
    router.load[0] = 3
    assert router.choose(SHARED, [True, True]) == 0  # engine 0 still holds it
    with pytest.raises(ValueError, match="no engine core is up"):
        router.choose(SHARED, [False, False])


def test_without_prefix_caching_only_load_counts():
    router = PrefixRouter(2, 16, cache_aware=False)
    for engine in (0, 1):
        router.engine_ready(engine, 64)
    assert router.choose(SHARED, [True, True]) == 0
    router.load[0] = 1
    assert router.choose(SHARED, [True, True]) == 1


def test_the_index_holds_at_most_the_engines_blocks():
    router = _router(num_engines=2, num_blocks=2)
    assert router.choose(SHARED, [True, True]) == 0
    assert router.choose([5] * 32, [True, False]) == 0  # evicts both blocks of SHARED (least recently used)
    router.load[0] = 1
    assert router.choose(SHARED, [True, True]) == 1  # no longer matched: least loaded
