"""Request-supplied chat templates, rendered in a child process with a time and a memory bound.

A chat template is a Jinja program. jinja2's sandbox (which transformers uses) blocks unsafe attribute access
and caps one ``range()`` at 100,000 items, but nested loops still run for hours and string building can take
all memory. So a template that comes with a request (served only with ``--trust-request-chat-template``) is
rendered by the model's own tokenizer (transformers' ``apply_chat_template``, so the text equals the normal
path's) in a child process: the server waits for it at most :data:`RENDER_TIMEOUT_S` without blocking its
event loop or tokenizer thread, and kills and restarts it when it takes longer, so neither other requests
nor shutdown ever wait on a stuck render. The child's address space is capped at :data:`MEMORY_LIMIT_BYTES`
above what it holds after start-up.

Run as a script, this file is the child: it imports only the standard library and (through the pickled
tokenizer) transformers, not kilat or torch, so it starts in about a second. The parent sends pickled jobs
(it is trusted); the child answers in JSON. Each message is an 8-byte big-endian length and a payload.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import pickle
import struct
import sys
from typing import Any

RENDER_TIMEOUT_S = 5.0
"""Longest time one request-supplied template may render (seconds); longer renders get a 400."""
MEMORY_LIMIT_BYTES = 1 << 30
"""Address space the child may take beyond what it holds after loading the tokenizer (bytes)."""
START_TIMEOUT_S = 120.0
"""Longest wait for a new child to load the tokenizer (seconds); not counted in the render time."""

_HEADER = struct.Struct(">Q")


class RendererUnavailable(Exception):
    """The renderer cannot take a template now: its process failed to start (or took longer than
    :data:`START_TIMEOUT_S`), or earlier renders kept it busy longer than the render time limit. The server's
    fault or load, not the template's: a 503."""


class ChatTemplateWorker:
    """Renders chat templates in a killable child process (one render at a time; a render that waits for
    the one before it longer than ``timeout_s`` is refused, so stuck templates cannot queue up a backlog).

    Args:
        tokenizer: the model's Hugging Face tokenizer (pickled once and loaded by each child).
        max_output_chars: longest rendered text accepted (characters); a longer one could not be a prompt.
        timeout_s: render time limit (seconds).
        memory_limit_bytes: the child's address-space allowance beyond its start-up size (bytes).

    Must be used from one event loop; built where nothing else uses ``tokenizer`` (pickling a fast
    tokenizer while another thread calls it fails), e.g. in the engine's tokenizer thread. :meth:`close`
    kills the child.
    """

    def __init__(self, tokenizer: Any, max_output_chars: int, timeout_s: float = RENDER_TIMEOUT_S,
                 memory_limit_bytes: int = MEMORY_LIMIT_BYTES):
        self._tokenizer_pickle = pickle.dumps(tokenizer)
        self.max_output_chars = max_output_chars
        self.timeout_s = timeout_s
        self.memory_limit_bytes = memory_limit_bytes
        self._proc: asyncio.subprocess.Process | None = None
        self._lock: asyncio.Lock | None = None

    @property
    def pid(self) -> int | None:
        """The running child's process id, or ``None``."""
        return self._proc.pid if self._proc is not None and self._proc.returncode is None else None

    async def render(self, call: dict[str, Any]) -> str:
        """``tokenizer.apply_chat_template(**call)`` in the child (see
        :meth:`~kilat.engine.input_processor.InputProcessor.chat_template_call`).

        Cancelling the caller kills a render in progress.

        Raises:
            ValueError: naming ``chat_template``: the template failed, took longer than the time limit or
                more memory than the limit, or rendered more than ``max_output_chars`` characters.
            RendererUnavailable: the child failed to start, or the renders before this one held the
                renderer longer than the time limit.
        """
        if self._lock is None:
            self._lock = asyncio.Lock()
        try:
            await asyncio.wait_for(self._lock.acquire(), self.timeout_s)
        except TimeoutError as e:
            raise RendererUnavailable(f"the chat-template renderer is busy with other requests' templates for "
                                      f"more than {self.timeout_s:g} s; retry later") from e
        try:
            proc = await self._started()
            job = pickle.dumps({"call": call, "max_output_chars": self.max_output_chars})
            try:
                assert proc.stdin is not None
                proc.stdin.write(_HEADER.pack(len(job)) + job)
                await proc.stdin.drain()
                reply = await asyncio.wait_for(_read_message(proc), self.timeout_s)
            except TimeoutError as e:
                await self.close()
                raise ValueError(f"chat_template took longer than {self.timeout_s:g} s to render (the limit for "
                                 f"a request's chat template)") from e
            except (OSError, EOFError, asyncio.IncompleteReadError) as e:
                await self.close()
                raise ValueError("chat_template: the renderer process died while rendering (likely out of "
                                 f"memory: the limit is {self.memory_limit_bytes >> 20} MiB)") from e
            except BaseException:  # cancelled mid-render: the reply would answer the next job
                self._kill()
                raise
        finally:
            self._lock.release()
        if "error" in reply:
            raise ValueError(f"chat_template failed: {reply['error']}")
        return reply["text"]

    async def _started(self) -> asyncio.subprocess.Process:
        """The child, started (and its tokenizer loaded) when there is none.

        Raises:
            RendererUnavailable: the child could not be started, died while starting or did not load the
                tokenizer within :data:`START_TIMEOUT_S`.
            ValueError: the child reported that it cannot load the tokenizer.
        """
        if self._proc is not None and self._proc.returncode is None:
            return self._proc
        try:
            self._proc = await asyncio.create_subprocess_exec(
                sys.executable, __file__, str(self.memory_limit_bytes), stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE, env={**os.environ, "PYTHONSAFEPATH": "1"})
            assert self._proc.stdin is not None
            self._proc.stdin.write(_HEADER.pack(len(self._tokenizer_pickle)) + self._tokenizer_pickle)
            await self._proc.stdin.drain()
            ready = await asyncio.wait_for(_read_message(self._proc), START_TIMEOUT_S)
        except (OSError, EOFError, asyncio.IncompleteReadError, TimeoutError) as e:
            await self.close()
            raise RendererUnavailable(f"the chat-template renderer process failed to start "
                                      f"({type(e).__name__}: {e})") from e
        except BaseException:
            self._kill()
            raise
        if "error" in ready:
            await self.close()
            raise ValueError(f"chat_template: the renderer process failed to start: {ready['error']}")
        return self._proc

    async def close(self) -> None:
        """Kill the child, if any, and reap it (a later render starts a new one)."""
        proc = self._kill()
        if proc is not None:
            await proc.wait()

    def _kill(self) -> asyncio.subprocess.Process | None:
        """Kill the child without waiting for it; return it."""
        proc, self._proc = self._proc, None
        if proc is not None and proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
        return proc


async def _read_message(proc: asyncio.subprocess.Process) -> dict[str, Any]:
    """One JSON reply of the child."""
    assert proc.stdout is not None
    (size,) = _HEADER.unpack(await proc.stdout.readexactly(_HEADER.size))
    return json.loads(await proc.stdout.readexactly(size))


def _read_job(stream: Any) -> Any:
    header = stream.read(_HEADER.size)
    if len(header) < _HEADER.size:
        raise EOFError
    (size,) = _HEADER.unpack(header)
    return pickle.loads(stream.read(size))


def _reply(stream: Any, message: dict[str, Any]) -> None:
    data = json.dumps(message).encode()
    stream.write(_HEADER.pack(len(data)) + data)
    stream.flush()


def _limit_child(memory_limit_bytes: int) -> None:
    """Die with the parent (Linux), and cap the address space at its current size plus the allowance."""
    import ctypes
    import resource
    import signal

    with contextlib.suppress(AttributeError, OSError):
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: a stuck render dies with the server
    try:
        with open("/proc/self/status") as f:
            size = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
    except (OSError, StopIteration):
        return
    resource.setrlimit(resource.RLIMIT_AS, (size + memory_limit_bytes, size + memory_limit_bytes))


def _serve(memory_limit_bytes: int) -> None:
    """The child: load the tokenizer, then render jobs until stdin closes."""
    stdin, stdout = sys.stdin.buffer, os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # a stray print (a template's library, transformers) goes to stderr, never into the replies
    try:
        tokenizer = _read_job(stdin)
    except EOFError:
        return
    except Exception as e:
        _reply(stdout, {"error": f"{type(e).__name__}: {e}"})
        return
    _limit_child(memory_limit_bytes)
    _reply(stdout, {"ready": True})
    while True:
        try:
            job = _read_job(stdin)
        except EOFError:
            return
        try:
            text = tokenizer.apply_chat_template(**job["call"])
        except MemoryError:
            return  # the parent reports the limit; a fresh child takes the next job
        except Exception as e:
            _reply(stdout, {"error": str(e) or type(e).__name__})
            continue
        if not isinstance(text, str):
            _reply(stdout, {"error": f"rendered {type(text).__name__}, not text"})
        elif len(text) > job["max_output_chars"]:
            _reply(stdout, {"error": f"rendered {len(text)} characters, more than a prompt can hold "
                                     f"({job['max_output_chars']})"})
        else:
            _reply(stdout, {"text": text})


if __name__ == "__main__":
    _serve(int(sys.argv[1]))
