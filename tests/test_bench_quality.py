"""``kilat bench quality``: perplexity and agreement arithmetic, the bundled text, and one end-to-end run."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest

from kilat.bench.quality import (
    QUALITY_TEXT,
    greedy_agreement,
    perplexity,
    quality_text,
    reference_args,
    split_windows,
    window_nll,
)
from kilat.config import EngineArgs
from kilat.outputs import Logprob


def _entry(token: int, logprob: float, other: int) -> dict[int, Logprob]:
    """A prompt-logprobs position holding the actual token and a more likely other token."""
    return {other: Logprob(-0.01, 1), token: Logprob(logprob, 2)}


def test_perplexity_of_hand_made_logprobs():
    """Two windows of 3 tokens score 4 tokens with p = 1/2, 1/4, 1/2, 1/8: perplexity = (2*4*2*8)^(1/4)."""
    ln2 = math.log(2)
    windows = [[5, 7, 9], [1, 2, 3]]
    logprobs = [[None, _entry(7, -ln2, 8), _entry(9, -2 * ln2, 8)],
                [None, _entry(2, -ln2, 4), _entry(3, -3 * ln2, 4)]]
    total = sum(window_nll(w, lp) for w, lp in zip(windows, logprobs, strict=True))
    assert total == pytest.approx(7 * ln2, rel=1e-15)
    assert perplexity(total, 4) == pytest.approx(2 ** 1.75, rel=1e-14)
    assert perplexity(0.0, 3) == 1.0
    with pytest.raises(ValueError, match="position 2 has no logprob for its token 9"):
        window_nll([5, 7, 9], [None, _entry(7, -ln2, 8), {8: Logprob(-0.1, 1)}])
    with pytest.raises(ValueError, match="2 prompt logprobs for 3 tokens"):
        window_nll([5, 7, 9], [None, _entry(7, -ln2, 8)])
    with pytest.raises(ValueError, match="at least one scored token"):
        perplexity(1.0, 0)


def test_windows_are_whole_and_do_not_overlap():
    ids = list(range(10))
    assert split_windows(ids, 4) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert split_windows(ids, 4, num_windows=1) == [[0, 1, 2, 3]]
    assert split_windows(ids, 5, num_windows=9) == [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9]]
    with pytest.raises(ValueError, match="--window-len must be >= 2"):
        split_windows(ids, 1)
    with pytest.raises(ValueError, match="--num-windows must be >= 1"):
        split_windows(ids, 4, num_windows=0)
    with pytest.raises(ValueError, match=r"--window-len \(11\) exceeds the text's 10 tokens"):
        split_windows(ids, 11)


def test_greedy_agreement_arithmetic():
    """Prefix fractions 1, 1/2, 0, 1 (both empty), 1/2 (a prefix of a longer reference); 2 of 5 identical."""
    got = greedy_agreement([[1, 2, 3, 4], [5, 6], [7], [], [1, 2]],
                           [[1, 2, 3, 4], [5, 9], [8], [], [1, 2, 3, 4]])
    assert got["mean_prefix_fraction"] == pytest.approx(3 / 5, rel=1e-15)
    assert got["exact_match_fraction"] == pytest.approx(2 / 5, rel=1e-15)
    assert [r["common_prefix"] for r in got["per_prompt"]] == [4, 1, 0, 0, 2]
    assert [r["exact"] for r in got["per_prompt"]] == [True, False, False, True, False]
    with pytest.raises(ValueError, match="as many outputs"):
        greedy_agreement([[1]], [[1], [2]])


def test_reference_drops_quantization_and_keeps_the_rest():
    args = EngineArgs(dtype="bfloat16", max_model_len=512, block_size=32, quantization="int4",
                      quantization_config={"group_size": 64}, kv_cache_dtype="int8")
    ref = reference_args(args, "float32")
    assert (ref.dtype, ref.max_model_len, ref.block_size) == ("float32", 512, 32)
    assert (ref.quantization, ref.quantization_config, ref.kv_cache_dtype) == (None, None, "auto")
    assert reference_args(args, None, "other.gguf") == dataclasses.replace(
        args, model="other.gguf", quantization=None, quantization_config=None, kv_cache_dtype="auto")


def test_bundled_text_is_public_domain_prose_of_at_least_4000_tokens():
    """The header (source, public-domain status) is dropped; the rest is at least 4,000 SmolLM2 tokens."""
    from kilat.engine.tokenizer import get_tokenizer

    header = QUALITY_TEXT.read_text().split("\n\n", 1)[0]
    assert "Public domain" in header and all(line.startswith("#") for line in header.splitlines())
    text = quality_text()
    assert text.startswith("We the People of the United States") and "#" not in text
    ids = get_tokenizer(None).encode(text, add_special_tokens=False)
    assert len(ids) >= 4000


@pytest.mark.parametrize(("flags", "message"), [
    (["--num-prompts", "65"], "--num-prompts must be in [0, 64]"), (["--max-tokens", "0"], "--max-tokens must be >= 1"),
    (["--window-len", "100000"], "--window-len (100000) exceeds the text's 9397 tokens")])
def test_bad_flags_are_named_before_any_engine_starts(flags, message, capsys):
    from kilat.entrypoints.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "quality", *flags])
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.slow
def test_quality_run_against_itself_agrees_exactly_and_matches_transformers(tmp_path, capsys):
    """The embedded SmolLM2 in float32 against the same configuration: relative difference exactly 0 and full
    agreement; the perplexity equals HF transformers' exp(mean cross-entropy) on the same 256 tokens."""
    import torch
    from transformers import AutoModelForCausalLM

    from kilat.entrypoints.cli import main
    from tests.conftest import GGUF_NAME, smollm2_dir

    out = tmp_path / "quality.json"
    main(["bench", "quality", "--dtype", "float32", "--reference-dtype", "float32", "--window-len", "256",
          "--num-windows", "1", "--num-prompts", "2", "--max-tokens", "8", "--result-json", str(out)])
    result = json.loads(out.read_text())
    run, ref = result["run"], result["reference"]
    assert run["engine_args"] == ref["engine_args"] and run["engine_args"]["dtype"] == "float32"
    assert (run["dtype"], result["num_windows"], run["num_tokens"]) == ("float32", 1, 255)
    assert result["perplexity_rel_diff_pct"] == 0.0 and run["perplexity"] == ref["perplexity"]
    assert result["agreement"]["mean_prefix_fraction"] == 1.0
    assert result["agreement"]["exact_match_fraction"] == 1.0
    assert [len(o) for o in run["outputs"]] == [8, 8]
    assert result["text_tokens"] >= 4000 and result["machine"]["cpus"] >= 1
    printed = capsys.readouterr().out
    assert f"{run['perplexity']:.4f}" in printed and "exact match 1.0000" in printed

    from kilat.engine.tokenizer import get_tokenizer

    ids = get_tokenizer(None).encode(quality_text(), add_special_tokens=False)[:256]
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir(), gguf_file=GGUF_NAME, dtype=torch.float32)
    with torch.inference_mode():
        loss = model(torch.tensor([ids]), labels=torch.tensor([ids])).loss.item()
    assert run["perplexity"] == pytest.approx(math.exp(loss), rel=1e-4)
