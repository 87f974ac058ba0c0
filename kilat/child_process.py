"""Helpers for kilat's own child processes started with :mod:`subprocess` (grammar compile workers, model
workers): the engine core runs as a daemonic ``multiprocessing`` process, which may not start
``multiprocessing`` children of its own, so its children are plain interpreters that import kilat."""

from __future__ import annotations

import os
import sys
import threading
import time

_PARENT_CHECK_S = 1.0
"""How often :func:`exit_with_parent` checks that the parent is still alive (seconds)."""


def python_command(code: str) -> list[str]:
    """The command line that runs the Python statements ``code`` in a fresh interpreter with this process's
    ``sys.path`` (as ``multiprocessing``'s spawn does): the same kilat, whatever the working directory."""
    return [sys.executable, "-c", f"import sys; sys.path[:] = {sys.path!r}; {code}"]


def exit_with_parent() -> None:
    """Start a daemon thread that ends this process (``os._exit(0)``) within :data:`_PARENT_CHECK_S` seconds of
    its parent's death, even while the main thread is busy (a compile, a model step, loading)."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(_PARENT_CHECK_S)
        os._exit(0)

    threading.Thread(target=watch, name="kilat-parent-watch", daemon=True).start()
