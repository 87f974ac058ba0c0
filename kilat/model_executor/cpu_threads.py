"""Torch intra-op threads for the CPU path: every core, unless a foreign process really holds one.

Why back off at all (docs/benchmarks.md, "Thread settings under contention"): torch's intra-op threads meet
at a barrier after every op, so one thread that loses its core stalls them all. Batch-1 decode on the 2-core
machine: 30.6 tokens/s with 2 threads on a quiet machine, 9.6 while another process spins on one core; with
1 thread, 21.9 in both cases.

Why kilat's own processes do not count (docs/benchmarks.md, "Thread policy when served"): when served, the
engine core's parent (the API process: HTTP, SSE, detokenization) is busy whenever the core is. The first
governor counted it, and the client, as other load and ran one thread: W6 at concurrency 16 gave 88 output
tokens/s against 201 with ``--num-threads 2``. The API process's work is the engine's own output, and a light
client's load stays under :data:`HOLD_CORES`: neither holds a core against kilat.
"""

from __future__ import annotations

import dataclasses
import glob
import logging
import math
import os
import time
from collections import deque
from typing import Any

import torch

logger = logging.getLogger("kilat")

HOLD_CORES = 0.4
"""Foreign CPU load (in cores) that counts as holding a core. A process spinning on one core gets only
``n / (n + 1)`` of a core (⅔ on 2 cores) while kilat's ``n`` threads compete with it, and ½ on 2 cores while
the API process runs too, so the threshold must lie below ½ to notice it at all. A light loopback client stays
below it (``benchmarks/thread_policy.py`` records the client's CPU use next to the throughput)."""

SUSTAIN_S = 3.0
"""Seconds a foreign load must hold a core before a thread is dropped (a spike does not). Measurements are
weighted by the time they span: one that covers an idle spell of the engine (nothing runs, nothing is
measured) counts for all of it, so a neighbour that started while kilat was idle is met at the first step."""


def take_cpu_share(config: Any, index: int, parts: int, what: str) -> Any:
    """Pin this process (and the threads and processes it starts later) to share ``index`` of ``parts``
    contiguous shares of its CPU cores (``os.sched_setaffinity``, ``cores // parts`` each), so that ``parts``
    processes do not take each other's cores; with fewer cores than parts, leave it unpinned with one thread.
    ``what`` names a part in the log (``"rank"``). Returns the engine config ``config`` with ``num_threads``
    capped at the share (1 when unpinned)."""
    cores = sorted(os.sched_getaffinity(0))
    share = len(cores) // parts
    if share == 0:
        logger.warning("%d %ss on %d CPU cores; one thread each, unpinned", parts, what, len(cores))
        return dataclasses.replace(config, num_threads=1)
    mine = cores[index * share:(index + 1) * share]
    os.sched_setaffinity(0, mine)
    logger.info("%s %d of %d runs on CPU cores %s", what, index, parts, mine)
    num_threads = None if config.num_threads is None else min(config.num_threads, share)
    return dataclasses.replace(config, num_threads=num_threads)


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


def _process_seconds(pid: int) -> float | None:
    """CPU-seconds (user + system, all threads) process ``pid`` has used (``/proc/PID/stat``), or ``None``
    when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()  # the command name may contain spaces
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _children(pid: int) -> list[int]:
    """Child process ids of ``pid`` (``/proc/PID/task/*/children``)."""
    kids: list[int] = []
    for path in glob.glob(f"/proc/{pid}/task/*/children"):
        try:
            with open(path) as f:
                kids += [int(x) for x in f.read().split()]
        except OSError:
            pass
    return kids


def _family_seconds(parent: int | None) -> dict[int, float]:
    """CPU-seconds per process of kilat's own family other than this process: the engine core's frontend
    (``parent``: the API process, or the offline user's process, that started the engine-core process) and
    its other children. Empty for ``None``: an in-process engine (whose threads :func:`_own_seconds` counts)
    has no family, even when it runs in a process pool's worker (the pool's other workers are neighbours).
    This process's own children (structured-output compile workers) are not family: a compile holds a core
    for as long as it runs, which stalls the torch threads as any neighbour does."""
    if parent is None:
        return {}
    me = os.getpid()
    seconds = {}
    for pid in [parent, *_children(parent)]:
        if pid != me and (s := _process_seconds(pid)) is not None:
            seconds[pid] = s
    return seconds


class ThreadGovernor:
    """Sets ``torch.set_num_threads`` to every core except those a foreign process holds.

    Args:
        num_threads: a fixed thread count, or ``None`` to adapt between 1 and :func:`available_cores`.
        frontend_pid: the process that started this engine-core process (its family is kilat's own load),
            or ``None`` for an in-process engine.
        interval: seconds between measurements.

    Every ``interval`` seconds :meth:`maybe_adjust` measures the foreign load on this process's cores since
    the last measurement, ``foreign = (Δ busy CPU-s of the cores − Δ own CPU-s − Δ family CPU-s) / Δt``, in
    cores, where the family is kilat's API process and its other children (:func:`_family_seconds`). A
    measurement finds ``held = floor(foreign + 1 − HOLD_CORES)`` cores held; the governor runs
    ``max(1, cores − held)`` threads, with ``held`` the least over the measurements that span the last
    :data:`SUSTAIN_S` seconds: a thread is dropped only after a foreign load has held its core that long, and
    comes back after the first measurement that finds the core free.
    """

    def __init__(self, num_threads: int | None, frontend_pid: int | None = None, interval: float = 1.0):
        self.max_threads = num_threads or available_cores()
        self._cores = {f"cpu{i}" for i in os.sched_getaffinity(0)}
        self._parent = frontend_pid
        busy = _busy_seconds(self._cores)
        self.adaptive = num_threads is None and busy is not None
        self.interval = interval
        self.num_threads = self.max_threads
        torch.set_num_threads(self.num_threads)
        self._held: deque[tuple[int, float]] = deque()  # (cores held, seconds measured), newest last
        self._last = (time.monotonic(), busy, _own_seconds(), _family_seconds(self._parent))

    def _sustained_hold(self) -> int:
        """Cores held throughout the last :data:`SUSTAIN_S` seconds of measurements (0 until that much was
        measured); forgets measurements older than that."""
        held, covered = None, 0.0
        for i, (cores, seconds) in enumerate(reversed(self._held)):
            held = cores if held is None else min(held, cores)
            covered += seconds
            if covered >= SUSTAIN_S:
                for _ in range(len(self._held) - i - 1):
                    self._held.popleft()
                return held
        return 0

    def maybe_adjust(self) -> int:
        """Re-measure if ``interval`` has passed; return the thread count in use."""
        if not self.adaptive:
            return self.num_threads
        now = time.monotonic()
        if now - self._last[0] < self.interval:
            return self.num_threads
        busy, own, family = _busy_seconds(self._cores), _own_seconds(), _family_seconds(self._parent)
        last_t, last_busy, last_own, last_family = self._last
        self._last = (now, busy, own, family)
        family_delta = sum(max(0.0, s - last_family.get(pid, 0.0)) for pid, s in family.items())
        foreign = max(0.0, ((busy - last_busy) - (own - last_own) - family_delta) / (now - last_t))
        self._held.append((math.floor(foreign + 1 - HOLD_CORES), now - last_t))
        held = self._sustained_hold()
        wanted = max(1, self.max_threads - held)
        if wanted != self.num_threads:
            logger.info("CPU threads %d -> %d (processes outside kilat used %.2f cores over the last %.1f s)",
                        self.num_threads, wanted, foreign, now - last_t)
            self.num_threads = wanted
            torch.set_num_threads(wanted)
        return self.num_threads
