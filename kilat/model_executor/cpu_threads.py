"""Torch intra-op threads for the CPU path, adapted to what other processes leave free.

Measured on the 2-core development machine (docs/benchmarks.md): with 2 threads, batch-1 decode falls to
about a quarter of its speed as soon as another process keeps one core busy, because every parallel op
waits at a barrier for the thread that lost its core; with 1 thread it loses under 10%. So by default the
engine uses one thread per core while the machine is quiet and drops one thread per core that other
processes keep busy.
"""

from __future__ import annotations

import math
import os
import time

import torch


def available_cores() -> int:
    """Cores this process may run on."""
    return len(os.sched_getaffinity(0))


def _busy_seconds(cores: set[str]) -> float | None:
    """CPU-seconds all processes have spent busy on ``cores`` (``{"cpu0", ...}``) since boot
    (``/proc/stat``), or ``None`` off Linux."""
    try:
        with open("/proc/stat") as f:
            rows = [line.split() for line in f if line.startswith("cpu")]
    except OSError:
        return None
    busy = 0
    for row in rows:
        if row[0] in cores:
            fields = [int(x) for x in row[1:9]]
            busy += sum(fields) - fields[3] - fields[4]
    return busy / os.sysconf("SC_CLK_TCK")


def _own_seconds() -> float:
    """CPU-seconds this process has used (all threads)."""
    t = os.times()
    return t.user + t.system


class ThreadGovernor:
    """Sets ``torch.set_num_threads`` to the cores not kept busy by other processes.

    Args:
        num_threads: a fixed thread count, or ``None`` to adapt between 1 and :func:`available_cores`.
        interval: seconds between measurements.

    Every ``interval`` seconds :meth:`maybe_adjust` measures the cores other processes used since the last
    measurement, ``others = Δ(system busy CPU-s) − Δ(own CPU-s)`` over ``Δt``, and uses
    ``max(1, cores − ceil(others − 0.5))`` threads.
    """

    def __init__(self, num_threads: int | None, interval: float = 1.0):
        self.max_threads = num_threads or available_cores()
        self._cores = {f"cpu{i}" for i in os.sched_getaffinity(0)}
        busy = _busy_seconds(self._cores)
        self.adaptive = num_threads is None and busy is not None
        self.interval = interval
        self.num_threads = self.max_threads
        torch.set_num_threads(self.num_threads)
        self._last = (time.monotonic(), busy, _own_seconds())

    def maybe_adjust(self) -> int:
        """Re-measure if ``interval`` has passed; return the thread count in use."""
        if not self.adaptive:
            return self.num_threads
        now = time.monotonic()
        if now - self._last[0] < self.interval:
            return self.num_threads
        busy, own = _busy_seconds(self._cores), _own_seconds()
        last_t, last_busy, last_own = self._last
        self._last = (now, busy, own)
        others = max(0.0, ((busy - last_busy) - (own - last_own)) / (now - last_t))
        wanted = max(1, self.max_threads - math.ceil(others - 0.5))
        if wanted != self.num_threads:
            self.num_threads = wanted
            torch.set_num_threads(wanted)
        return self.num_threads
