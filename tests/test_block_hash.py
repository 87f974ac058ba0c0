"""Content-addressed block hashes (issue 17, point 1): stable across processes and Python's hash seeds (the disk
tier and other engines rely on it), chained over full blocks only, and separated by ``cache_salt``."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from kilat.core.block_hash import (
    MAX_CACHE_SALT_CHARS,
    ROOT_HASH,
    block_hashes,
    check_cache_salt,
    extend_block_hashes,
    hash_block,
)

TOKENS = list(range(40))


def test_full_blocks_only_and_chained():
    hashes = block_hashes(TOKENS, 16)
    assert len(hashes) == 2 and all(len(h) == 32 for h in hashes)
    assert hashes[0] == hash_block(ROOT_HASH, TOKENS[:16]) and hashes[1] == hash_block(hashes[0], TOKENS[16:32])
    assert block_hashes(TOKENS[:32], 16) == hashes
    assert block_hashes([99, *TOKENS[1:]], 16)[1] != hashes[1]  # a different first block changes every hash
    grown = extend_block_hashes(block_hashes(TOKENS[:20], 16), TOKENS + [5] * 8, 16)
    assert grown == block_hashes(TOKENS + [5] * 8, 16) and len(grown) == 3


def test_the_same_in_every_process_whatever_the_hash_seed():
    code = ("from kilat.core.block_hash import block_hashes; "
            "print(block_hashes(list(range(40)), 16, 'salt')[-1].hex())")
    digests = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                              env=os.environ | {"PYTHONHASHSEED": seed}).stdout.strip() for seed in ("1", "2")}
    assert digests == {block_hashes(TOKENS, 16, "salt")[-1].hex()}


def test_salts_separate_every_block():
    plain, a, b = (block_hashes(TOKENS, 16, salt) for salt in (None, "tenant-a", "tenant-b"))
    assert block_hashes(TOKENS, 16, "tenant-a") == a
    assert not set(plain) & set(a) and not set(a) & set(b) and not set(plain) & set(b)


def test_the_encoding_is_unambiguous():
    """Lengths are hashed: tokens moved into the extra keys (or blocks of other sizes) cannot collide."""
    assert hash_block(ROOT_HASH, [1, 2]) != hash_block(ROOT_HASH, [1], (2).to_bytes(8, "little"))


@pytest.mark.parametrize(("salt", "message"), [
    ("", "cache_salt must be a non-empty string"),
    (7, "cache_salt must be a non-empty string, got 7"),
    ("x" * (MAX_CACHE_SALT_CHARS + 1), f"cache_salt must be at most {MAX_CACHE_SALT_CHARS} characters"),
    ("\ud800", "cache_salt is not valid Unicode text"),
])
def test_bad_salts_are_refused(salt, message):
    with pytest.raises(ValueError, match=message):
        check_cache_salt(salt)
    assert check_cache_salt("ok") == "ok" and check_cache_salt(None) is None


def test_requests_of_different_salts_never_share_blocks(tiny_llama_dir):
    """The same prompt under salt A, then B, then none, then A again: only the last one hits (and A's first run
    computed every block); greedy outputs are the same for all."""
    from kilat import LLM, SamplingParams

    llm = LLM(tiny_llama_dir, dtype="float32", enable_prefix_caching=True, block_size=16)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    prompt = list(range(300, 365))  # four full blocks before the last token
    outputs, hits = [], []
    for salt in ("tenant-a", "tenant-b", None, "tenant-a"):
        before = llm.engine.stats.prefix_cache_hits
        request = {"prompt_token_ids": prompt} | ({"cache_salt": salt} if salt else {})
        outputs.append(llm.generate([request], params, use_tqdm=False)[0].outputs[0].token_ids)
        hits.append(llm.engine.stats.prefix_cache_hits - before)
    assert hits == [0, 0, 0, 64]
    assert outputs.count(outputs[0]) == 4
    with pytest.raises(ValueError, match="cache_salt must be a non-empty string"):
        llm.generate([{"prompt_token_ids": prompt, "cache_salt": ""}], params, use_tqdm=False)
