"""How kilat's processes start and end: helpers for its own child processes started with :mod:`subprocess`
(grammar compile workers, model workers: the engine core runs as a daemonic ``multiprocessing`` process, which may
not start ``multiprocessing`` children of its own, so its children are plain interpreters that import kilat), and
:func:`exit_now` for the end of a process's run."""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import sys
import threading
import time
from typing import NoReturn

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


def exit_now(code: int = 0) -> NoReturn:
    """End this process with status ``code`` as the interpreter would, without its teardown.

    Call it from the main thread. It does what ``Py_Finalize`` does first: ``threading``'s own shutdown (its atexit
    callbacks, which wake idle ``concurrent.futures`` workers, then a join of every non-daemon thread), the
    ``atexit`` handlers (``weakref.finalize`` callbacks and ``multiprocessing``'s clean-up among them), and a flush
    of logging and the standard streams; then the process ends (``os._exit``). Skipped is the interpreter's own
    teardown: module clean-up and the final garbage collections over torch's, transformers' and Triton's objects,
    about a second of CPU per process, for memory the operating system frees anyway; so a file object left open
    (not closed, not flushed) loses its buffer, as after ``os._exit``. Only for the end of a process's whole run:
    the engine core, a model worker, the ``kilat`` command.
    """
    threading._shutdown()  # what the interpreter runs first at exit (private, but stable since Python 3.4)
    atexit._run_exitfuncs()
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # closed, or a pipe whose reader left
            stream.flush()
    os._exit(code)
