"""Data parallelism (issue 16, point 5): two engine cores behind one server, each on its own CPU core. Requests
that share a prefix go to the engine that cached it, so two engines get exactly the prefix-cache hits of one;
metrics carry the engine label; killing one engine core fails only its own requests while the other keeps
serving, and the dead one is restarted."""

from __future__ import annotations

import os
import signal
import threading

import pytest
import requests

from kilat import LLM, SamplingParams
from tests.server_utils import Server, pid_alive, scrape_metrics
from tests.waiting import PATIENCE_S, wait_until

KV_BYTES = 128 << 20
PREFIXES = ["You are a meticulous travel agent who plans every trip down to the minute. " * 4,
            "Summarize the following quarterly report in one plain sentence for the board. " * 4]
PROMPTS = [prefix + f"Question {i}: what comes next?" for i in range(3) for prefix in PREFIXES]  # A, B, A, B, ...
GREEDY = {"max_tokens": 4, "temperature": 0, "ignore_eos": True}


def _one_engine_prefix_counters() -> tuple[int, int]:
    """Prefix-cache queries and hits of one engine given :data:`PROMPTS` one after another."""
    llm = LLM(kv_cache_memory=KV_BYTES, max_model_len=1024)
    try:
        for prompt in PROMPTS:
            llm.generate([prompt], SamplingParams(**GREEDY), use_tqdm=False)
        return llm.engine.stats.prefix_cache_queries, llm.engine.stats.prefix_cache_hits
    finally:
        llm.shutdown()


def _cpus(pid: int) -> str:
    """A process's ``Cpus_allowed_list`` (``/proc``)."""
    with open(f"/proc/{pid}/status") as f:
        return next(line.split()[1] for line in f if line.startswith("Cpus_allowed_list"))


def _cpu_list(cores: list[int]) -> str:
    """Contiguous ``cores`` as ``/proc`` writes them: ``"3"`` or ``"0-7"``."""
    return str(cores[0]) if len(cores) == 1 else f"{cores[0]}-{cores[-1]}"


def _stream(url: str, prompt: str, lines: list[str], seen: threading.Event) -> None:
    body = {"prompt": prompt, "max_tokens": 200, "ignore_eos": True, "stream": True}
    with requests.post(url + "/v1/completions", json=body, stream=True, timeout=120) as r:
        for line in r.iter_lines(decode_unicode=True):
            if line:
                lines.append(line)
                seen.set()


@pytest.mark.slow
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="two engine cores need two CPU cores")
def test_two_engines_route_by_prefix_and_fail_apart():
    want = _one_engine_prefix_counters()
    server = Server("--kv-cache-memory", str(KV_BYTES), "--max-model-len", "1024", "--data-parallel-size", "2")
    cores: list[int] = []
    try:
        cores = server.engine_core_pids()
        mine = sorted(os.sched_getaffinity(0))
        share = len(mine) // 2  # rank r runs on the r-th half of the cores this test may use
        halves = [_cpu_list(mine[:share]), _cpu_list(mine[share:2 * share])]
        by_cpu = {_cpus(pid): pid for pid in cores}
        assert len(cores) == 2 and sorted(by_cpu) == sorted(halves), (by_cpu, halves)
        rank0, rank1 = by_cpu[halves[0]], by_cpu[halves[1]]
        for prompt in PROMPTS:
            r = requests.post(server.url + "/v1/completions", json={"prompt": prompt, **GREEDY}, timeout=120)
            assert r.status_code == 200, r.text
        m = scrape_metrics(server.url, by_engine=True)
        counters = [(m[f'kilat:prefix_cache_queries_total{{engine="{e}"}}'],
                     m[f'kilat:prefix_cache_hits_total{{engine="{e}"}}']) for e in "01"]
        assert all(hits > 0 for _, hits in counters), counters  # prefix A went to engine 0, B to engine 1
        assert (sum(q for q, _ in counters), sum(h for _, h in counters)) == want

        # one stream per engine (each prefix's engine); engine 0's core is killed while both run
        runs = {e: ([], threading.Event()) for e in (0, 1)}
        threads = [threading.Thread(target=_stream, args=(server.url, PREFIXES[e] + "Tell me a story.", *runs[e]),
                                    daemon=True) for e in (0, 1)]
        for t in threads:
            t.start()
        assert all(seen.wait(PATIENCE_S) for _, seen in runs.values())
        os.kill(rank0, signal.SIGKILL)
        for t in threads:
            t.join(120)
        lost, kept = runs[0][0], runs[1][0]
        assert any(line.startswith('data: {"error"') and "engine" in line for line in lost), lost[-3:]
        assert kept[-1] == "data: [DONE]" and not any('"error"' in line for line in kept), kept[-3:]
        assert requests.get(server.url + "/health", timeout=10).status_code == 200  # engine 1 serves
        r = requests.post(server.url + "/v1/completions", json={"prompt": PROMPTS[0], **GREEDY}, timeout=120)
        assert r.status_code == 200, r.text  # prefix A's engine is down: the other takes it
        wait_until(lambda: scrape_metrics(server.url, by_engine=True)['kilat:engine_core_restarts_total{engine="0"}']
                   >= 1, "engine core 0 restarting", interval_s=0.5)
        assert scrape_metrics(server.url, by_engine=True)['kilat:engine_core_restarts_total{engine="1"}'] == 0
        cores = server.engine_core_pids()
        assert len(cores) == 2 and rank1 in cores and not pid_alive(rank0)
    finally:
        server.stop()
    assert not server.children() and not any(pid_alive(p) for p in cores)


def test_the_offline_llm_refuses_data_parallelism(tiny_llama_dir):
    with pytest.raises(ValueError, match=r"data_parallel_size \(2\) is for kilat serve"):
        LLM(tiny_llama_dir, data_parallel_size=2)
