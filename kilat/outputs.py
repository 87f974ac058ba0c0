"""What the engine returns for a request, shaped like vLLM's ``RequestOutput`` / ``CompletionOutput``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class Logprob:
    """Log-probability of one token at one position.

    Attributes:
        logprob: natural-log probability under the raw model distribution (float).
        rank: 1-based rank of the token at that position (1 = most likely).
        decoded_token: the token's text, when known.
    """

    logprob: float
    rank: int
    decoded_token: str | None = None


PositionLogprobs = dict[int, Logprob]
"""Token id -> :class:`Logprob` for one position: the chosen token plus the top-N."""


@dataclass
class RequestMetrics:
    """Timings of one request in seconds since the epoch (``time.time()``), and token counts.

    ``first_scheduled_time - arrival_time`` is the queue time; ``first_token_time - arrival_time`` the
    TTFT; ``(last_token_time - first_token_time) / (num_generation_tokens - 1)`` the TPOT.
    """

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_generation_tokens: int = 0
    num_preemptions: int = 0

    @property
    def queue_time(self) -> float | None:
        """Seconds from arrival to first scheduling."""
        if self.first_scheduled_time is None:
            return None
        return self.first_scheduled_time - self.arrival_time

    @property
    def ttft(self) -> float | None:
        """Seconds from arrival to the first generated token."""
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def tpot(self) -> float | None:
        """Mean seconds per output token after the first (needs >= 2 tokens)."""
        if self.num_generation_tokens < 2 or self.first_token_time is None or self.last_token_time is None:
            return None
        return (self.last_token_time - self.first_token_time) / (self.num_generation_tokens - 1)


@dataclass
class RequestError:
    """Why the engine ended one request early (its finish reason is then ``"abort"``).

    Attributes:
        message: the reason, for the client.
        client_error: the request itself is at fault (its constraint failed to compile or compiled past
            ``compile_timeout_s``: a server answers 400); else the engine is (500).
    """

    message: str
    client_error: bool = False


@dataclass
class CompletionOutput:
    """One of the ``n`` completions of a prompt.

    Attributes:
        index: position among the request's ``n`` completions.
        text: generated text so far (stop string cut unless ``include_stop_str_in_output``).
        token_ids: generated token ids (including a final EOS / stop token).
        logprobs: per generated token, the top-N log-probabilities, when asked for.
        finish_reason: ``"stop"``, ``"length"``, ``"abort"`` or ``None`` while running.
        stop_reason: the stop string or stop token id that ended it, if any.
        error: why the engine ended it with finish reason ``"abort"``, when it says (e.g. its grammar failed
            to compile); ``None`` otherwise.
    """

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[PositionLogprobs] | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    error: RequestError | None = None

    @property
    def finished(self) -> bool:
        """True once a finish reason is set."""
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """The state of one request: its prompt and its ``n`` completions.

    Attributes:
        request_id: caller-visible id.
        prompt: prompt text, when the request was given as text.
        prompt_token_ids: the prompt's token ids.
        prompt_logprobs: per prompt position (``None`` for the first), when asked for.
        outputs: the completions, ordered by ``index``.
        finished: all completions finished.
        metrics: timings and counts.
        num_cached_tokens: prompt tokens served from the prefix cache.
        kv_transfer_params: a prefill instance's answer for the decode instance (disaggregated prefill/decode,
            vLLM's field), or ``None``.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    metrics: RequestMetrics | None = None
    num_cached_tokens: int = 0
    kv_transfer_params: dict[str, Any] | None = None
