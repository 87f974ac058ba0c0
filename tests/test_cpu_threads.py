"""The thread governor drops a thread per core that other processes keep busy, and restores it."""

import torch

from kilat.model_executor import cpu_threads


def test_governor_follows_other_processes(monkeypatch):
    clock = {"t": 0.0, "busy": 0.0, "own": 0.0}
    monkeypatch.setattr(cpu_threads, "available_cores", lambda: 2)
    monkeypatch.setattr(cpu_threads, "_busy_seconds", lambda cores: clock["busy"])
    monkeypatch.setattr(cpu_threads, "_own_seconds", lambda: clock["own"])
    monkeypatch.setattr(cpu_threads.time, "monotonic", lambda: clock["t"])
    before = torch.get_num_threads()
    try:
        gov = cpu_threads.ThreadGovernor(None, interval=1.0)
        assert gov.num_threads == 2 and torch.get_num_threads() == 2

        def tick(own_cores: float, other_cores: float, dt: float = 1.0) -> int:
            clock["t"] += dt
            clock["own"] += own_cores * dt
            clock["busy"] += (own_cores + other_cores) * dt
            return gov.maybe_adjust()

        assert tick(own_cores=2.0, other_cores=0.1) == 2
        assert tick(own_cores=1.2, other_cores=0.9) == 1
        assert torch.get_num_threads() == 1
        assert tick(own_cores=1.0, other_cores=0.2, dt=0.5) == 1  # too soon: not re-measured
        assert tick(own_cores=1.0, other_cores=0.2) == 2
        fixed = cpu_threads.ThreadGovernor(1)
        assert tick(own_cores=0.0, other_cores=0.0) == 2 and fixed.maybe_adjust() == 1
    finally:
        torch.set_num_threads(before)
