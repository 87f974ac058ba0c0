"""SamplingParams: defaults, normalisation and validation (every bad value raises ValueError naming the field)."""

from __future__ import annotations

from typing import Any

import pytest

from kilat.sampling_params import SamplingParams


def test_defaults() -> None:
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p) == (1, 1.0, 1.0, 0, 0.0)
    assert p.seed is None
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.0, 0.0, 1.0)
    assert p.logit_bias is None
    assert p.stop == [] and p.stop_token_ids == []
    assert p.ignore_eos is False
    assert p.max_tokens == 16 and p.min_tokens == 0
    assert p.logprobs is None and p.prompt_logprobs is None
    assert p.include_stop_str_in_output is False
    assert p.skip_special_tokens is True and p.spaces_between_special_tokens is True
    assert not p.greedy and not p.uses_penalties


def test_normalisation() -> None:
    p = SamplingParams(stop="###", stop_token_ids=(5, 7), logit_bias={"3": 1}, top_k=-1)
    assert p.stop == ["###"]
    assert p.stop_token_ids == [5, 7]
    assert p.logit_bias == {3: 1.0}
    assert p.top_k == 0


@pytest.mark.parametrize("temperature, greedy", [(0.0, True), (1e-6, True), (1e-5, False), (0.7, False)])
def test_greedy(temperature: float, greedy: bool) -> None:
    assert SamplingParams(temperature=temperature).greedy is greedy


@pytest.mark.parametrize("kwargs", [{"presence_penalty": 0.5}, {"frequency_penalty": -0.5},
                                    {"repetition_penalty": 1.2}])
def test_uses_penalties(kwargs: dict[str, Any]) -> None:
    assert SamplingParams(**kwargs).uses_penalties


@pytest.mark.parametrize("kwargs", [
    {"n": 2, "temperature": 0.0, "top_p": 1.0, "top_k": 1, "min_p": 1.0},
    {"top_p": 1e-9, "min_p": 0.0, "presence_penalty": -2.0, "frequency_penalty": 2.0},
    {"repetition_penalty": 0.01, "max_tokens": None, "min_tokens": 100},
    {"temperature": 100.0, "repetition_penalty": 100.0, "seed": 2**63 - 1},
    {"temperature": 0, "top_k": 49152, "seed": -(2**63)},
    {"max_tokens": 1, "min_tokens": 1, "logprobs": 0, "prompt_logprobs": 0},
    {"stop": ["a", "bc"], "stop_token_ids": [0], "logit_bias": {0: -100, 1: 100}},
])
def test_valid_edges(kwargs: dict[str, Any]) -> None:
    SamplingParams(**kwargs)


@pytest.mark.parametrize("field, kwargs", [
    ("n", {"n": 0}),
    ("n", {"n": 1.5}),
    ("temperature", {"temperature": -1}),
    ("top_p", {"top_p": 0}),
    ("top_p", {"top_p": 1.5}),
    ("top_k", {"top_k": -2}),
    ("min_p", {"min_p": -0.1}),
    ("min_p", {"min_p": 1.1}),
    ("presence_penalty", {"presence_penalty": 2.5}),
    ("presence_penalty", {"presence_penalty": -2.5}),
    ("frequency_penalty", {"frequency_penalty": 2.5}),
    ("frequency_penalty", {"frequency_penalty": -2.5}),
    ("repetition_penalty", {"repetition_penalty": 0}),
    ("repetition_penalty", {"repetition_penalty": -1.0}),
    ("temperature", {"temperature": float("inf")}),
    ("temperature", {"temperature": 1e308}),
    ("temperature", {"temperature": 100.5}),
    ("temperature", {"temperature": float("nan")}),
    ("temperature", {"temperature": "0.5"}),
    ("temperature", {"temperature": True}),
    ("top_p", {"top_p": float("nan")}),
    ("min_p", {"min_p": float("nan")}),
    ("presence_penalty", {"presence_penalty": float("-inf")}),
    ("frequency_penalty", {"frequency_penalty": float("nan")}),
    ("repetition_penalty", {"repetition_penalty": float("inf")}),
    ("repetition_penalty", {"repetition_penalty": 1e-3}),
    ("repetition_penalty", {"repetition_penalty": 100.5}),
    ("top_k", {"top_k": 1e9}),
    ("seed", {"seed": 2**63}),
    ("seed", {"seed": 1.0}),
    ("max_tokens", {"max_tokens": 16.0}),
    ("max_tokens", {"max_tokens": 0}),
    ("min_tokens", {"min_tokens": -1}),
    ("min_tokens", {"min_tokens": 17, "max_tokens": 16}),
    ("logprobs", {"logprobs": -1}),
    ("prompt_logprobs", {"prompt_logprobs": -1}),
    ("stop", {"stop": ""}),
    ("stop", {"stop": ["ok", ""]}),
    ("stop_token_ids", {"stop_token_ids": [-1]}),
    ("logit_bias", {"logit_bias": {1: 100.5}}),
    ("logit_bias", {"logit_bias": {1: -101}}),
    ("logit_bias", {"logit_bias": {1: float("inf")}}),
    ("logit_bias", {"logit_bias": {1: float("nan")}}),
])
def test_invalid_raises_naming_field(field: str, kwargs: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match=rf"^{field} must be"):
        SamplingParams(**kwargs)
