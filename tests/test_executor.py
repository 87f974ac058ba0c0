"""Executors (issue 16, point 2): ``mp`` runs the worker in a process of its own with outputs identical to
``uni``; a worker's exception fails only the call that raised it; a worker that fails to load raises its own
error; a dead worker fails the engine at once (no hang) and no worker outlives its engine or its parent."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import threading
import time
from collections import deque
from types import SimpleNamespace

import pytest

from kilat import LLM, SamplingParams
from kilat.child_process import python_command
from kilat.config import EngineArgs
from kilat.core.scheduler_output import CachedRequestData, SchedulerOutput
from kilat.executor.abstract import WorkerDiedError
from kilat.executor.multiproc import MultiprocExecutor, _frame, _recv_message
from tests.server_utils import pid_alive, worker_pids
from tests.test_step_contract import contract_engine_kwargs, generate_mixed
from tests.waiting import wait_until

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)




def test_mp_outputs_equal_uni(tiny_llama_dir):
    """Greedy and seeded float32 outputs through chunked prefill, prefix hits, preemption and n-gram drafts
    (tests/test_tensor_parallel.py runs ``mp`` without drafts)."""
    kwargs = contract_engine_kwargs(speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                                        "prompt_lookup_min": 2, "prompt_lookup_max": 3})
    want = generate_mixed(LLM(tiny_llama_dir, **kwargs))
    llm = LLM(tiny_llama_dir, **kwargs, distributed_executor_backend="mp")
    workers = worker_pids(os.getpid())
    assert len(workers) == 1
    assert generate_mixed(llm) == want
    stats = llm.engine.stats
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits >= 40 and stats.spec_decode.num_accepted_tokens > 0
    with pytest.raises(RuntimeError, match="not in this process"):
        llm.engine.core.runner  # noqa: B018
    llm.shutdown()
    assert not any(pid_alive(p) for p in workers)


def test_a_worker_exception_fails_its_call_and_a_dead_worker_the_engine(tiny_llama_dir):
    """A call that raises in the worker raises here and the engine goes on; then a SIGKILLed worker fails the
    next step at once (within the executor's 100 ms liveness poll, not a hang)."""
    llm = LLM(tiny_llama_dir, dtype="float32", distributed_executor_backend="mp")
    want = LLM(tiny_llama_dir, dtype="float32").generate([[5, 6, 7]], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    unknown = CachedRequestData()
    unknown.append("never-scheduled", False, [[]], [1], 3, [])
    with pytest.raises(KeyError, match="never-scheduled"):  # raised in the worker, raised again here
        llm.engine.core.executor.execute_model(SchedulerOutput(scheduled_cached_reqs=unknown,
                                                               num_scheduled_tokens={"never-scheduled": 1},
                                                               total_num_scheduled_tokens=1))
    assert llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False)[0].outputs[0].token_ids == want
    [worker] = worker_pids(os.getpid())
    os.kill(worker, signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(WorkerDiedError, match=rf"worker rank 0 \(pid {worker}\) exited with code -9"):
        llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False)
    assert time.monotonic() - start < 5
    with pytest.raises(WorkerDiedError, match="the workers are unusable: worker rank 0"):
        llm.engine.core.executor.execute_model(SchedulerOutput())
    llm.shutdown()


def test_a_worker_that_fails_to_load_raises_its_error(tiny_llama_dir):
    with pytest.raises(ValueError, match=r"holds 32 tokens \(4 blocks\), fewer than max_model_len \(128\)"):
        LLM(tiny_llama_dir, dtype="float32", max_model_len=128, block_size=8, num_gpu_blocks_override=4,
            distributed_executor_backend="mp")
    assert not worker_pids(os.getpid())


def test_workers_exit_with_their_parent(tiny_llama_dir):
    """A SIGKILLed offline process (no shutdown ran) leaves no worker behind."""
    code = (f"from kilat import LLM; llm = LLM({tiny_llama_dir!r}, dtype='float32', "
            f"distributed_executor_backend='mp'); print('ready', flush=True); import time; time.sleep(600)")
    proc = subprocess.Popen(python_command(code), stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        workers = worker_pids(proc.pid)
        assert len(workers) == 1
    finally:
        proc.kill()
        proc.wait()
    wait_until(lambda: not any(pid_alive(p) for p in workers), "the workers exiting")


def test_unknown_executor_backend_is_refused() -> None:
    with pytest.raises(ValueError, match=r"distributed_executor_backend must be one of \['mp', 'ray', 'uni'\] or None, "
                                         r"got 'threads'"):
        EngineArgs(distributed_executor_backend="threads").create_engine_config()


def test_a_large_step_and_a_large_reply_in_flight_together_do_not_deadlock():
    """With steps in flight (pipeline parallelism) the executor may write a step larger than the socket's buffer
    while the worker is blocked writing a reply larger than its own: the executor reads the reply while it
    writes, where two blocking writes would wait on each other for ever."""
    executor = object.__new__(MultiprocExecutor)
    ours, theirs = socket.socketpair()
    executor._socks, executor.world_size, executor._loaded = [ours], 1, [True]
    executor._replies_by_rank = [deque()]
    executor.workers = [SimpleNamespace(pid=0, poll=lambda: None)]
    big = os.urandom(8 << 20)  # far above a Unix socket's buffer (~200 KiB)
    received = []

    def worker() -> None:
        theirs.sendall(_frame((0, True, big)))  # blocks until the executor reads
        received.append(_recv_message(theirs))

    threading.Thread(target=worker, daemon=True).start()
    time.sleep(0.2)
    broadcast = threading.Thread(target=executor._broadcast, args=(("execute_model", (big,)),), daemon=True)
    broadcast.start()
    broadcast.join(30)
    assert not broadcast.is_alive()
    assert executor._gather() == [big]
    deadline = time.monotonic() + 30
    while not received and time.monotonic() < deadline:
        time.sleep(0.01)
    assert received == [("execute_model", (big,))]
    ours.close()
    theirs.close()
