"""Bounded structured outputs: size limits before any xgrammar work, compiles cancelled with their requests and
stopped at the time limit, an engine core that sleeps while grammars compile, a bounded compile cache."""

from __future__ import annotations

import contextlib
import gc
import json
import os
import pickle
import re
import signal
import threading
import time
from collections.abc import Callable, Iterator

import pytest
import requests
import zmq

from kilat import LLM, SamplingParams
from kilat.config import StructuredOutputsConfig
from kilat.core.core_process import AddRequests, EngineCoreOutputs, EngineCoreProc, Shutdown
from kilat.core.request import EngineCoreRequest
from kilat.entrypoints.openai.serving import request_failed
from kilat.outputs import RequestError
from kilat.sampling_params import StructuredOutputsParams
from kilat.structured_outputs import limits
from tests.server_utils import Server
from tests.waiting import wait_until

SLOW_REGEX = "".join(f"[a-z]{{1,{300 + i}}}" for i in range(40))
"""600 characters that compile for about a minute on SmolLM2's tokenizer (61 s measured; 76 MB): only the time
limit stops it."""
TIMEOUT_S = 2.0
SERVER_TIMEOUT_S = 5.0
HUGE = 100_000


def _enum_schema(n: int) -> dict:
    return {"type": "object", "properties": {"x": {"enum": [f"value {i}" for i in range(n)]}}, "required": ["x"]}


def _nested(depth: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "array", "items": schema}
    return schema


@pytest.mark.parametrize("spec,match", [
    (lambda: {"choice": [f"option {i}" for i in range(HUGE)]},
     f"structured_outputs.choice: at most {limits.MAX_CHOICES} entries allowed, got {HUGE}"),
    (lambda: {"choice": ["x" * 40_000, "y" * 40_000]},
     f"structured_outputs.choice: at most {limits.MAX_CHOICE_CHARS} characters in all allowed, got 80000"),
    (lambda: {"json": _enum_schema(HUGE)},
     f"structured_outputs.json: at most {limits.MAX_ENUM_ENTRIES} entries in an enum allowed, got {HUGE}"),
    (lambda: {"json": json.dumps({"enum": list(range(5000))})},
     f"structured_outputs.json: at most {limits.MAX_ENUM_ENTRIES} entries in an enum allowed, got 5000"),
    (lambda: {"json": {"type": "object", "description": "d" * 70_000}},
     f"structured_outputs.json: at most {limits.MAX_SCHEMA_CHARS} characters allowed"),
    (lambda: {"json": _nested(HUGE)},
     f"structured_outputs.json: the schema may nest objects and arrays at most {limits.MAX_SCHEMA_DEPTH} deep"),
    (lambda: {"json": "[" * 30_000 + "]" * 30_000}, "structured_outputs.json: the schema may nest"),
    (lambda: {"regex": "a" * 5000}, f"structured_outputs.regex: at most {limits.MAX_REGEX_CHARS} characters allowed"),
    (lambda: {"grammar": 'root ::= "' + "a" * 70_000 + '"'},
     f"structured_outputs.grammar: at most {limits.MAX_GRAMMAR_CHARS} characters allowed"),
], ids=["choices", "choice-chars", "enum", "enum-text", "schema-chars", "depth", "depth-text", "regex", "grammar"])
def test_oversized_constraints_are_refused_before_xgrammar(spec: Callable[[], dict], match: str,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    import xgrammar as xgr

    from kilat.structured_outputs.grammar import validate_structured_outputs

    def forbidden(*args: object, **kwargs: object) -> None:
        raise AssertionError("xgrammar was called")

    for name in ("from_ebnf", "from_json_schema", "from_regex"):
        monkeypatch.setattr(xgr.Grammar, name, forbidden)
    params = StructuredOutputsParams(**spec())
    start = time.perf_counter()
    with pytest.raises(ValueError, match=re.escape(match)):
        validate_structured_outputs(params)
    assert time.perf_counter() - start < 1.0  # linear pure-Python checks, not a compile


def test_constraints_at_the_limits_are_accepted() -> None:
    from kilat.structured_outputs.grammar import validate_structured_outputs

    per_choice = limits.MAX_CHOICE_CHARS // limits.MAX_CHOICES
    validate_structured_outputs(StructuredOutputsParams(
        choice=[f"{i:0{per_choice}d}" for i in range(limits.MAX_CHOICES)]))
    validate_structured_outputs(StructuredOutputsParams(json=_enum_schema(limits.MAX_ENUM_ENTRIES)))
    validate_structured_outputs(StructuredOutputsParams(json=_nested(limits.MAX_SCHEMA_DEPTH - 1)))


def test_structured_outputs_config_takes_vllms_backend_key() -> None:
    assert StructuredOutputsConfig.parse('{"backend": "xgrammar"}').backend == "xgrammar"
    assert StructuredOutputsConfig.parse({"backend": "auto", "num_workers": 1}).num_workers == 1
    with pytest.raises(ValueError, match=r"structured_outputs_config.backend must be 'auto' or 'xgrammar' .*"
                                         r"got 'guidance'"):
        StructuredOutputsConfig.parse({"backend": "guidance"})


def test_a_request_failure_is_a_400_only_when_the_engine_blames_the_request() -> None:
    assert request_failed(RequestError("structured_outputs: grammar compilation took longer", True)).status == 400
    server_side = request_failed(RequestError("structured_outputs: grammar compilation failed: worker gone"))
    assert server_side.status == 500 and server_side.type == "server_error"  # before: the text's prefix decided


@pytest.fixture(scope="module")
def llm() -> Iterator[LLM]:
    llm = LLM(dtype="float32", max_model_len=512,
              structured_outputs_config={"compile_timeout_s": TIMEOUT_S, "cache_size_mb": 1})
    yield llm
    manager = llm.engine.core._structured_outputs()
    pids = set(manager.worker_pids)
    wakeup_fd = manager.wakeup_fd
    llm.shutdown()
    llm.shutdown()  # idempotent
    with pytest.raises(OSError):
        os.fstat(wakeup_fd)  # the wake-up pipe is closed
    assert manager.worker_pids == [] and not pids & _workers_of(os.getpid())  # killed and reaped


def test_a_dropped_llm_stops_its_compile_workers(llm: LLM) -> None:
    other = LLM(dtype="float32", max_model_len=128, kv_cache_memory=16 << 20)
    out = other.generate(["Pick:"], SamplingParams(temperature=0, max_tokens=16,
                                                   structured_outputs=_choice(2, "drop")), use_tqdm=False)[0]
    assert out.outputs[0].text in _choice(2, "drop").choice
    pids = set(other.engine.core.structured_outputs.worker_pids)
    assert len(pids) == 1 and pids <= _workers_of(os.getpid())
    del other, out
    gc.collect()
    assert not pids & _workers_of(os.getpid())  # before: it lived (200 MB) until pytest exited


def _choice(n: int, tag: str) -> StructuredOutputsParams:
    return StructuredOutputsParams(choice=[f"{tag} option number {i}" for i in range(n)])


def test_an_aborted_request_stops_its_compile(llm: LLM) -> None:
    engine = llm.engine
    out = llm.generate(["Pick:"], SamplingParams(temperature=0, max_tokens=16,
                                                 structured_outputs=_choice(3, "warm")), use_tqdm=False)[0]
    assert out.outputs[0].text in _choice(3, "warm").choice  # a compile worker is running now
    manager = engine.core.structured_outputs
    workers = manager.worker_pids
    assert len(workers) == 1 and set(workers) <= _workers_of(os.getpid())
    engine.add_request("slow", "x", SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(
        regex=SLOW_REGEX)))
    engine.step()
    time.sleep(0.5)
    # a second slot may be starting a worker for it: until a worker is compiling it
    wait_until(lambda: any(job.worker for job in manager._jobs.values()), "a worker compiling the slow grammar")
    assert manager.num_busy == 1 and engine.core.waits_only_for_grammars()
    busy = set(manager.worker_pids)
    engine.abort_request(["slow"])
    wait_until(lambda: not manager.num_busy, "the aborted compile ending")
    assert manager.num_busy == 0 and manager.num_queued == 0
    wait_until(lambda: not set(manager.worker_pids) >= busy, "the slot's thread reaping the killed worker")
    gone = busy - set(manager.worker_pids)
    assert len(gone) == 1 and not gone & _workers_of(os.getpid())  # the one compiling it was killed and reaped
    assert not engine.has_unfinished_requests()
    out = llm.generate(["Pick:"], SamplingParams(temperature=0, max_tokens=16,
                                                 structured_outputs=_choice(2, "next")), use_tqdm=False)[0]
    assert out.outputs[0].text in _choice(2, "next").choice and out.outputs[0].finish_reason == "stop"


def test_a_queued_compile_is_dropped_with_its_request(llm: LLM) -> None:
    engine = llm.engine
    manager = engine.core._structured_outputs()
    for i in range(manager.config.num_workers + 1):  # one more than the slots: the last one queues
        engine.add_request(f"q{i}", "x", SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(
            regex=SLOW_REGEX + "z" * i)))
    assert manager.num_queued + manager.num_busy == manager.config.num_workers + 1
    engine.abort_request([f"q{i}" for i in range(manager.config.num_workers + 1)])
    wait_until(lambda: not (manager.num_busy or manager.num_queued), "the aborted compiles ending")


def test_the_engine_core_sleeps_while_a_grammar_compiles_and_reports_the_time_limit(llm: LLM) -> None:
    """Run the core process's loop on in-process sockets: a request whose grammar compiles past the limit
    gets two messages (its acknowledgement, then its abort with the error), not one per loop turn."""
    ctx = zmq.Context()
    front_in, core_in = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    core_out, front_out = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    core_in.bind("inproc://in")
    front_in.connect("inproc://in")
    front_out.bind("inproc://out")
    core_out.connect("inproc://out")
    def run() -> None:
        with contextlib.suppress(SystemExit):  # how the loop ends on Shutdown
            EngineCoreProc(llm.engine.core, core_in, core_out).run()

    loop = threading.Thread(target=run, daemon=True)
    loop.start()
    params = SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(regex=SLOW_REGEX + "w"))
    start = time.monotonic()
    front_in.send(pickle.dumps(AddRequests([EngineCoreRequest("t#0", [1, 2, 3], params, 2, time.time(), "t")])))
    messages: list[EngineCoreOutputs] = []
    while not any(o.finish_reason for m in messages for o in m.outputs):
        assert front_out.poll(60_000), "no answer from the engine core"
        messages.append(pickle.loads(front_out.recv()))
    elapsed = time.monotonic() - start
    front_in.send(pickle.dumps(Shutdown()))
    loop.join(10)
    for socket in (front_in, core_in, core_out, front_out):
        socket.close(linger=0)
    ctx.term()
    assert len(messages) <= 3, [len(m.outputs) for m in messages]  # old loop: one message per spin
    (final,) = [o for m in messages for o in m.outputs]
    assert final.finish_reason == "abort" and elapsed >= TIMEOUT_S
    # the error is the request's own, marked as the client's fault; the batch error is for failed steps only
    assert f"took longer than {TIMEOUT_S:g} s (structured_outputs_config.compile_timeout_s)" in final.error.message
    assert final.error.client_error and all(m.error is None for m in messages)
    out = llm.generate(["Pick:"], SamplingParams(temperature=0, max_tokens=16,
                                                 structured_outputs=_choice(2, "after")), use_tqdm=False)[0]
    assert out.outputs[0].text in _choice(2, "after").choice


def test_a_crashed_compile_worker_fails_its_request_and_is_replaced(llm: LLM) -> None:
    manager = llm.engine.core._structured_outputs()
    state = manager.submit(_choice(2, "warm"))  # a worker that has started
    wait_until(lambda: state.ready, "the warm-up grammar compiling")
    state = manager.submit(StructuredOutputsParams(regex=SLOW_REGEX + "v"))
    wait_until(lambda: any(job.worker for job in manager._jobs.values()), "the warm slot's worker compiling it")
    assert manager.num_busy == 1 and not state.ready
    for pid in manager.worker_pids:
        os.kill(pid, signal.SIGKILL)
    wait_until(lambda: state.ready, "the killed compile failing its request")
    assert state.error == "structured_outputs: the grammar compile worker exited with status -9"
    assert not state.client_error  # the engine's fault: a 500, not a 400
    state = manager.submit(_choice(2, "again"))
    wait_until(lambda: state.ready, "a new worker compiling the next grammar")
    assert state.error is None


def test_a_compile_cancelled_as_its_worker_answers_does_not_fail_the_next(llm: LLM) -> None:
    manager = llm.engine.core._structured_outputs()
    probe = manager._probe
    first = _choice(2, "race")
    states = []

    def cancel_on_answer(worker, job):  # the request leaves just as the worker answers
        answer = probe(worker, job)
        if job.params == first:
            states[0].cancel()
        return answer

    manager._probe = cancel_on_answer
    try:
        states.append(manager.submit(first))
        wait_until(lambda: not (manager.num_busy or manager.num_queued), "the cancelled compile ending",
                   interval_s=0.02)
        state = manager.submit(_choice(2, "after race"))  # before: could be sent to the dying worker (a 500)
        wait_until(lambda: state.ready, "the next grammar compiling", interval_s=0.02)
    finally:
        del manager._probe
    assert state.ready and state.error is None
    assert len(manager.worker_pids) == len(set(manager.worker_pids) & _workers_of(os.getpid()))  # all alive


def test_the_compile_cache_stays_under_its_bound(llm: LLM) -> None:
    manager = llm.engine.core._structured_outputs()
    assert manager.cache.limit_bytes == 1 << 20
    sizes = []
    for tag in ("a", "b", "c"):  # each ~0.7 MB compiled: at most one fits
        state = manager.submit(_choice(4000, tag))
        wait_until(lambda: state.ready, f"the {tag!r} grammar compiling", interval_s=0.02)  # noqa: B023
        assert state.error is None
        sizes.append(manager.cache.size_bytes)
        assert manager.cache.size_bytes <= manager.cache.limit_bytes
    assert len(manager.cache) == 1 and sizes[-1] > 0
    state = manager.submit(_choice(4000, "c"))  # the most recent one is served from the cache
    assert state.ready and state.error is None


@pytest.fixture(scope="module")
def server() -> Server:
    s = Server("--dtype", "float32", "--max-model-len", "512", "--structured-outputs-config",
               json.dumps({"compile_timeout_s": SERVER_TIMEOUT_S}))
    yield s
    s.stop()


def test_a_huge_choice_list_gets_400_at_once_while_others_are_served(server: Server) -> None:
    results: dict[str, requests.Response] = {}

    def plain() -> None:
        results["plain"] = requests.post(server.url + "/v1/completions", json={
            "prompt": "Count to five:", "max_tokens": 24, "temperature": 0, "ignore_eos": True}, timeout=120)

    thread = threading.Thread(target=plain)
    thread.start()
    tools = [{"type": "function", "function": {"name": "pick", "parameters": _enum_schema(HUGE)}}]
    for param, extra in (
            ("structured_outputs", {"structured_outputs": {"choice": [f"option {i}" for i in range(HUGE)]}}),
            ("response_format", {"response_format": {"type": "json_schema", "json_schema": {
                "name": "x", "schema": _enum_schema(HUGE)}}}),
            ("tools", {"tools": tools, "tool_choice": "required"})):  # the field the client sent is named
        body = json.dumps({"messages": [{"role": "user", "content": "Pick one."}], "max_tokens": 8, **extra})
        took = []
        for _ in range(3):  # the best of three: the machine may be busy with other work for a moment
            start = time.perf_counter()
            r = requests.post(server.url + "/v1/chat/completions", data=body,
                              headers={"Content-Type": "application/json"}, timeout=60)
            took.append(time.perf_counter() - start)
            assert r.status_code == 400, r.text
            error = r.json()["error"]
            assert error["type"] == "invalid_request_error"
            assert error["param"] == param and error["message"].startswith(param), error
            assert f"got {HUGE}" in error["message"], error["message"]
        assert min(took) < 1.0, (param, took)  # before: the tokenizer thread parsed it for up to 58 s
    thread.join(120)
    body = results["plain"].json()
    assert results["plain"].status_code == 200 and body["usage"]["completion_tokens"] == 24


def test_a_compile_past_the_time_limit_fails_its_request_and_the_next_is_served(server: Server) -> None:
    r = requests.post(server.url + "/v1/completions", json={
        "prompt": "x", "max_tokens": 4, "structured_outputs": {"regex": SLOW_REGEX}}, timeout=120)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "structured_outputs"
    assert "took longer than 5 s (structured_outputs_config.compile_timeout_s)" in r.json()["error"]["message"]
    r = requests.post(server.url + "/v1/completions", json={
        "prompt": "Pick:", "max_tokens": 8, "temperature": 0, "structured_outputs": {"choice": ["yes", "no"]}},
        timeout=120)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] in ("yes", "no")


def _workers_of(pid: int) -> set[int]:
    """Live compile workers whose parent is ``pid``."""
    found = set()
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read()
        except (OSError, ValueError):
            continue
        if int(fields[1]) == pid and fields[0] != "Z" and b"kilat.structured_outputs.worker" in cmdline:
            found.add(int(entry))
    return found


def test_a_client_that_leaves_stops_its_compile(server: Server) -> None:
    core = server.engine_core_pid()
    r = requests.post(server.url + "/v1/completions", json={  # a started compile worker, idle
        "prompt": "Pick:", "max_tokens": 8, "temperature": 0, "structured_outputs": {"choice": ["on", "off"]}},
        timeout=120)
    assert r.status_code == 200, r.text
    before = _workers_of(core)
    assert before
    start = time.monotonic()
    with pytest.raises(requests.ReadTimeout):
        requests.post(server.url + "/v1/completions", json={
            "prompt": "x", "max_tokens": 4, "structured_outputs": {"regex": SLOW_REGEX + "u"}}, timeout=1.0)
    while not before - _workers_of(core) and time.monotonic() - start < 30:
        time.sleep(0.05)
    assert before - _workers_of(core), "no compile worker was stopped"
    assert time.monotonic() - start < SERVER_TIMEOUT_S - 0.5  # killed for the leaving client, not the time limit
