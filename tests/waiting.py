"""Waiting on a condition instead of a wall-clock deadline: a loaded machine makes things slower, not wrong."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

import pytest

T = TypeVar("T")

PATIENCE_S = 120.0
"""How long a test waits for something that must happen (a process exits, a counter settles, a server answers)
before it fails: long enough for a 2-core machine under a CPU-hungry neighbour, short enough that a wedged run
ends. It bounds a hang; it is not a speed requirement (speed is measured by the benchmarks)."""


def wait_until(condition: Callable[[], T], what: str, timeout_s: float = PATIENCE_S, interval_s: float = 0.05) -> T:
    """Poll ``condition()`` every ``interval_s`` seconds until it returns a truthy value, and return that value.

    Raises:
        pytest.fail.Exception: ``condition`` stayed falsy for ``timeout_s`` seconds; the message says that ``what``
            did not happen.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() >= deadline:
            pytest.fail(f"{what} did not happen within {timeout_s:g} s")
        time.sleep(interval_s)
