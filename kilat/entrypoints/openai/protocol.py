"""Request bodies of the OpenAI API (completions, chat completions) plus vLLM's extra sampling fields.

Types are checked by pydantic, strictly for integers and booleans (``1e9`` is not an integer, ``0`` not a
boolean), and numbers must be finite; values are checked by :class:`~kilat.sampling_params.SamplingParams`
and the input processor, whose ``ValueError`` names the field. Unknown fields are ignored, as
OpenAI-compatible servers do. See https://platform.openai.com/docs/api-reference.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt

from kilat.engine.input_processor import MAX_LOGPROBS
from kilat.sampling_params import SamplingParams, StructuredOutputsParams
from kilat.structured_outputs.limits import check_limits_for

MAX_N = 128
"""Most choices per prompt (OpenAI's limit)."""
MAX_CHOICES = 4096
"""Most choices in one request (prompts × ``n``), so that one request cannot flood the engine."""
MAX_STOP_STRINGS = 64
"""Most stop strings per request."""
MAX_STOP_CHARS = 1024
"""Longest stop string, in characters (each streamed delta scans for partial stop strings)."""


class StreamOptions(BaseModel):
    """``stream_options``: ``include_usage`` adds a final chunk with the usage of every choice."""

    include_usage: StrictBool = False


class _SamplingRequest(BaseModel):
    """Fields shared by completions and chat completions (OpenAI's, then vLLM's extras)."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    model: str | None = None
    n: StrictInt = 1
    temperature: float = 1.0
    top_p: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    seed: StrictInt | None = None
    stop: str | list[str] | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    top_k: StrictInt = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: StrictInt = 0
    ignore_eos: StrictBool = False
    stop_token_ids: list[StrictInt] | None = None
    skip_special_tokens: StrictBool = True
    spaces_between_special_tokens: StrictBool = True
    include_stop_str_in_output: StrictBool = False
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    cache_salt: str | None = None
    priority: StrictInt = 0
    kv_transfer_params: dict[str, Any] | None = None

    def _structured_outputs(self) -> StructuredOutputsParams | None:
        """OpenAI's ``response_format`` or vLLM's ``structured_outputs`` (json, regex, choice, grammar,
        json_object) as :class:`StructuredOutputsParams`.

        Raises:
            ValueError: an unknown ``response_format`` type, a ``json_schema`` without a ``schema`` object,
                unknown ``structured_outputs`` keys, or both fields at once.
        """
        from_format = None
        if self.response_format is not None:
            kind = self.response_format.get("type", "text")
            if kind == "json_object":
                from_format = StructuredOutputsParams(json_object=True)
            elif kind == "json_schema":
                spec = self.response_format.get("json_schema")
                schema = spec.get("schema") if isinstance(spec, dict) else None
                if not isinstance(schema, dict):
                    raise ValueError("response_format.json_schema.schema must be a JSON schema object")
                from_format = StructuredOutputsParams(json=schema)
                check_limits_for(from_format, "response_format.json_schema.schema")
            elif kind != "text":
                raise ValueError(f"response_format.type must be 'text', 'json_object' or 'json_schema', got {kind!r}")
        if self.structured_outputs is None:
            return from_format
        if from_format is not None:
            raise ValueError("give either response_format or structured_outputs, not both")
        known = {"json", "regex", "choice", "grammar", "json_object"}
        unknown = sorted(set(self.structured_outputs) - known)
        if unknown:
            raise ValueError(f"structured_outputs: unknown keys {unknown}; known: {sorted(known)}")
        return StructuredOutputsParams(**self.structured_outputs)

    def _sampling_params(self, max_tokens: int | None, logprobs: int | None,
                         prompt_logprobs: int | None = None) -> SamplingParams:
        """Build validated sampling parameters.

        Raises:
            ValueError: a value out of range, naming the field.
        """
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed with stream=true")
        if self.stream and isinstance(self.kv_transfer_params, dict) and self.kv_transfer_params.get(
                "do_remote_decode"):
            raise ValueError("kv_transfer_params.do_remote_decode needs stream=false (the params come back in the "
                             "whole response)")
        if self.n > MAX_N:
            raise ValueError(f"n must be <= {MAX_N}, got {self.n}")
        stops = [self.stop] if isinstance(self.stop, str) else self.stop or []
        if len(stops) > MAX_STOP_STRINGS or any(len(s) > MAX_STOP_CHARS for s in stops):
            raise ValueError(f"stop must hold at most {MAX_STOP_STRINGS} strings of at most {MAX_STOP_CHARS} "
                             f"characters")
        return SamplingParams(
            n=self.n, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, min_p=self.min_p,
            seed=self.seed, presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty, logit_bias=self.logit_bias, stop=self.stop,
            stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos, max_tokens=max_tokens,
            min_tokens=self.min_tokens, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
            include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
            structured_outputs=self._structured_outputs(),
            extra_args=None if self.kv_transfer_params is None else {"kv_transfer_params": self.kv_transfer_params})

    @property
    def include_usage(self) -> bool:
        """Whether a streamed response ends with a usage chunk."""
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_SamplingRequest):
    """``POST /v1/completions``.

    ``prompt`` is a string, a list of strings, a list of token ids or a list of token-id lists; each prompt
    gets ``n`` choices, numbered ``prompt_index * n + i``. ``logprobs`` (0-20) asks for that many top
    log-probabilities per token; with ``echo`` the prompt's tokens come first. ``echo`` with
    ``max_tokens=0`` scores the prompt without generating (the engine computes one token, which is dropped).
    """

    prompt: str | list[str] | list[StrictInt] | list[list[StrictInt]]
    max_tokens: StrictInt | None = 16
    echo: StrictBool = False
    logprobs: StrictInt | None = None
    suffix: str | None = None
    best_of: StrictInt | None = None

    def prompts(self) -> list[str | list[int]]:
        """The prompts as a list.

        Raises:
            ValueError: ``prompt`` is an empty list, or prompts × ``n`` exceeds :data:`MAX_CHOICES`.
        """
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if not prompt:
            raise ValueError("prompt must not be empty")
        if all(isinstance(p, int) for p in prompt):
            return [list(prompt)]  # type: ignore[arg-type]
        if len(prompt) * self.n > MAX_CHOICES:
            raise ValueError(f"prompt holds {len(prompt)} prompts × n={self.n} choices, more than {MAX_CHOICES}")
        return list(prompt)  # type: ignore[arg-type]

    @property
    def scores_only(self) -> bool:
        """``echo`` with ``max_tokens=0``: return the prompt (and its logprobs) without generated text."""
        return self.echo and self.max_tokens == 0

    def to_sampling_params(self) -> SamplingParams:
        """Validated :class:`SamplingParams` for each prompt.

        Raises:
            ValueError: an unsupported or out-of-range field, named.
        """
        if self.suffix:
            raise ValueError("suffix is not supported")
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError(f"best_of must equal n ({self.n}) when given, got {self.best_of}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ValueError(f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")
        return self._sampling_params(1 if self.scores_only else self.max_tokens, self.logprobs,
                                     self.logprobs if self.echo and self.logprobs is not None else None)


class ChatMessage(BaseModel):
    """One message: ``role`` plus ``content`` (a string or a list of ``{"type": "text", "text"}`` parts),
    and, passed to the chat template, ``name``, ``tool_calls`` and ``tool_call_id``."""

    model_config = ConfigDict(extra="allow")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None

    def to_template_dict(self) -> dict[str, Any]:
        """The message as the chat template expects it: text parts joined by newlines, and a missing
        content (an assistant message with only ``tool_calls``) as an empty string.

        Raises:
            ValueError: a content part that is not text.
        """
        message = self.model_dump(exclude_none=True)
        message.setdefault("content", "")
        if isinstance(self.content, list):
            texts = []
            for part in self.content:
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise ValueError(f"content parts must be {{'type': 'text', 'text': str}}; "
                                     f"got type {part.get('type')!r}")
                texts.append(part["text"])
            message["content"] = "\n".join(texts)
        return message


class _ChatTemplateFields(BaseModel):
    """How the messages are rendered (vLLM's fields): ``add_generation_prompt`` opens an assistant turn,
    ``continue_final_message`` leaves the last message open (not both); ``chat_template`` replaces the
    model's (only with ``--trust-request-chat-template``); ``chat_template_kwargs`` are extra template
    variables, which must not name the renderer's own arguments."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None


class ChatCompletionRequest(_SamplingRequest, _ChatTemplateFields):
    """``POST /v1/chat/completions``.

    ``max_completion_tokens`` (or the older ``max_tokens``) defaults to whatever fits in
    ``max_model_len``. ``logprobs`` with ``top_logprobs`` (0-20) returns log-probabilities per token.
    ``thinking_token_budget`` (vLLM's field; SGLang's ``thinking_budget`` is the same) caps the reasoning of a
    server with a reasoning parser (:mod:`kilat.core.reasoning`).
    """

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: StrictInt | None = None
    max_completion_tokens: StrictInt | None = None
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: StrictBool = True
    thinking_token_budget: StrictInt | None = None
    thinking_budget: StrictInt | None = None

    @property
    def thinking_tokens(self) -> int | None:
        """The request's thinking budget (``thinking_token_budget`` or ``thinking_budget``), or ``None``.

        Raises:
            ValueError: both fields, differing; or a negative budget.
        """
        budgets = {b for b in (self.thinking_token_budget, self.thinking_budget) if b is not None}
        if len(budgets) > 1:
            raise ValueError(f"thinking_token_budget ({self.thinking_token_budget}) and thinking_budget "
                             f"({self.thinking_budget}) differ; give one")
        budget = budgets.pop() if budgets else None
        if budget is not None and budget < 0:
            raise ValueError(f"thinking_token_budget must be >= 0, got {budget}")
        return budget

    def to_sampling_params(self) -> SamplingParams:
        """Validated :class:`SamplingParams`.

        Raises:
            ValueError: an unsupported or out-of-range field, named.
        """
        if self.top_logprobs is not None and not 0 <= self.top_logprobs <= MAX_LOGPROBS:
            raise ValueError(f"top_logprobs must be in [0, {MAX_LOGPROBS}], got {self.top_logprobs}")
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs to be true")
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        return self._sampling_params(max_tokens, (self.top_logprobs or 0) if self.logprobs else None)


class TokenizeRequest(_ChatTemplateFields):
    """``POST /tokenize`` (vLLM): either ``prompt`` or chat ``messages``, rendered as the chat endpoint
    renders them (with ``tools``, ``chat_template``, ...); ``add_special_tokens`` applies to ``prompt``."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: StrictBool = True


class DetokenizeRequest(BaseModel):
    """``POST /detokenize`` (vLLM)."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    tokens: list[StrictInt]


class ErrorInfo(BaseModel):
    """The ``error`` object of OpenAI's error responses."""

    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """Every error response: ``{"error": {"message", "type", "param", "code"}}`` (OpenAI's format)."""

    error: ErrorInfo
