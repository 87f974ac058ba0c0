"""The thread governor runs every core unless a foreign process holds one for several intervals; kilat's own
API process (the engine core's parent) and its other children never count as foreign."""

import multiprocessing
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from kilat.model_executor import cpu_threads

API_PID = 4242  # the engine core's parent in these fakes


class FakeMachine:
    """Injected /proc readings: cumulative CPU-seconds of the machine, this process and its family."""

    def __init__(self, monkeypatch, cores: int = 2):
        self.t = self.busy = self.own = 0.0
        self.family: dict[int, float] = {API_PID: 0.0}
        monkeypatch.setattr(cpu_threads, "available_cores", lambda: cores)
        monkeypatch.setattr(cpu_threads, "_busy_seconds", lambda _cores: self.busy)
        monkeypatch.setattr(cpu_threads, "_own_seconds", lambda: self.own)
        monkeypatch.setattr(cpu_threads, "_family_seconds",
                            lambda parent: dict(self.family) if parent == API_PID else {})
        monkeypatch.setattr(cpu_threads.time, "monotonic", lambda: self.t)

    def tick(self, gov: cpu_threads.ThreadGovernor, own: float, api: float = 0.0, foreign: float = 0.0,
             dt: float = 1.0) -> int:
        """``dt`` seconds in which this process, the API process and foreign processes keep ``own``, ``api``
        and ``foreign`` cores busy; returns the governor's thread count after it."""
        self.t += dt
        self.own += own * dt
        self.family[API_PID] += api * dt
        self.busy += (own + api + foreign) * dt
        return gov.maybe_adjust()


@pytest.fixture
def machine(monkeypatch):
    before = torch.get_num_threads()
    yield FakeMachine(monkeypatch)
    torch.set_num_threads(before)


def test_quiet_machine_uses_every_core(machine):
    gov = cpu_threads.ThreadGovernor(None, API_PID)
    assert gov.num_threads == 2 and torch.get_num_threads() == 2
    assert [machine.tick(gov, own=2.0) for _ in range(5)] == [2] * 5


def test_own_api_process_is_not_foreign(machine):
    # served at concurrency 16: the API process keeps 0.9 core busy, a light client 0.1 (the old governor
    # counted both, 1.0 core, and ran one thread)
    gov = cpu_threads.ThreadGovernor(None, API_PID)
    assert [machine.tick(gov, own=1.1, api=0.9, foreign=0.1) for _ in range(6)] == [2] * 6
    assert torch.get_num_threads() == 2


def test_sustained_foreign_core_drops_a_thread_and_its_end_restores_it(machine):
    gov = cpu_threads.ThreadGovernor(None, API_PID)
    # a spinning neighbour gets half a core while our 2 threads compete with it, then a whole one
    assert [machine.tick(gov, own=1.5, foreign=0.5) for _ in range(3)] == [2, 2, 1]
    assert torch.get_num_threads() == 1
    assert [machine.tick(gov, own=1.0, foreign=1.0) for _ in range(4)] == [1] * 4
    assert machine.tick(gov, own=1.0, foreign=1.0, dt=0.5) == 1  # too soon: not re-measured
    assert machine.tick(gov, own=2.0, foreign=0.0) == 2  # the neighbour has gone
    assert torch.get_num_threads() == 2


def test_short_spike_keeps_every_thread(machine):
    gov = cpu_threads.ThreadGovernor(None, API_PID)
    assert [machine.tick(gov, own=1.0, foreign=1.0) for _ in range(2)] == [2, 2]
    assert [machine.tick(gov, own=2.0, foreign=0.0) for _ in range(2)] == [2, 2]
    assert [machine.tick(gov, own=1.0, foreign=1.0) for _ in range(2)] == [2, 2]


def test_neighbour_met_across_an_idle_spell_drops_a_thread_at_the_first_step(machine):
    # the engine idled for 5 s (nothing measured) while a neighbour spun: that one measurement spans more
    # than SUSTAIN_S of held core, so the first step already runs one thread (the old rule needed 3 steps)
    gov = cpu_threads.ThreadGovernor(None, API_PID)
    assert machine.tick(gov, own=0.0, foreign=1.0, dt=5.0) == 1
    assert machine.tick(gov, own=2.0, foreign=0.0) == 2
    # a 5 s quiet spell then a 1 s spike: not sustained
    assert machine.tick(gov, own=0.0, foreign=0.0, dt=5.0) == 2
    assert machine.tick(gov, own=1.0, foreign=1.0) == 2


def test_light_foreign_load_keeps_every_thread(machine):
    gov = cpu_threads.ThreadGovernor(None, API_PID)
    assert [machine.tick(gov, own=1.7, foreign=0.3) for _ in range(5)] == [2] * 5


def test_one_thread_per_held_core(monkeypatch):
    before = torch.get_num_threads()
    try:
        machine = FakeMachine(monkeypatch, cores=4)
        gov = cpu_threads.ThreadGovernor(None, API_PID)
        assert [machine.tick(gov, own=2.5, foreign=1.5) for _ in range(3)] == [4, 4, 2]
        assert [machine.tick(gov, own=3.5, foreign=0.5) for _ in range(3)] == [3, 3, 3]
        assert [machine.tick(gov, own=0.5, foreign=3.5) for _ in range(3)] == [3, 3, 1]  # never below 1
    finally:
        torch.set_num_threads(before)


def test_family_process_that_ends_is_not_foreign(machine):
    gov = cpu_threads.ThreadGovernor(None, API_PID)
    machine.family[API_PID + 1] = 0.0
    assert [machine.tick(gov, own=1.0, api=0.5) for _ in range(3)] == [2, 2, 2]
    del machine.family[API_PID + 1]  # a sibling exits: its CPU time leaves the sum, which is no foreign load
    assert [machine.tick(gov, own=1.0, api=0.5) for _ in range(3)] == [2, 2, 2]
    machine.family[API_PID + 2] = 1.0  # a sibling started in this interval: its CPU time counts from 0
    machine.busy += 1.0
    assert machine.tick(gov, own=1.0) == 2 and gov._held[-1][0] == 0


def test_in_process_engine_backs_off_from_sibling_workers(machine, monkeypatch):
    """An offline engine in a process pool's worker has no frontend: the pool's other workers are neighbours
    like any other (the governor used to take the pool's parent, and so its workers, as kilat's own)."""
    monkeypatch.setattr(multiprocessing, "parent_process", lambda: SimpleNamespace(pid=API_PID))  # a worker
    gov = cpu_threads.ThreadGovernor(None)
    assert [machine.tick(gov, own=1.0, api=1.0) for _ in range(3)] == [2, 2, 1]


def test_fixed_thread_count(machine):
    gov = cpu_threads.ThreadGovernor(1)
    assert torch.get_num_threads() == 1
    assert [machine.tick(gov, own=1.0, foreign=2.0) for _ in range(4)] == [1] * 4
    assert not gov.adaptive


def test_proc_readings():
    """The real /proc readers: a child's CPU time is found through its parent, and this process's own
    reading agrees with os.times()."""
    own = cpu_threads._own_seconds()
    assert abs(cpu_threads._process_seconds(os.getpid()) - own) < 0.1
    assert cpu_threads._process_seconds(2**22 + 1) is None
    assert cpu_threads._family_seconds(None) == {}
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        assert child.pid in cpu_threads._children(os.getpid())
        family = cpu_threads._family_seconds(os.getpid())
        assert child.pid in family and os.getpid() not in family and family[child.pid] >= 0.0
    finally:
        child.communicate(b"")
    assert child.pid not in cpu_threads._children(os.getpid())
