"""Prompts → validated core requests: tokenization, chat templates and checks against the model.

Every rejection is a ``ValueError`` naming the field and the limit, raised before anything enters the
engine, so a bad request never disturbs the others.
"""

from __future__ import annotations

import inspect
import itertools
import time
from dataclasses import replace
from typing import Any

from kilat.core.block_hash import check_cache_salt
from kilat.core.reasoning import ReasoningState
from kilat.core.request import EngineCoreRequest
from kilat.kv_connector.tcp_wire import check_kv_transfer_params
from kilat.sampling_params import SamplingParams

PromptType = str | list[int] | dict[str, Any]
"""A text prompt, a list of token ids, or ``{"prompt": str}`` / ``{"prompt_token_ids": list[int]}`` (vLLM's
``TextPrompt`` / ``TokensPrompt``), optionally with ``"cache_salt": str`` (its prefix-cache blocks are shared only
with requests of the same salt) and ``"priority": int`` (its rank under the ``priority`` scheduling policy, lower
first; vLLM's request field)."""

MAX_PRIORITY = 2**31 - 1
"""Largest ``priority`` magnitude a request may give."""



def prompt_with(prompt: PromptType, **fields: Any) -> PromptType:
    """``prompt`` as a prompt dict that also carries ``fields`` (those not ``None``; e.g. ``cache_salt``,
    ``priority``); unchanged when there are none."""
    fields = {k: v for k, v in fields.items() if v is not None}
    if not fields:
        return prompt
    if isinstance(prompt, dict):
        return prompt | fields
    return {"prompt" if isinstance(prompt, str) else "prompt_token_ids": prompt, **fields}


MAX_LOGPROBS = 20
"""Most top logprobs a request may ask for (OpenAI's limit)."""


class InputProcessor:
    """Tokenizes and validates requests for one model.

    Args:
        tokenizer: a transformers tokenizer, or ``None`` (``skip_tokenizer_init``: token-id prompts only).
        vocab_size: the model's vocabulary size (token ids must be below it).
        max_model_len: longest context in tokens.
        eos_token_id: the model's EOS id, or ``None``.
        extra_eos_token_ids: further ids that end a turn (from the model's generation config); like vLLM,
            they join each request's ``stop_token_ids`` unless it sets ``ignore_eos``.
        kv_role: the engine's ``kv_transfer_config.kv_role``, or ``None`` (requests' ``kv_transfer_params`` are
            then refused).
        scheduling_policy: the engine's; requests may give a non-zero ``priority`` only under ``"priority"``.
    """

    def __init__(self, tokenizer: Any, vocab_size: int, max_model_len: int, eos_token_id: int | None,
                 extra_eos_token_ids: set[int] | frozenset[int] = frozenset(), kv_role: str | None = None,
                 scheduling_policy: str = "fcfs"):
        self.tokenizer = tokenizer
        self.scheduling_policy = scheduling_policy
        self.kv_role = kv_role
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.eos_token_id = eos_token_id
        self.extra_eos_token_ids = frozenset(t for t in extra_eos_token_ids if 0 <= t < vocab_size)
        # No token covers more characters than its longest vocabulary string, so a longer text cannot fit;
        # rejecting it before tokenizing keeps a huge prompt from stalling the server's event loop.
        longest_token = max((len(t) for t in tokenizer.get_vocab()), default=1) if tokenizer is not None else 0
        self.max_prompt_chars = max_model_len * longest_token
        self._core_ids = itertools.count()

    def to_token_ids(self, prompt: PromptType, add_special_tokens: bool = True) -> tuple[str | None, list[int]]:
        """Return (prompt text or ``None``, token ids).

        ``add_special_tokens=False`` for text that already carries them (a rendered chat template).

        Raises:
            ValueError: the prompt is empty, text without a tokenizer, of an unknown type, not encodable as
                UTF-8 (a lone surrogate), longer than ``max_model_len`` tokens could hold (checked on its
                length in characters before tokenizing), or holds ids outside the vocabulary.
        """
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                prompt = list(prompt["prompt_token_ids"])
            elif "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise ValueError("prompt dict must have 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("prompt: a text prompt needs a tokenizer; with skip_tokenizer_init pass token ids")
            if len(prompt) > self.max_prompt_chars:
                raise ValueError(f"prompt is {len(prompt)} characters, more than max_model_len "
                                 f"({self.max_model_len}) tokens can hold (at most {self.max_prompt_chars})")
            try:
                prompt.encode("utf-8")
            except UnicodeEncodeError as e:
                raise ValueError(f"prompt is not valid Unicode text: {e.reason} at character {e.start}") from e
            text: str | None = prompt
            ids = self.tokenizer(prompt, add_special_tokens=add_special_tokens).input_ids if prompt else []
        elif isinstance(prompt, list | tuple) and all(isinstance(t, int) for t in prompt):
            text, ids = None, list(prompt)
        else:
            raise ValueError(f"prompt must be a string, a list of token ids or a dict, got {type(prompt).__name__}")
        if not ids:
            raise ValueError("prompt must not be empty")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt_token_ids must be in [0, {self.vocab_size}), got {bad[:5]}")
        return text, ids

    def validate_params(self, params: SamplingParams, num_prompt_tokens: int) -> SamplingParams:
        """Check ``params`` against the model; return a copy with ``max_tokens`` resolved and the model's
        extra EOS ids added to ``stop_token_ids`` (unless ``ignore_eos``).

        Raises:
            ValueError: naming the field and the limit (max_tokens vs max_model_len, unknown token ids,
                too many logprobs, stop strings without a tokenizer, an invalid structured-outputs spec;
                ``min_tokens`` above the resolved ``max_tokens`` fails in :class:`SamplingParams`).
        """
        room = self.max_model_len - num_prompt_tokens
        if room < 1:
            raise ValueError(f"prompt is {num_prompt_tokens} tokens, which leaves no room to generate "
                             f"within max_model_len ({self.max_model_len})")
        if params.max_tokens is not None and params.max_tokens > room:
            raise ValueError(f"max_tokens ({params.max_tokens}) + prompt tokens ({num_prompt_tokens}) = "
                             f"{params.max_tokens + num_prompt_tokens} exceeds max_model_len "
                             f"({self.max_model_len})")
        for name, ids in (("stop_token_ids", params.stop_token_ids),
                          ("logit_bias", list(params.logit_bias or ()))):
            bad = [t for t in ids if not 0 <= t < self.vocab_size]
            if bad:
                raise ValueError(f"{name} must hold token ids in [0, {self.vocab_size}), got {bad[:5]}")
        if params.stop and self.tokenizer is None:
            raise ValueError("stop: stop strings need a tokenizer (the engine runs with skip_tokenizer_init)")
        if params.structured_outputs is not None:
            if self.tokenizer is None:
                raise ValueError("structured_outputs: needs a tokenizer (the engine runs with skip_tokenizer_init)")
            from kilat.structured_outputs.grammar import validate_structured_outputs

            validate_structured_outputs(params.structured_outputs)
        self._check_kv_transfer(params)
        reasoning = ReasoningState.from_extra_args(params.extra_args)
        if reasoning is not None and not all(0 <= t < self.vocab_size for t in reasoning.end_token_ids):
            raise ValueError(f"extra_args.reasoning.end_token_ids must be token ids in [0, {self.vocab_size})")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(params, name)
            if value is not None and value > MAX_LOGPROBS:
                raise ValueError(f"{name} must be <= {MAX_LOGPROBS}, got {value}")
        stop_ids = params.stop_token_ids
        if self.extra_eos_token_ids and not params.ignore_eos:
            stop_ids = sorted(set(stop_ids) | self.extra_eos_token_ids)
        return replace(params, max_tokens=params.max_tokens or room, stop_token_ids=stop_ids)

    def _check_kv_transfer(self, params: SamplingParams) -> None:
        """Check ``extra_args["kv_transfer_params"]`` against this engine's ``kv_role``.

        Raises:
            ValueError: malformed (:func:`~kilat.kv_connector.tcp_wire.check_kv_transfer_params`), sent to an
                engine without ``kv_transfer_config`` or of the wrong role, or a remote decode with ``n > 1``.
        """
        kv = check_kv_transfer_params((params.extra_args or {}).get("kv_transfer_params"))
        if kv is None:
            return
        if self.kv_role is None:
            raise ValueError("kv_transfer_params: this instance runs without kv_transfer_config (it takes no part "
                             "in disaggregated prefill/decode)")
        for flag, role in (("do_remote_decode", "kv_producer"), ("do_remote_prefill", "kv_consumer")):
            if kv.get(flag) and self.kv_role not in (role, "kv_both"):
                raise ValueError(f"kv_transfer_params.{flag}: this instance's kv_role is {self.kv_role!r}")
        if kv.get("do_remote_decode") and params.n > 1:
            raise ValueError(f"kv_transfer_params.do_remote_decode needs n = 1, got {params.n}")

    def process(self, request_id: str, prompt: PromptType, params: SamplingParams,
                add_special_tokens: bool = True,
                ) -> tuple[str | None, list[int], SamplingParams, list[EngineCoreRequest]]:
        """Tokenize and validate; return (prompt text, prompt ids, resolved params, ``n`` core requests).

        Core requests get engine-unique ids (``f"{request_id}#{k}"`` with a counter ``k``), so no caller id
        can collide with them. Completion ``i`` of an ``n > 1`` request is seeded ``seed + i`` when seeded;
        siblings reuse the first completion's prompt blocks.

        Raises:
            ValueError: as :meth:`to_token_ids`, :meth:`validate_params`, :meth:`check_priority` and
                :func:`~kilat.core.block_hash.check_cache_salt`.
        """
        salt = check_cache_salt(prompt.get("cache_salt")) if isinstance(prompt, dict) else None
        priority = self.check_priority(prompt.get("priority", 0) if isinstance(prompt, dict) else 0)
        text, ids = self.to_token_ids(prompt, add_special_tokens)
        params = self.validate_params(params, len(ids))
        now = time.time()
        requests = [EngineCoreRequest(f"{request_id}#{next(self._core_ids)}", ids, params, self.eos_token_id,
                                      now, parent_id=request_id, index=i, cache_salt=salt, priority=priority)
                    for i in range(params.n)]
        return text, ids, params, requests

    def check_priority(self, priority: object) -> int:
        """Validate a request's ``priority`` (vLLM's field).

        Raises:
            ValueError: naming ``priority``: not an integer, beyond :data:`MAX_PRIORITY`, or non-zero while the
                engine schedules ``fcfs``.
        """
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise ValueError(f"priority must be an integer, got {priority!r:.80}")
        if abs(priority) > MAX_PRIORITY:
            raise ValueError(f"priority must be in [-{MAX_PRIORITY}, {MAX_PRIORITY}], got {priority}")
        if priority and self.scheduling_policy != "priority":
            raise ValueError(f"priority {priority} needs the 'priority' scheduling policy (--scheduling-policy "
                             f"priority); this engine schedules {self.scheduling_policy!r}")
        return priority

    def chat_template_call(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                           continue_final_message: bool = False, chat_template: str | None = None,
                           tools: list[dict[str, Any]] | None = None,
                           chat_template_kwargs: dict[str, Any] | None = None) -> dict[str, Any]:
        """Check a conversation and return the keyword arguments of ``tokenizer.apply_chat_template`` that
        render it as text (``chat_template_kwargs`` become template variables).

        Raises:
            ValueError: no tokenizer, no template (the model has none and ``chat_template`` is not given: a base
                model), malformed messages, both ``add_generation_prompt`` and ``continue_final_message``, or
                ``chat_template_kwargs`` that would override one of the renderer's own arguments (``messages``,
                ``tools``, ``chat_template``, ``tokenize``, ...).
        """
        if self.tokenizer is None:
            raise ValueError("messages: chat needs a tokenizer (the engine runs with skip_tokenizer_init)")
        if chat_template is None and not self.tokenizer.chat_template:
            raise ValueError("chat_template: this model has no chat template (a base model, such as gemma-3-270m): "
                             "a chat request must give one in chat_template (the server accepts it with "
                             "--trust-request-chat-template), or use the completions API with a plain prompt")
        if not isinstance(messages, list) or not messages:
            raise ValueError("messages must be a non-empty list")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or "role" not in m:
                raise ValueError(f"messages[{i}] must be a dict with a 'role'")
        if add_generation_prompt and continue_final_message:
            raise ValueError("add_generation_prompt and continue_final_message cannot both be true")
        kwargs = dict(chat_template_kwargs or {})
        reserved = sorted(set(kwargs) & self._renderer_arguments())
        if reserved:
            raise ValueError(f"chat_template_kwargs must not set {reserved}: they are the renderer's own "
                             f"arguments (give messages, tools, chat_template, add_generation_prompt and "
                             f"continue_final_message as request fields)")
        return {**kwargs, "conversation": messages, "tools": tools, "chat_template": chat_template,
                "add_generation_prompt": add_generation_prompt,
                "continue_final_message": continue_final_message, "tokenize": False}

    def _renderer_arguments(self) -> set[str]:
        """Names a template variable from ``chat_template_kwargs`` must not take: the parameters of the
        tokenizer's ``apply_chat_template``, and ``messages`` (the conversation inside the template)."""
        parameters = inspect.signature(self.tokenizer.apply_chat_template).parameters.values()
        return {p.name for p in parameters if p.kind is not p.VAR_KEYWORD} | {"messages"}

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            continue_final_message: bool = False, chat_template: str | None = None,
                            tools: list[dict[str, Any]] | None = None,
                            chat_template_kwargs: dict[str, Any] | None = None) -> str:
        """Render a conversation with the model's chat template (transformers' Jinja renderer), or with
        ``chat_template`` (run here, unbounded: give request-supplied templates to
        :class:`~kilat.entrypoints.openai.chat_template_worker.ChatTemplateWorker` instead).

        Raises:
            ValueError: the arguments are invalid (see :meth:`chat_template_call`) or the template fails.
        """
        call = self.chat_template_call(messages, add_generation_prompt, continue_final_message, chat_template,
                                       tools, chat_template_kwargs)
        try:
            return self.tokenizer.apply_chat_template(**call)
        except Exception as e:
            raise ValueError(f"chat template failed: {e}") from e
