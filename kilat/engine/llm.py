"""Offline inference: ``LLM(model, **engine_args).generate(...)`` / ``.chat(...)``, as in vLLM."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tqdm import tqdm

from kilat.config import EngineArgs
from kilat.engine.input_processor import PromptType, prompt_with
from kilat.engine.llm_engine import LLMEngine
from kilat.outputs import RequestOutput
from kilat.sampling_params import SamplingParams

Conversation = list[dict[str, Any]]


class LLM:
    """An engine for batch inference in the calling process.

    Args:
        model: HF directory, GGUF file, dummy config, or ``None`` for the embedded SmolLM2-135M-Instruct.
        **kwargs: any :class:`~kilat.config.EngineArgs` field (``dtype``, ``max_model_len``,
            ``block_size``, ``max_num_seqs``, ``max_num_batched_tokens``, ``kv_cache_memory``,
            ``enable_prefix_caching``, ...).

    Raises:
        ValueError: an unknown or invalid engine argument.

    A request ended early by the engine (finish reason ``"abort"``, e.g. its constraint failed to compile)
    says why in its :attr:`CompletionOutput.error <kilat.outputs.CompletionOutput.error>`.
    """

    def __init__(self, model: str | None = None, **kwargs: Any):
        self.engine = LLMEngine(EngineArgs.from_kwargs(model=model, **kwargs))

    def shutdown(self) -> None:
        """Stop the engine's background work (grammar compile worker processes and threads). Idempotent; a
        dropped ``LLM`` does it when collected, and ``with LLM(...) as llm:`` at the block's end."""
        self.engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def get_tokenizer(self) -> Any:
        """The model's transformers tokenizer."""
        return self.engine.tokenizer

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True, priority: Sequence[int] | None = None) -> list[RequestOutput]:
        """Generate completions for every prompt, batched continuously; outputs keep the prompts' order.

        ``prompts`` is a string, a list of token ids, a ``{"prompt_token_ids": ...}`` dict, or a list of
        these. ``sampling_params`` is one for all prompts or one per prompt (default ``SamplingParams()``).
        ``priority`` (vLLM's argument): one per prompt, lower first, under ``scheduling_policy="priority"``.

        Raises:
            ValueError: any prompt or parameter is invalid, or ``priority`` is not one per prompt (or not
                allowed: ``fcfs``); nothing is generated then.
        """
        if isinstance(prompts, str | dict) or (isinstance(prompts, list) and prompts
                                               and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if priority is not None:
            if not isinstance(priority, Sequence) or isinstance(priority, str):
                raise ValueError(f"priority must be a list of integers, one per prompt, got {priority!r:.80}")
            if len(priority) != len(prompts):
                raise ValueError(f"priority must have one entry per prompt ({len(prompts)}), got {len(priority)}")
            prompts = [prompt_with(p, priority=rank) for p, rank in zip(prompts, priority, strict=True)]
        return self._run(prompts, sampling_params, use_tqdm, add_special_tokens=True)

    def chat(self, messages: Conversation | Sequence[Conversation],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True, add_generation_prompt: bool = True,
             continue_final_message: bool = False, chat_template: str | None = None,
             chat_template_kwargs: dict[str, Any] | None = None) -> list[RequestOutput]:
        """Generate replies to one conversation or a list of them, rendered by the model's chat template.

        Raises:
            ValueError: malformed messages, a failing template, or invalid parameters.
        """
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = [self.engine.input_processor.apply_chat_template(
            c, add_generation_prompt, continue_final_message, chat_template,
            chat_template_kwargs=chat_template_kwargs)
            for c in conversations]
        return self._run(prompts, sampling_params, use_tqdm, add_special_tokens=False)

    def _run(self, prompts: list[PromptType], sampling_params: Any, use_tqdm: bool,
             add_special_tokens: bool) -> list[RequestOutput]:
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = sampling_params if isinstance(sampling_params, Sequence) else [sampling_params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"sampling_params must be one or one per prompt ({len(prompts)}), got {len(params)}")
        engine = self.engine
        order: dict[str, int] = {}
        results: list[RequestOutput | None] = [None] * len(prompts)
        try:
            for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
                rid = engine.new_request_id()
                engine.add_request(rid, prompt, p, add_special_tokens)
                order[rid] = i
            with tqdm(total=len(prompts), desc="Processed prompts", disable=not use_tqdm) as bar:
                while engine.has_unfinished_requests():
                    for out in engine.step():
                        if out.finished and out.request_id in order:
                            results[order.pop(out.request_id)] = out
                            bar.update(1)
        finally:
            engine.abort_request(list(order))
        return [r for r in results if r is not None]
