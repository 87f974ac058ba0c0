"""Sampling parameters with the field names and semantics of vLLM and the OpenAI API.

Every field is validated on construction; an invalid value raises ``ValueError`` naming the field and
the allowed range. Checks that need the model (vocabulary size, ``max_model_len``) happen when the
request enters the engine (:mod:`kilat.engine.input_processor`).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

_GREEDY_EPS = 1e-5

MAX_TEMPERATURE = 100.0
"""Highest ``temperature``: vLLM sets no bound, but beyond this every vocabulary's distribution is as good as
uniform, and an infinite or huge temperature turns masked (``-inf``) logits into NaN."""
REPETITION_PENALTY_RANGE = (0.01, 100.0)
"""Allowed ``repetition_penalty`` (vLLM asks for > 0): its logit scaling stays finite in float32."""


@dataclass(frozen=True)
class StructuredOutputsParams:
    """A constraint on the generated text (vLLM's ``StructuredOutputsParams``); exactly one field is set.

    Attributes:
        json: a JSON schema (a dict or its JSON text) the output must match (OpenAI ``json_schema``).
        regex: a regular expression the whole output must match.
        choice: the output is exactly one of these strings.
        grammar: an EBNF grammar (xgrammar's dialect, rule ``root``) the output must match.
        json_object: the output is any JSON object (OpenAI ``{"type": "json_object"}``).

    Raises:
        ValueError: when no field or several are set, or a field has the wrong type. Whether a schema,
            regex or grammar is valid is checked when the request enters the engine.
    """

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool = False

    def __post_init__(self) -> None:
        set_fields = [name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None]
        if self.json_object:
            set_fields.append("json_object")
        if len(set_fields) != 1:
            raise ValueError(f"structured_outputs must set exactly one of json, regex, choice, grammar, "
                             f"json_object; got {set_fields or 'none'}")
        if not isinstance(self.json_object, bool):
            raise ValueError(f"structured_outputs.json_object must be a boolean, got {self.json_object!r}")
        if self.json is not None and not isinstance(self.json, dict | str):
            raise ValueError(f"structured_outputs.json must be a JSON schema (dict or string), got "
                             f"{type(self.json).__name__}")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string")
        if self.choice is not None:
            if not isinstance(self.choice, list | tuple) or not self.choice or \
                    any(not isinstance(c, str) or not c for c in self.choice):
                raise ValueError("structured_outputs.choice must be a non-empty list of non-empty strings")
            object.__setattr__(self, "choice", list(self.choice))

    @property
    def key(self) -> tuple[str, str]:
        """(kind, spec text): equal constraints share one compiled grammar. A schema keeps its property order
        (the grammar emits properties in schema order, as OpenAI promises), so reordered schemas differ."""
        if self.json is not None:
            text = self.json if isinstance(self.json, str) else json.dumps(self.json)
            return "json", text
        if self.regex is not None:
            return "regex", self.regex
        if self.choice is not None:
            return "choice", json.dumps(self.choice)
        if self.grammar is not None:
            return "grammar", self.grammar
        return "json_object", ""


@dataclass
class SamplingParams:
    """How to sample the completion of one prompt.

    Attributes:
        n: completions per prompt; they share the prompt's KV blocks.
        temperature: softmax temperature in [0, :data:`MAX_TEMPERATURE`]; 0 means greedy (argmax).
        top_p: nucleus sampling mass in (0, 1].
        top_k: keep the k most likely tokens; 0 or -1 disables; a k above the vocabulary size keeps every
            token (as in vLLM).
        min_p: drop tokens whose probability is below ``min_p`` times the top probability; 0 disables.
        seed: per-request random seed; the samples then do not depend on the rest of the batch.
        presence_penalty: OpenAI presence penalty in [-2, 2], on tokens already generated.
        frequency_penalty: OpenAI frequency penalty in [-2, 2], scaled by generated-token counts.
        repetition_penalty: CTRL-style multiplicative penalty in [0.01, 100] (1 disables) on prompt and output
            tokens.
        logit_bias: token id -> bias in [-100, 100], added to the logits.
        stop: strings that end generation; cut from the text unless ``include_stop_str_in_output``.
        stop_token_ids: token ids that end generation (kept in ``token_ids``, not in the text).
        ignore_eos: keep generating after the EOS token.
        max_tokens: most tokens to generate; ``None`` means up to ``max_model_len``.
        min_tokens: EOS and ``stop_token_ids`` are masked until this many tokens are generated.
        logprobs: number of top log-probabilities to return per generated token (plus the sampled one);
            ``None`` returns none. Log-probabilities are of the raw model distribution.
        prompt_logprobs: the same for each prompt token after the first.
        include_stop_str_in_output: keep the matched stop string at the end of the text.
        skip_special_tokens: leave special tokens out of the text.
        spaces_between_special_tokens: put spaces around added tokens in the text, for slow tokenizers only
            (fast tokenizers' decode ignores it, as in Hugging Face and vLLM).
        structured_outputs: constrain the output to a JSON schema, regex, choice or grammar (xgrammar).
        extra_args: further arguments for engine plugins (vLLM's field); kilat reads ``"kv_transfer_params"``
            (disaggregated prefill/decode, :mod:`kilat.kv_connector.tcp`).
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    structured_outputs: StructuredOutputsParams | None = None
    extra_args: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.logit_bias is not None:
            try:
                self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()}
            except (AttributeError, TypeError, ValueError) as e:
                raise ValueError(f"logit_bias must map token ids to numbers, got {self.logit_bias!r}") from e
        if self.top_k == -1:
            self.top_k = 0
        self._validate()

    def _validate(self) -> None:
        """Every field's type and range; numbers must be finite (``inf``/``nan`` never pass).

        Raises:
            ValueError: ``"<field> must be <allowed>, got <value>"``.
        """
        def bad(name: str, allowed: str) -> ValueError:
            return ValueError(f"{name} must be {allowed}, got {getattr(self, name)!r}")

        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or isinstance(value, bool) or not math.isfinite(value):
                raise bad(name, "a finite number")

        for name in ("n", "top_k", "max_tokens", "min_tokens", "logprobs", "prompt_logprobs", "seed"):
            value = getattr(self, name)
            optional = name in ("max_tokens", "logprobs", "prompt_logprobs", "seed")
            if not (value is None and optional) and (not isinstance(value, int) or isinstance(value, bool)):
                raise bad(name, "an integer" + (" or None" if optional else ""))
        if self.seed is not None and not -(2**63) <= self.seed < 2**63:
            raise bad("seed", "a 64-bit signed integer")
        if any(not isinstance(s, str) for s in self.stop):
            raise bad("stop", "a string or a list of strings")
        if any(not isinstance(t, int) or isinstance(t, bool) for t in self.stop_token_ids):
            raise bad("stop_token_ids", "a list of integers")
        if self.n < 1:
            raise bad("n", ">= 1")
        if not 0 <= self.temperature <= MAX_TEMPERATURE:
            raise bad("temperature", f"in [0, {MAX_TEMPERATURE:g}]")
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", "in (0, 1]")
        if self.top_k < 0:
            raise bad("top_k", "-1, 0 (disabled) or >= 1")
        if not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", "in [0, 1]")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise bad("presence_penalty", "in [-2, 2]")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise bad("frequency_penalty", "in [-2, 2]")
        low, high = REPETITION_PENALTY_RANGE
        if not low <= self.repetition_penalty <= high:
            raise bad("repetition_penalty", f"in [{low:g}, {high:g}]")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise bad("max_tokens", ">= 1")
        if self.min_tokens < 0:
            raise bad("min_tokens", ">= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", f"<= max_tokens ({self.max_tokens})")
        if self.logprobs is not None and self.logprobs < 0:
            raise bad("logprobs", ">= 0")
        if self.prompt_logprobs is not None and self.prompt_logprobs < 0:
            raise bad("prompt_logprobs", ">= 0")
        if any(not s for s in self.stop):
            raise bad("stop", "a list of non-empty strings")
        if any(t < 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", "a list of token ids >= 0")
        if self.logit_bias and any(not -100.0 <= v <= 100.0 for v in self.logit_bias.values()):
            raise bad("logit_bias", "a map of token id to a bias in [-100, 100]")
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise bad("structured_outputs", "a StructuredOutputsParams")
        if self.extra_args is not None and not isinstance(self.extra_args, dict):
            raise bad("extra_args", "a dict or None")

    @property
    def greedy(self) -> bool:
        """True when sampling reduces to argmax (temperature 0)."""
        return self.temperature < _GREEDY_EPS

    @property
    def uses_penalties(self) -> bool:
        """True when any presence/frequency/repetition penalty is active."""
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)
