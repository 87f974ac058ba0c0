"""The wire format of :mod:`kilat.kv_connector.tcp` (disaggregated prefill/decode over TCP), and the check of a
request's ``kv_transfer_params``.

One TCP connection carries one pull, the consumer (decode instance) speaking first:

1. consumer → producer, a frame: ``{"version", "namespace", "engine_id", "request_id", "first_block",
   "hashes"}`` — the producer's engine and request (from the ``kv_transfer_params`` the producer returned),
   the first prompt block wanted and the content hashes (hex, :mod:`kilat.core.block_hash`) of the blocks
   wanted from there on. No hashes: the consumer needs nothing (its own prefix cache had the blocks) and the
   producer may free them.
2. producer → consumer, a frame: ``{"ok": true, "num_blocks", "bytes_per_block"}`` or ``{"ok": false,
   "error"}``; then ``num_blocks`` records of ``bytes_per_block`` payload bytes (:class:`~kilat.kv_connector.
   block_io.BlockIO`'s layout) followed by the payload's CRC-32 (4 bytes, little-endian).

A frame is a 4-byte little-endian length and that many bytes of UTF-8 JSON (at most :data:`MAX_FRAME_BYTES`).
"""

from __future__ import annotations

import json
import socket
import time
import zlib
from typing import Any

PROTOCOL_VERSION = 1
"""The ``version`` a producer accepts."""

MAX_FRAME_BYTES = 4 << 20
"""The largest JSON frame either side reads (a request's hashes: about 70 bytes per block)."""

CRC_BYTES = 4


class TransferError(Exception):
    """A pull failed: the peer closed early, broke the protocol, refused it, or a block's checksum was wrong."""


def send_frame(sock: socket.socket, message: dict[str, Any]) -> None:
    """Send one JSON frame."""
    data = json.dumps(message).encode()
    sock.sendall(len(data).to_bytes(4, "little") + data)


def recv_exactly(sock: socket.socket, size: int, deadline: float | None = None) -> bytearray:
    """Exactly ``size`` bytes, by ``deadline`` (``time.monotonic()`` seconds) when given.

    Raises:
        TransferError: the peer closed the connection first (a truncated transfer), or the deadline passed.
        OSError: the socket failed or timed out (its own timeout bounds each read).
    """
    buffer = bytearray(size)
    view = memoryview(buffer)
    got = 0
    while got < size:
        if deadline is not None and time.monotonic() > deadline:
            raise TransferError(f"too slow: {got} of {size} bytes by the deadline")
        n = sock.recv_into(view[got:])
        if n == 0:
            raise TransferError(f"the connection closed after {got} of {size} bytes")
        got += n
    return buffer


def recv_frame(sock: socket.socket, deadline: float | None = None) -> dict[str, Any]:
    """One JSON frame (an object), by ``deadline`` when given.

    Raises:
        TransferError: truncated, too slow, larger than :data:`MAX_FRAME_BYTES`, or not a JSON object.
        OSError: the socket failed or timed out.
    """
    size = int.from_bytes(recv_exactly(sock, 4, deadline), "little")
    if size > MAX_FRAME_BYTES:
        raise TransferError(f"a frame of {size} bytes (the limit is {MAX_FRAME_BYTES})")
    try:
        message = json.loads(recv_exactly(sock, size, deadline))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise TransferError(f"a frame that is not JSON: {type(e).__name__}") from None
    if not isinstance(message, dict):
        raise TransferError("a frame that is not a JSON object")
    return message


def block_record(payload: bytes) -> bytes:
    """A block's record on the wire: the payload and its CRC-32."""
    return payload + zlib.crc32(payload).to_bytes(CRC_BYTES, "little")


def check_block_record(record: bytearray, index: int) -> memoryview:
    """The payload of a received record.

    Raises:
        TransferError: its CRC-32 does not match (a corrupt block, never to be decoded from).
    """
    view = memoryview(record)
    payload, crc = view[:-CRC_BYTES], view[-CRC_BYTES:]
    if zlib.crc32(payload) != int.from_bytes(crc, "little"):
        raise TransferError(f"block {index} of the transfer is corrupt (CRC-32 mismatch)")
    return payload


_STRINGS = {"remote_engine_id": 128, "remote_host": 255, "remote_request_id": 256}


def check_kv_transfer_params(params: object) -> dict[str, Any] | None:
    """Validate a request's ``kv_transfer_params`` (vLLM's field; other keys, such as vLLM's ``remote_block_ids``,
    are ignored).

    ``{"do_remote_decode": true}`` asks a producer to keep the prompt's KV for a decode instance;
    ``{"do_remote_prefill": true, "remote_engine_id", "remote_host", "remote_port", "remote_request_id"}`` (what a
    producer returned) asks a consumer to pull it from there.

    Raises:
        ValueError: not an object, a flag that is not a boolean, both flags, a pull without its address, or a
            value of the wrong type or size; the message names ``kv_transfer_params.<key>``.
    """
    if params is None:
        return None
    if not isinstance(params, dict):
        raise ValueError(f"kv_transfer_params must be an object, got {type(params).__name__}")
    for key in ("do_remote_decode", "do_remote_prefill"):
        if not isinstance(params.get(key, False), bool):
            raise ValueError(f"kv_transfer_params.{key} must be a boolean, got {params[key]!r}")
    if params.get("do_remote_decode") and params.get("do_remote_prefill"):
        raise ValueError("kv_transfer_params: do_remote_decode and do_remote_prefill cannot both be true")
    if not params.get("do_remote_prefill"):
        return params
    for key, limit in _STRINGS.items():
        value = params.get(key)
        if not isinstance(value, str) or not 0 < len(value) <= limit:
            raise ValueError(f"kv_transfer_params.{key} must be a string of 1 to {limit} characters, got {value!r}")
    port = params.get("remote_port")
    if not isinstance(port, int) or isinstance(port, bool) or not 1 <= port <= 65535:
        raise ValueError(f"kv_transfer_params.remote_port must be in [1, 65535], got {port!r}")
    return params
