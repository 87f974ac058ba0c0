"""The disk tier's files: one file per KV block, named by the block's hash, written atomically and checked on read.

A file is ``MAGIC ‖ payload length (8 bytes, little-endian) ‖ CRC-32 of the payload (4 bytes) ‖ payload``, the
payload being the block's bytes in every KV tensor in turn (:class:`~kilat.kv_connector.offloading
.OffloadingConnector` lays it out). A writer writes ``<name>.tmp-<pid>`` and renames it, so a crash never leaves a
truncated file under a block's name; a reader checks the magic, the length and the CRC (zlib's, ISO 3309), so a
truncated or corrupt file is refused, never loaded.
"""

from __future__ import annotations

import contextlib
import os
import struct
import zlib
from pathlib import Path

from kilat.core.block_hash import BlockHash

MAGIC = b"KILATKV1"
_HEADER = struct.Struct("<8sQI")
HEADER_BYTES = _HEADER.size
"""Bytes before the payload."""


class CorruptBlockError(ValueError):
    """A block file is missing, truncated, of the wrong size or fails its checksum."""


class DiskBlockStore:
    """Block files in one directory (the caller's namespace: one model and KV layout).

    Args:
        directory: created if missing.
        payload_bytes: every block's payload size.
    """

    def __init__(self, directory: str | os.PathLike, payload_bytes: int):
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.payload_bytes = payload_bytes
        self.file_bytes = HEADER_BYTES + payload_bytes

    def path(self, block_hash: BlockHash) -> Path:
        """The file of a block."""
        return self.directory / f"{block_hash.hex()}.kv"

    def scan(self) -> list[BlockHash]:
        """The blocks stored, least recently used (oldest modification time) first. Files of the wrong size and
        leftover temporary files are deleted."""
        found = []
        for entry in os.scandir(self.directory):
            name = entry.name
            if ".tmp-" in name:
                with contextlib.suppress(OSError):
                    os.unlink(entry.path)
                continue
            if not name.endswith(".kv"):
                continue
            try:
                block_hash = bytes.fromhex(name[:-3])
                stat = entry.stat()
            except (ValueError, OSError):
                continue
            if len(block_hash) != 32 or stat.st_size != self.file_bytes:
                with contextlib.suppress(OSError):
                    os.unlink(entry.path)
                continue
            found.append((stat.st_mtime_ns, block_hash))
        return [h for _, h in sorted(found)]

    def write(self, block_hash: BlockHash, payload: bytes) -> None:
        """Store a block (atomically: a temporary file renamed).

        Raises:
            ValueError: ``payload`` is not ``payload_bytes`` long.
            OSError: the write failed (the temporary file is removed).
        """
        if len(payload) != self.payload_bytes:
            raise ValueError(f"a block payload is {self.payload_bytes} bytes, got {len(payload)}")
        final = self.path(block_hash)
        tmp = final.with_name(f"{final.name}.tmp-{os.getpid()}")
        try:
            with open(tmp, "wb") as f:
                f.write(_HEADER.pack(MAGIC, len(payload), zlib.crc32(payload)))
                f.write(payload)
            os.replace(tmp, final)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise

    def read(self, block_hash: BlockHash) -> bytes:
        """A block's payload, checked; marks the file as recently used.

        Raises:
            CorruptBlockError: missing, truncated, not a block file, or a checksum mismatch.
        """
        path = self.path(block_hash)
        try:
            with open(path, "rb") as f:
                data = f.read(self.file_bytes + 1)
            os.utime(path)
        except OSError as e:
            raise CorruptBlockError(f"block {block_hash.hex()[:16]}: {e}") from e
        if len(data) != self.file_bytes:
            raise CorruptBlockError(f"block {block_hash.hex()[:16]}: {len(data)} bytes, expected {self.file_bytes}")
        magic, length, crc = _HEADER.unpack_from(data)
        payload = data[HEADER_BYTES:]
        if magic != MAGIC or length != self.payload_bytes or zlib.crc32(payload) != crc:
            raise CorruptBlockError(f"block {block_hash.hex()[:16]}: bad header or checksum")
        return payload

    def delete(self, block_hash: BlockHash) -> None:
        """Remove a block's file (no error when it is gone)."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path(block_hash))
