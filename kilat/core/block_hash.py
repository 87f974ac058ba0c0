"""Content-addressed KV block hashes: the same tokens after the same prefix get the same hash in every process and
every engine (prefix caching, the data-parallel router, KV offload and transfer).

A full block's hash is ``sha256(parent hash ‖ lengths ‖ token ids ‖ extra keys)``: the parent is the previous
block's hash (:data:`ROOT_HASH` for the first block), so a hash names the whole prefix up to and including its
block; the token ids are 8-byte little-endian integers; the extra keys are the request's ``cache_salt`` (UTF-8)
on the first block only, which through the chain separates every block of a salted request from every block of
other salts and of unsalted requests (vLLM's prefix-caching hash with ``cache_salt``; the lengths make the
encoding unambiguous). SHA-256 (FIPS 180-4) keeps collisions out of reach where two tenants share an engine.
"""

from __future__ import annotations

import hashlib
import struct
from array import array
from collections.abc import Sequence

BlockHash = bytes
"""A full block's key: the 32-byte SHA-256 digest of its prefix (see the module docstring)."""

ROOT_HASH: BlockHash = hashlib.sha256(b"kilat kv block hash v1").digest()
"""The parent of every request's first block."""

MAX_CACHE_SALT_CHARS = 1024
"""The longest ``cache_salt`` a request may carry (characters)."""

_LENGTHS = struct.Struct("<II")


def hash_block(parent: BlockHash, token_ids: Sequence[int], extra_keys: bytes = b"") -> BlockHash:
    """The hash of one full block.

    Args:
        parent: the previous block's hash, or :data:`ROOT_HASH` for the first block.
        token_ids: the block's token ids (``block_size`` of them, each in [0, 2**63)).
        extra_keys: bytes that must also match for a hit (the UTF-8 ``cache_salt`` on the first block).

    Returns:
        The 32-byte digest.
    """
    digest = hashlib.sha256(parent)
    digest.update(_LENGTHS.pack(len(token_ids), len(extra_keys)))
    digest.update(array("q", token_ids).tobytes())
    digest.update(extra_keys)
    return digest.digest()


def extend_block_hashes(hashes: list[BlockHash], token_ids: Sequence[int], block_size: int,
                        cache_salt: str | None = None) -> list[BlockHash]:
    """Append to ``hashes`` (the hashes of ``token_ids``' first full blocks, computed earlier) the hashes of the
    full blocks that follow, and return it.

    Args:
        hashes: the hashes so far (extended in place).
        token_ids: all the tokens known (prompt and output).
        block_size: tokens per block.
        cache_salt: the request's salt, or ``None``.
    """
    parent = hashes[-1] if hashes else ROOT_HASH
    salt = cache_salt.encode() if cache_salt else b""
    for i in range(len(hashes), len(token_ids) // block_size):
        parent = hash_block(parent, token_ids[i * block_size:(i + 1) * block_size], salt if i == 0 else b"")
        hashes.append(parent)
    return hashes


def block_hashes(token_ids: Sequence[int], block_size: int, cache_salt: str | None = None) -> list[BlockHash]:
    """The hashes of ``token_ids``' full blocks, block ``i``'s covering blocks ``0 .. i``."""
    return extend_block_hashes([], token_ids, block_size, cache_salt)


def check_cache_salt(cache_salt: object) -> str | None:
    """Validate a request's ``cache_salt`` (vLLM's field).

    Raises:
        ValueError: naming ``cache_salt``: not a string, empty, longer than :data:`MAX_CACHE_SALT_CHARS`, or not
            encodable as UTF-8 (a lone surrogate).
    """
    if cache_salt is None:
        return None
    if not isinstance(cache_salt, str) or not cache_salt:
        raise ValueError(f"cache_salt must be a non-empty string, got {cache_salt!r:.80}")
    if len(cache_salt) > MAX_CACHE_SALT_CHARS:
        raise ValueError(f"cache_salt must be at most {MAX_CACHE_SALT_CHARS} characters, got {len(cache_salt)}")
    try:
        cache_salt.encode()
    except UnicodeEncodeError as e:
        raise ValueError(f"cache_salt is not valid Unicode text: {e.reason} at character {e.start}") from e
    return cache_salt
