"""A grammar compile worker: a child process of the engine core that compiles constraints on request, so that
a compile can be stopped (the process killed) when its request goes away or it runs past its time limit.

Started by :class:`~kilat.structured_outputs.manager.StructuredOutputManager`, which runs :func:`main`.
Messages on stdin and stdout are length-prefixed JSON (:func:`send`, :func:`receive`). The first message in
is the tokenizer (``TokenizerInfo.serialize_json``); the worker answers ``{"ready": true}``. Then each
message in is a ``StructuredOutputsParams`` as a dict, and each answer ``{"seconds": compile time}`` or
``{"error": xgrammar's message}``. The worker exits when stdin closes or its parent (the engine core) is
gone, within a second even in the middle of a compile.
"""

from __future__ import annotations

import dataclasses
import json
import os
import struct
import sys
import time
from typing import IO, Any

from kilat.child_process import exit_with_parent
from kilat.sampling_params import StructuredOutputsParams

_HEADER = struct.Struct(">I")


def send(stream: IO[bytes], message: Any) -> None:
    """Write ``message`` as JSON with a 4-byte big-endian length prefix, and flush."""
    data = json.dumps(message).encode()
    stream.write(_HEADER.pack(len(data)) + data)
    stream.flush()


def receive(stream: IO[bytes]) -> Any | None:
    """Read one message written by :func:`send`; ``None`` at end of stream."""
    header = stream.read(_HEADER.size)
    if len(header) < _HEADER.size:
        return None
    (size,) = _HEADER.unpack(header)
    data = stream.read(size)
    return None if len(data) < size else json.loads(data)


def params_message(params: StructuredOutputsParams) -> dict[str, Any]:
    """The constraint as a JSON-able dict (the inverse of ``StructuredOutputsParams(**message)``)."""
    return dataclasses.asdict(params)


def main() -> None:
    """Serve compile requests until stdin closes or the engine core dies (the module docstring gives the
    protocol)."""
    exit_with_parent()
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # stray prints of libraries go to stderr, never into the message stream
    stdin = sys.stdin.buffer
    import xgrammar as xgr

    from kilat.structured_outputs.grammar import compile_grammar

    tokenizer = receive(stdin)
    if tokenizer is None:
        return
    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo.deserialize_json(tokenizer), max_threads=1,
                                   cache_enabled=False)
    send(out, {"ready": True})
    while (message := receive(stdin)) is not None:
        start = time.perf_counter()
        try:
            compile_grammar(compiler, StructuredOutputsParams(**message))
            send(out, {"seconds": time.perf_counter() - start})
        except Exception as e:  # xgrammar's own errors (RuntimeError, ValueError) go back to the engine core
            send(out, {"error": str(e)})

