"""Disaggregated prefill/decode with the TCP connector (issue 17, point 4), offline: a producer engine computes a
prompt and keeps its blocks, a consumer engine pulls them and decodes; greedy float32 outputs equal a colocated
engine's; a consumer prefix hit pulls nothing; a corrupt, truncated, refused or unreachable transfer is detected
and the prompt recomputed; an aborted pull frees the blocks on both sides."""

from __future__ import annotations

import threading
import time

import pytest

from kilat import LLM, SamplingParams
from kilat.kv_connector import tcp
from kilat.kv_connector.tcp_wire import check_kv_transfer_params, send_frame
from tests.kv_relay import Relay
from tests.server_utils import free_port
from tests.waiting import PATIENCE_S, wait_until

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
PROMPTS = [list(range(100 + 97 * i, 197 + 97 * i)) for i in range(3)]  # 97 tokens: 6 full blocks before the last


def _llm(model: str, role: str | None = None, backend: str = "uni", **extra_config) -> LLM:
    transfer = None if role is None else {"kv_role": role, "kv_port": free_port(),
                                          "kv_connector_extra_config": extra_config}
    return LLM(model, dtype="float32", num_gpu_blocks_override=32, max_model_len=128, kv_transfer_config=transfer,
               distributed_executor_backend=backend)


def _params(kv: dict, max_tokens: int = 6) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True,
                          extra_args={"kv_transfer_params": kv})


def _prefill(producer: LLM, prompt: list[int]) -> dict:
    (out,) = producer.generate([prompt], _params({"do_remote_decode": True}, max_tokens=1), use_tqdm=False)
    assert out.kv_transfer_params is not None
    return out.kv_transfer_params


def _drain(llm: LLM) -> float:
    """Step until no transfer is in flight and no request is left (failing the test if that never happens); the
    KV cache usage then."""
    core = llm.engine.core

    def settled() -> bool:
        if core.has_transfers_in_flight() or llm.engine.has_unfinished_requests():
            llm.engine.step()
            return False
        return True

    wait_until(settled, "the engine's transfers and requests finishing", interval_s=0.002)
    return core.kv.usage


@pytest.fixture(scope="module")
def engines(tiny_llama_dir):
    """(reference outputs, producer, consumer) on the tiny model."""
    colocated = _llm(tiny_llama_dir)
    want = [o.outputs[0].token_ids for o in colocated.generate(PROMPTS, GREEDY, use_tqdm=False)]
    colocated.shutdown()
    producer, consumer = _llm(tiny_llama_dir, "kv_producer"), _llm(tiny_llama_dir, "kv_consumer")
    yield want, producer, consumer
    producer.shutdown()
    consumer.shutdown()


def test_the_decode_instance_pulls_the_prompt_and_decodes_the_same_tokens(engines):
    want, producer, consumer = engines
    kv = _prefill(producer, PROMPTS[0])
    assert kv["do_remote_prefill"] is True and kv["remote_port"] == producer.engine.config.kv_transfer.kv_port
    assert producer.engine.core.kv.usage > 0  # kept for the consumer
    received = consumer.engine.stats.kv_offload["tcp_received_blocks"]
    (out,) = consumer.generate([PROMPTS[0]], _params(kv), use_tqdm=False)
    assert out.outputs[0].token_ids == want[0]
    assert out.num_cached_tokens == 96  # six blocks pulled, the last prompt token computed here
    assert consumer.engine.stats.kv_offload["tcp_received_blocks"] - received == 6
    assert _drain(producer) == 0.0 and _drain(consumer) == 0.0
    assert producer.engine.stats.kv_offload["tcp_sent_blocks"] >= 6

    # the consumer's own prefix cache now holds that prompt: the next pull asks for nothing, and frees the producer
    kv = _prefill(producer, PROMPTS[0])
    (out,) = consumer.generate([PROMPTS[0]], _params(kv), use_tqdm=False)
    assert out.outputs[0].token_ids == want[0]
    assert consumer.engine.stats.kv_offload["tcp_received_blocks"] - received == 6
    assert _drain(producer) == 0.0

    # a partial hit: the consumer computed the first three blocks of another prompt itself, and pulls the other three
    consumer.generate([PROMPTS[2][:49]], GREEDY, use_tqdm=False)
    kv = _prefill(producer, PROMPTS[2])
    (out,) = consumer.generate([PROMPTS[2]], _params(kv), use_tqdm=False)
    assert out.outputs[0].token_ids == want[2] and out.num_cached_tokens == 96
    assert consumer.engine.stats.kv_offload["tcp_received_blocks"] - received == 6 + 3
    assert _drain(producer) == 0.0 and _drain(consumer) == 0.0
    consumer.engine.core.kv.pool.reset_prefix_cache()


@pytest.mark.parametrize(("mode", "intact"), [("corrupt", 2), ("truncate", 3)])
def test_a_damaged_transfer_is_detected_and_the_rest_recomputed(engines, mode, intact):
    want, producer, consumer = engines
    prompt = PROMPTS[1 if mode == "corrupt" else 2]
    kv = _prefill(producer, prompt)
    relay = Relay(kv["remote_port"], mode, producer.engine.core.info.bytes_per_block)
    received = consumer.engine.stats.kv_offload["tcp_received_blocks"]
    (out,) = consumer.generate([prompt], _params({**kv, "remote_port": relay.port}), use_tqdm=False)
    assert out.outputs[0].token_ids == want[PROMPTS.index(prompt)]
    assert out.num_cached_tokens == intact * 16  # the blocks before the damage; the rest computed
    assert consumer.engine.stats.kv_offload["tcp_received_blocks"] - received == intact
    assert _drain(producer) == 0.0 and _drain(consumer) == 0.0
    consumer.engine.core.kv.pool.reset_prefix_cache()


def test_a_refused_or_unreachable_producer_means_the_prompt_is_computed(engines):
    want, producer, consumer = engines
    kv = _prefill(producer, PROMPTS[0])
    for bad in ({"remote_request_id": "nope"}, {"remote_engine_id": "other"}, {"remote_port": free_port()}):
        (out,) = consumer.generate([PROMPTS[0]], _params({**kv, **bad}), use_tqdm=False)
        assert out.outputs[0].token_ids == want[0]
        assert out.num_cached_tokens == 0
        consumer.engine.core.kv.pool.reset_prefix_cache()
    (out,) = consumer.generate([PROMPTS[0]], _params(kv), use_tqdm=False)  # the right one still pulls
    assert out.num_cached_tokens == 96 and out.outputs[0].token_ids == want[0]
    assert _drain(producer) == 0.0 and _drain(consumer) == 0.0
    consumer.engine.core.kv.pool.reset_prefix_cache()


SLOW_PULL_S_PER_KIB = 0.5
"""The parked pull's pace through the relay: PROMPTS[1]'s 6 blocks of the tiny model (8 KiB each) take 24 s."""


def _park(producer: LLM, consumer: LLM, request_id: str) -> Relay:
    """Prefill PROMPTS[1] on the producer and have the consumer pull it through a slow relay
    (``SLOW_PULL_S_PER_KIB``), until the request waits for its KV (the pull running)."""
    kv = _prefill(producer, PROMPTS[1])
    relay = Relay(kv["remote_port"], "slow", producer.engine.core.info.bytes_per_block, SLOW_PULL_S_PER_KIB)
    consumer.engine.add_request(request_id, PROMPTS[1], _params({**kv, "remote_port": relay.port}))
    while not consumer.engine.core.scheduler.waiting_for_remote_kvs:
        consumer.engine.step()
    return relay


def test_an_abort_during_the_pull_frees_the_blocks_on_both_sides(engines):
    _, producer, consumer = engines
    relay = _park(producer, consumer, "aborted")
    engine = consumer.engine
    assert relay.started.wait(PATIENCE_S)
    assert engine.core.kv.usage > 0
    received = engine.stats.kv_offload["tcp_received_blocks"]
    engine.abort_request(["aborted"])
    assert not engine.core.scheduler.waiting_for_remote_kvs
    assert len(engine.core.scheduler.aborted_loads) == 1 and engine.core.kv.usage > 0  # kept while the pull runs
    start = time.monotonic()
    assert _drain(consumer) == 0.0 and not engine.core.scheduler.aborted_loads
    # the pull was stopped, not waited for: well within the 24 s the whole pull takes through the relay
    bytes_per_block = consumer.engine.core.info.bytes_per_block
    assert time.monotonic() - start < 0.5 * 6 * bytes_per_block / 1024 * SLOW_PULL_S_PER_KIB
    assert engine.stats.kv_offload["tcp_received_blocks"] - received < 6
    assert _drain(producer) == 0.0


def test_an_abort_as_the_pull_connects_still_tells_the_producer(engines, monkeypatch, caplog):
    """A cancel that arrives between the consumer's connect and its request frame does not cut the frame off:
    the producer hears of the pull and frees its copy when the connection closes, not after
    ``abort_request_timeout`` (120 s)."""
    _, producer, consumer = engines
    reached, go = threading.Event(), threading.Event()

    def gated_send_frame(sock, obj) -> None:
        if threading.current_thread().name.startswith("kilat-kv-pull") and not go.is_set():
            reached.set()
            assert go.wait(PATIENCE_S)
        send_frame(sock, obj)

    monkeypatch.setattr(tcp, "send_frame", gated_send_frame)
    kv = _prefill(producer, PROMPTS[1])
    engine = consumer.engine
    engine.add_request("cut", PROMPTS[1], _params(kv))
    while not engine.core.scheduler.waiting_for_remote_kvs:
        engine.step()
    assert reached.wait(PATIENCE_S)  # connected, the request frame not sent yet
    engine.abort_request(["cut"])
    engine.step()  # the cancel reaches the pull
    go.set()
    assert _drain(consumer) == 0.0 and _drain(producer) == 0.0
    assert "abort_request_timeout" not in caplog.text
    consumer.engine.core.kv.pool.reset_prefix_cache()


def test_workers_in_their_own_processes_serve_and_pull(tiny_llama_dir, engines):
    """``mp``: the producer's server thread and the consumer's pull threads live in the worker processes."""
    want = engines[0]
    producer, consumer = _llm(tiny_llama_dir, "kv_producer", "mp"), _llm(tiny_llama_dir, "kv_consumer", "mp")
    try:
        (out,) = consumer.generate([PROMPTS[1]], _params(_prefill(producer, PROMPTS[1])), use_tqdm=False)
        assert out.outputs[0].token_ids == want[1] and out.num_cached_tokens == 96
        assert _drain(producer) == 0.0 and _drain(consumer) == 0.0
    finally:
        producer.shutdown()
        consumer.shutdown()


def test_kept_blocks_are_freed_after_the_timeout_and_nothing_spins_meanwhile(tiny_llama_dir):
    """The kept blocks leave no room for the next request, which waits: the engine polls every few ms meanwhile
    (it does not spin), and runs it once the timeout frees them."""
    producer = LLM(tiny_llama_dir, dtype="float32", num_gpu_blocks_override=8, max_model_len=128,
                   kv_transfer_config={"kv_role": "kv_producer", "kv_port": free_port(),
                                       "kv_connector_extra_config": {"abort_request_timeout": 1.0}})
    try:
        engine = producer.engine
        _prefill(producer, PROMPTS[0])
        assert engine.core.kv.usage == 7 / 8 and engine.core.has_transfers_in_flight()
        engine.add_request("next", PROMPTS[1], GREEDY)  # needs 7 blocks, 1 is free
        steps, start = 0, time.monotonic()
        while time.monotonic() - start < 0.5:
            engine.step()
            steps += 1
        assert steps < 150 and engine.core.scheduler.waiting  # about one step per TRANSFER_POLL_S (5 ms)
        outputs = []
        while engine.has_unfinished_requests():
            outputs += engine.step()
        assert outputs[-1].finished and len(outputs[-1].outputs[0].token_ids) == GREEDY.max_tokens
        assert _drain(producer) == 0.0
    finally:
        producer.shutdown()


def test_only_a_request_that_ran_to_max_tokens_keeps_its_blocks(engines):
    """As vLLM: one that stopped (EOS, a stop token or string) gives no kv_transfer_params and keeps nothing."""
    want, producer, _ = engines
    params = SamplingParams(temperature=0, max_tokens=3, stop_token_ids=[want[0][0]],
                            extra_args={"kv_transfer_params": {"do_remote_decode": True}})
    (out,) = producer.generate([PROMPTS[0]], params, use_tqdm=False)
    assert out.outputs[0].finish_reason == "stop" and out.kv_transfer_params is None
    assert producer.engine.core.kv.usage == 0.0 and not producer.engine.core.has_transfers_in_flight()


def test_a_failed_step_leaves_a_pulling_request_parked(engines):
    """A step that raises aborts the requests it ran, not one whose pull is still writing into its blocks."""
    from kilat.core.engine_core import StepFailed

    _, producer, consumer = engines
    _park(producer, consumer, "parked")
    engine = consumer.engine
    runner = engine.core.runner
    execute = runner._execute

    def fail(sched):
        runner._execute = execute
        raise RuntimeError("a simulated model failure")

    runner._execute = fail
    with pytest.raises(StepFailed):
        engine.step()
    assert len(engine.core.scheduler.waiting_for_remote_kvs) == 1 and engine.core.kv.usage > 0
    engine.abort_request(["parked"])
    assert _drain(consumer) == 0.0 and _drain(producer) == 0.0


def test_kv_transfer_params_are_checked(engines):
    _, producer, consumer = engines
    with pytest.raises(ValueError, match="kv_transfer_params.remote_port"):
        check_kv_transfer_params({"do_remote_prefill": True, "remote_host": "h", "remote_engine_id": "e",
                                  "remote_request_id": "r", "remote_port": 0})
    with pytest.raises(ValueError, match="kv_transfer_params.do_remote_decode must be a boolean"):
        check_kv_transfer_params({"do_remote_decode": "yes"})
    with pytest.raises(ValueError, match="kv_role is 'kv_consumer'"):
        consumer.generate([PROMPTS[0]], _params({"do_remote_decode": True}), use_tqdm=False)
    with pytest.raises(ValueError, match="kv_role is 'kv_producer'"):
        producer.generate([PROMPTS[0]], _params({"do_remote_prefill": True, "remote_host": "h", "remote_port": 1,
                                                 "remote_engine_id": "e", "remote_request_id": "r"}), use_tqdm=False)
    with pytest.raises(ValueError, match="needs n = 1"):
        producer.generate([PROMPTS[0]], SamplingParams(n=2, extra_args={"kv_transfer_params": {
            "do_remote_decode": True}}), use_tqdm=False)


def test_config_is_checked(tiny_llama_dir):
    with pytest.raises(ValueError, match="kv_transfer_config.kv_role"):
        LLM(tiny_llama_dir, kv_transfer_config={"kv_role": "prefill"})
    with pytest.raises(ValueError, match="needs enable_prefix_caching"):
        LLM(tiny_llama_dir, kv_transfer_config={"kv_role": "kv_consumer"}, enable_prefix_caching=False)
    with pytest.raises(ValueError, match="unknown key"):
        LLM(tiny_llama_dir, kv_transfer_config='{"kv_connector_extra_config": {"timeout": 1}}')
    plain = _llm(tiny_llama_dir)
    try:
        with pytest.raises(ValueError, match="runs without kv_transfer_config"):
            plain.generate([PROMPTS[0]], _params({"do_remote_decode": True}), use_tqdm=False)
    finally:
        plain.shutdown()
