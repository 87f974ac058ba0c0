"""The converted-GGUF cache under ``$KILAT_CACHE_DIR/gguf``: content keys, complete folders, pruning.

Layout:

- ``sha256-<first 16 hex digits of the GGUF's sha256>/``: one converted checkpoint per distinct GGUF *content*,
  so copies of a file, or a reinstall that gives it a new mtime, share one folder. Its manifest
  ``kilat-cache.json`` (``{"sha256", "conversion", "source", "files": {name: bytes}}``) is written last; a folder
  whose manifest is missing, names another digest or an older :data:`CONVERSION_VERSION`, or disagrees with the
  files' sizes is never used (it is converted again).
- ``digests.json``: the sha256 of every GGUF seen, by real path, with the ``(size, mtime_ns, ctime_ns)`` it was
  computed at; while those are unchanged a start reads the digest from here instead of the whole file.
- ``.<key>.<random>/``: a conversion in progress; its writer holds an ``flock`` on ``.lock`` inside it until
  the folder is renamed into place (an abandoned one, whose lock nobody holds, is pruned).
- ``.lock``: serializes updates of ``digests.json``, renames into place and pruning between processes.

A folder is current while some path in ``digests.json`` that still exists was last seen with its digest;
the others (the GGUF was deleted or its content changed, or a folder of an older cache layout) are pruned.
POSIX only (``fcntl``).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import shutil
from collections.abc import Iterator
from typing import Any

logger = logging.getLogger("kilat")

KEY_PREFIX = "sha256-"
MANIFEST = "kilat-cache.json"
DIGESTS = "digests.json"
LOCK = ".lock"
CONVERSION_VERSION = 2
"""The version of what a conversion writes, recorded in each manifest; bumped whenever the converter's output
changes, so that folders written by older code are converted again rather than reused. 2: MoE GGUFs' experts
(Qwen2/3-MoE's ``expert_feed_forward_length``, Mixtral's experts that transformers drops), 2026-12-04; 1 (no
``conversion`` field): earlier."""


def kilat_cache_dir() -> str:
    """``$KILAT_CACHE_DIR``, or ``~/.cache/kilat``."""
    return os.environ.get("KILAT_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "kilat")


def gguf_cache_root() -> str:
    """The folder of converted GGUF checkpoints, ``$KILAT_CACHE_DIR/gguf`` (created)."""
    root = os.path.join(kilat_cache_dir(), "gguf")
    os.makedirs(root, exist_ok=True)
    return root


def cache_key(digest: str) -> str:
    """The folder name of a GGUF whose sha256 (hex) is ``digest``."""
    return KEY_PREFIX + digest[:16]


@contextlib.contextmanager
def file_lock(path: str, blocking: bool = True) -> Iterator[bool]:
    """Hold an exclusive ``flock`` on ``path`` (created if missing) for the ``with`` block.

    Yields:
        whether the lock is held: always ``True`` when ``blocking``; ``False`` when another open file holds it.
    """
    fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
            held = True
        except BlockingIOError:
            held = False
        yield held
    finally:
        os.close(fd)


def file_sha256(path: str) -> str:
    """The sha256 of a file's bytes (hex), read in chunks."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def gguf_digest(path: str) -> tuple[str, bool]:
    """The sha256 (hex) of the GGUF file at ``path``, and whether it had to be computed.

    It is read from ``digests.json`` while the file's size, mtime and ctime are those it was recorded with;
    otherwise the file is hashed (about 0.3 s per 100 MB) and recorded.
    """
    root = gguf_cache_root()
    real = os.path.realpath(path)
    stat = os.stat(real)
    seen = [stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns]
    entry = _read_digests(root).get(real)
    if entry is not None and entry.get("stat") == seen and isinstance(entry.get("sha256"), str):
        return entry["sha256"], False
    digest = file_sha256(real)
    with file_lock(os.path.join(root, LOCK)):
        digests = _read_digests(root)
        digests[real] = {"stat": seen, "sha256": digest}
        _write_json(os.path.join(root, DIGESTS), digests)
    return digest, True


def write_manifest(folder: str, digest: str, source: str) -> None:
    """Record the files of a finished conversion in ``folder`` (call last, before renaming it into place)."""
    files = {}
    for directory, _, names in os.walk(folder):
        for name in names:
            rel = os.path.relpath(os.path.join(directory, name), folder)
            if rel not in (MANIFEST, LOCK):
                files[rel] = os.path.getsize(os.path.join(folder, rel))
    _write_json(os.path.join(folder, MANIFEST),
                {"sha256": digest, "conversion": CONVERSION_VERSION, "source": source, "files": files})


def is_complete(folder: str, digest: str) -> bool:
    """Whether ``folder`` holds a whole, current conversion of the GGUF with sha256 ``digest``: its manifest names
    that digest and :data:`CONVERSION_VERSION`, and every file it lists is there with the listed size."""
    try:
        with open(os.path.join(folder, MANIFEST)) as f:
            manifest = json.load(f)
        return manifest["sha256"] == digest and manifest.get("conversion") == CONVERSION_VERSION and all(
            os.path.getsize(os.path.join(folder, rel)) == size for rel, size in manifest["files"].items())
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return False


def prune(root: str, keep: str) -> list[str]:
    """Delete what is no longer current in the cache folder ``root`` (hold its ``.lock`` while calling).

    Removed: folders that no existing path in ``digests.json`` was last seen with (see the module docstring),
    except ``keep``; conversions in progress whose writer has gone (their ``.lock`` is free). Kept: whatever
    another process is writing. The entries of deleted files are dropped from ``digests.json``.

    Returns:
        the names of the removed folders, each also logged.
    """
    digests = {p: e for p, e in _read_digests(root).items() if os.path.exists(p)}
    _write_json(os.path.join(root, DIGESTS), digests)
    live = {keep} | {cache_key(e["sha256"]) for e in digests.values() if isinstance(e.get("sha256"), str)}
    removed = []
    for name in sorted(os.listdir(root)):
        path = os.path.join(root, name)
        if not os.path.isdir(path) or name in live:
            continue
        if name.startswith("."):
            if not os.path.exists(os.path.join(path, LOCK)):
                continue  # just created: its writer takes the lock next
            with file_lock(os.path.join(path, LOCK), blocking=False) as free:
                if not free:
                    continue  # a conversion in progress
            reason = "an abandoned conversion"
        elif name.startswith(KEY_PREFIX):
            reason = "a converted model whose GGUF file is gone or has changed"
        else:
            reason = "a folder of an older cache layout"
        size = sum(os.path.getsize(os.path.join(d, n)) for d, _, names in os.walk(path) for n in names)
        shutil.rmtree(path, ignore_errors=True)
        logger.info("pruned %s from the GGUF cache: %s (%.0f MB freed)", path, reason, size / 1e6)
        removed.append(name)
    return removed


def _read_digests(root: str) -> dict[str, dict[str, Any]]:
    try:
        with open(os.path.join(root, DIGESTS)) as f:
            digests = json.load(f)
    except (OSError, ValueError):
        return {}
    return {p: e for p, e in digests.items() if isinstance(e, dict)} if isinstance(digests, dict) else {}


def _write_json(path: str, value: Any) -> None:
    """Write ``value`` to ``path`` atomically (a temporary file renamed over it)."""
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(value, f, indent=1)
    os.replace(tmp, path)
