"""The scheduler's queue of waiting requests, one per scheduling policy (vLLM's ``--scheduling-policy``).

- ``fcfs``: arrival order; a preempted request goes back to the front (it arrived before anything waiting).
- ``priority``: by ``(priority, arrival_time)``, lower first (vLLM's order: a request's ``priority`` field, 0 by
  default; ties by arrival); a preempted request goes back by the same key.

The scheduler preempts, when a running request cannot get blocks, the running request this policy ranks last
(:func:`preemption_key`): the newest under ``fcfs``, the lowest priority (highest value), newest first, under
``priority``.
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Iterator

from kilat.config import SCHEDULING_POLICIES
from kilat.core.request import Request


def preemption_key(request: Request, policy: str, position: int) -> tuple[float, ...]:
    """The order in which running requests are preempted, highest first: ``position`` (the running list's,
    admission order) under ``fcfs``; ``(priority, arrival_time, position)`` under ``priority``."""
    if policy == "fcfs":
        return (position,)
    return (request.priority, request.metrics.arrival_time, position)


class RequestQueue:
    """Waiting requests in the order a policy admits them.

    Args:
        policy: one of :data:`SCHEDULING_POLICIES`.

    Raises:
        ValueError: an unknown policy.
    """

    def __init__(self, policy: str = "fcfs") -> None:
        if policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy must be one of {SCHEDULING_POLICIES}, got {policy!r}")
        self.policy = policy
        self._fcfs: deque[Request] = deque()
        self._sorted: list[tuple[int, float, int, Request]] = []  # (priority, arrival, sequence, request)
        self._sequence = 0

    def add(self, request: Request) -> None:
        """Queue a newly arrived request."""
        if self.policy == "fcfs":
            self._fcfs.append(request)
        else:
            self._insert(request)

    def prepend(self, request: Request) -> None:
        """Return a request that was taken out (preempted, or skipped this step) to its place: the front under
        ``fcfs``, its key's place under ``priority``."""
        if self.policy == "fcfs":
            self._fcfs.appendleft(request)
        else:
            self._insert(request)

    def _insert(self, request: Request) -> None:
        self._sequence += 1
        bisect.insort(self._sorted, (request.priority, request.metrics.arrival_time, self._sequence, request),
                      key=lambda entry: entry[:3])

    def peek(self) -> Request:
        """The request to admit next.

        Raises:
            IndexError: the queue is empty.
        """
        return self._fcfs[0] if self.policy == "fcfs" else self._sorted[0][3]

    def pop(self) -> Request:
        """Take out the request to admit next.

        Raises:
            IndexError: the queue is empty.
        """
        return self._fcfs.popleft() if self.policy == "fcfs" else self._sorted.pop(0)[3]

    def remove(self, request: Request) -> None:
        """Take out ``request`` (aborted or finished while waiting).

        Raises:
            ValueError: it is not queued.
        """
        if self.policy == "fcfs":
            self._fcfs.remove(request)
            return
        for i, entry in enumerate(self._sorted):
            if entry[3] is request:
                del self._sorted[i]
                return
        raise ValueError(f"request {request.request_id!r} is not waiting")

    def __iter__(self) -> Iterator[Request]:
        return iter(self._fcfs) if self.policy == "fcfs" else (entry[3] for entry in self._sorted)

    def __len__(self) -> int:
        return len(self._fcfs) if self.policy == "fcfs" else len(self._sorted)

    def __bool__(self) -> bool:
        return len(self) > 0

    def __contains__(self, request: object) -> bool:
        return any(r is request for r in self)
