"""The KV offload tier (issue 17, point 3): blocks freed from the engine's cache are saved to disk and loaded back
on a later prefix hit, in the same engine and after a restart; greedy float32 outputs never change; a truncated
or corrupt block file is detected and recomputed, never decoded from."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kilat import LLM, SamplingParams
from kilat.core.block_hash import block_hashes
from kilat.kv_connector.disk_store import HEADER_BYTES, CorruptBlockError, DiskBlockStore

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
PROMPTS = [list(range(100 + 97 * i, 197 + 97 * i)) for i in range(4)]  # 97 tokens: 6 full blocks before the last


def test_block_files_round_trip_and_refuse_damage(tmp_path):
    store = DiskBlockStore(tmp_path, 64)
    hashes = [bytes([i]) * 32 for i in range(3)]
    for i, h in enumerate(hashes):
        store.write(h, bytes([i]) * 64)
        os.utime(store.path(h), ns=(i * 10**9, i * 10**9))
    assert store.read(hashes[1]) == bytes([1]) * 64
    (tmp_path / "stray.kv.tmp-1").write_bytes(b"x")
    (tmp_path / f"{'ab' * 32}.kv").write_bytes(b"short")
    assert store.scan() == [hashes[0], hashes[2], hashes[1]]  # least recently used first (reading touches)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(f"{h.hex()}.kv" for h in hashes)
    path = store.path(hashes[0])
    data = bytearray(path.read_bytes())
    data[HEADER_BYTES + 5] ^= 1
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptBlockError, match="checksum"):
        store.read(hashes[0])
    path.write_bytes(bytes(data[:-1]))
    with pytest.raises(CorruptBlockError, match="bytes, expected"):
        store.read(hashes[0])
    store.delete(hashes[2])
    with pytest.raises(CorruptBlockError):
        store.read(hashes[2])


def _llm(model: str, tier: Path | None, backend: str = "uni") -> LLM:
    extra = {} if tier is None else {"kv_offloading_size": 0.01, "kv_offloading_path": str(tier)}
    return LLM(model, dtype="float32", num_gpu_blocks_override=16, max_model_len=128,
               distributed_executor_backend=backend, **extra)


def _run(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


@pytest.mark.parametrize("backend", ["uni", "mp"])
def test_the_tier_serves_evicted_prefixes_and_survives_a_restart(tiny_llama_dir, tmp_path, backend):
    """Four 97-token prompts need 28 blocks; the cache has 16. Run one by one, then again: without the tier the
    second round finds the last prompts' blocks evicted; with it they load back from disk (the worker in this
    process, and in its own)."""
    plain = _llm(tiny_llama_dir, None)
    want = [_run(plain, [p])[0] for p in PROMPTS]
    assert [_run(plain, [p])[0] for p in PROMPTS] == want
    plain_hits = plain.engine.stats.prefix_cache_hits
    plain.shutdown()

    tier = tmp_path / "tier"
    llm = _llm(tiny_llama_dir, tier, backend)
    assert [_run(llm, [p])[0] for p in PROMPTS] == want
    assert [_run(llm, [p])[0] for p in PROMPTS] == want
    stats = llm.engine.stats
    assert stats.prefix_cache_hits + stats.external_prefix_cache_hits > plain_hits
    assert stats.external_prefix_cache_hits >= 3 * 96  # the first three prompts were evicted by the others
    assert stats.kv_offload["disk_saved_blocks"] == 4 * 6 and stats.kv_offload["disk_loaded_blocks"] >= 18
    llm.shutdown()
    files = list(next(tier.iterdir()).glob("*.kv"))
    assert len(files) == 24

    restarted = _llm(tiny_llama_dir, tier, backend)  # a cold device cache: every prompt's 6 blocks come from disk
    assert _run(restarted, [PROMPTS[3]]) == [want[3]]
    assert restarted.engine.stats.external_prefix_cache_hits == 96
    assert restarted.engine.stats.prefix_cache_hits == 0
    restarted.shutdown()


def test_a_corrupt_or_truncated_block_is_recomputed(tiny_llama_dir, tmp_path):
    tier = tmp_path / "tier"
    llm = _llm(tiny_llama_dir, tier)
    want = _run(llm, [PROMPTS[0]])
    llm.shutdown()
    store = DiskBlockStore(next(tier.iterdir()), llm.engine.core.info.bytes_per_block)
    chain = block_hashes(PROMPTS[0], 16)
    assert sorted(store.scan()) == sorted(chain)
    third = store.path(chain[2])
    data = bytearray(third.read_bytes())
    data[-1] ^= 0xFF  # corrupt the third block: only the first two load
    third.write_bytes(bytes(data))
    fresh = _llm(tiny_llama_dir, tier)
    assert _run(fresh, [PROMPTS[0]]) == want
    assert fresh.engine.stats.external_prefix_cache_hits == 32
    fresh.shutdown()
    assert len(store.read(chain[2])) == store.payload_bytes  # recomputed and saved again, intact
    fifth = store.path(chain[4])
    fifth.write_bytes(fifth.read_bytes()[:100])  # truncated: dropped at start-up, the first four load
    again = _llm(tiny_llama_dir, tier)
    assert _run(again, [PROMPTS[0]]) == want
    assert again.engine.stats.external_prefix_cache_hits == 64
    again.shutdown()


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"kv_offloading_size": 1}, "kv_offloading_size and kv_offloading_path go together"),
    ({"kv_offloading_size": -1, "kv_offloading_path": "/tmp/x"}, "kv_offloading_size must be > 0 GiB"),
    ({"kv_offloading_size": 1, "kv_offloading_path": "/tmp/x", "enable_prefix_caching": False},
     "needs enable_prefix_caching"),
    ({"kv_offloading_size": 1, "kv_offloading_path": "/tmp/x", "data_parallel_size": 2},
     "data_parallel_size 1 only"),
])
def test_bad_tier_settings_are_refused(kwargs, message):
    from kilat.config import EngineArgs

    with pytest.raises(ValueError, match=message):
        EngineArgs(**kwargs).create_engine_config()


def test_tier_metrics_are_exported():
    from collections import Counter

    from kilat.metrics.prometheus import PrometheusStatLogger
    from kilat.metrics.stats import EngineStats

    logger = PrometheusStatLogger()
    logger.record([], EngineStats(external_prefix_cache_hits=96, kv_offload=Counter(
        disk_saved_blocks=24, disk_saved_bytes=196608, disk_loaded_blocks=6, disk_loaded_bytes=49152)))
    lines = logger.render().decode().splitlines()
    for sample in ('kilat:external_prefix_cache_hits_total{engine="0"} 96.0',
                   'kilat:kv_offload_blocks_total{direction="save",engine="0",tier="disk"} 24.0',
                   'kilat:kv_offload_blocks_total{direction="load",engine="0",tier="disk"} 6.0',
                   'kilat:kv_offload_bytes_total{direction="save",engine="0",tier="disk"} 196608.0',
                   'kilat:kv_offload_bytes_total{direction="load",engine="0",tier="disk"} 49152.0'):
        assert sample in lines


def test_preemption_and_prompt_logprobs_with_the_tier(tiny_llama_dir, tmp_path):
    """Four requests that outgrow a 16-block cache preempt each other; a victim's saved blocks come back from the
    tier when it resumes (its generated tokens kept); a request that wants prompt logprobs never uses the tier.
    Greedy outputs and prompt logprobs equal the run without a tier."""
    prompts = [list(range(200 + 40 * i, 240 + 40 * i)) for i in range(4)]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    lp_params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True, prompt_logprobs=2)

    def run(tier: Path | None) -> tuple[list[list[int]], list, LLM]:
        llm = _llm(tiny_llama_dir, tier)
        outputs = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        scored = llm.generate([PROMPTS[0]], lp_params, use_tqdm=False)[0]
        return outputs, [(p and sorted(p.items())) for p in scored.prompt_logprobs], llm

    want, want_lp, plain = run(None)
    plain.shutdown()
    got, got_lp, llm = run(tmp_path / "tier")
    assert got == want and got_lp == want_lp
    stats = llm.engine.stats
    assert stats.num_preemptions > 0 and stats.kv_offload["disk_loaded_blocks"] > 0
    assert stats.external_prefix_cache_hits <= sum(len(p) for p in prompts)  # prompt tokens only
    llm.shutdown()


def test_a_hash_deleted_and_saved_again_in_one_step_stays_stored(tmp_path):
    """The writer runs saves and deletes in the scheduler's order, and a second save of a hash queued while the
    first is pending is not lost."""
    import torch

    from kilat.config import EngineConfig
    from kilat.kv_connector.base import KVCacheSpec, KVConnectorRole
    from kilat.kv_connector.offloading import OffloadingConnector, OffloadingMetadata

    cache = torch.arange(2 * 4 * 8, dtype=torch.float32).view(2, 4, 8)  # [2, num_blocks, ...]: 64 bytes a block
    config = EngineConfig()
    config.cache.kv_offloading_size, config.cache.kv_offloading_path = 0.001, str(tmp_path)
    worker = OffloadingConnector(config, KVConnectorRole.WORKER, KVCacheSpec(4, 4, 64, "float32", "float32"))
    worker.register_kv_caches([cache])
    block_hash = b"h" * 32
    worker.bind_connector_metadata(OffloadingMetadata(writes=[(1, block_hash), (-1, block_hash), (2, block_hash)]))
    worker.start_load_kv()
    worker.shutdown()  # drains the queue
    stored = torch.frombuffer(bytearray(worker.store.read(block_hash)), dtype=torch.float32)
    assert torch.equal(stored, cache[:, 2].reshape(-1))
