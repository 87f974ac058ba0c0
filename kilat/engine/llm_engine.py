"""The synchronous engine: input processing, the engine core in-process, and output processing."""

from __future__ import annotations

import contextlib
import itertools
import logging
from typing import Any

from transformers import GenerationConfig

from kilat.config import EngineArgs
from kilat.core.engine_core import EngineCore
from kilat.core.request import RequestStatus
from kilat.engine.input_processor import InputProcessor, PromptType
from kilat.engine.output_processor import OutputProcessor
from kilat.engine.tokenizer import get_tokenizer
from kilat.model_executor.loader import ModelSource, resolve_model_source
from kilat.outputs import RequestOutput
from kilat.sampling_params import SamplingParams

logger = logging.getLogger("kilat")


def _config_eos_ids(hf_config: Any, source: ModelSource) -> set[int]:
    """EOS ids named by the model config and, for an HF directory, its ``generation_config.json``
    (e.g. Llama-3-Instruct's end-of-turn ``<|eot_id|>`` besides ``<|end_of_text|>``)."""
    ids: set[int] = set()
    candidates = [getattr(hf_config, "eos_token_id", None)]
    if source.kind == "hf":
        with contextlib.suppress(OSError):  # no generation_config.json
            candidates.append(GenerationConfig.from_pretrained(source.path).eos_token_id)
    for value in candidates:
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list):
            ids.update(v for v in value if isinstance(v, int))
    return ids


class LLMEngine:
    """Adds requests and steps them to completion in the calling thread.

    Args:
        engine_args: flat engine arguments (vLLM names).

    Raises:
        ValueError: an invalid argument, named.
    """

    def __init__(self, engine_args: EngineArgs):
        self.config = engine_args.create_engine_config()
        self.core = EngineCore(self.config)
        self.hf_config = self.core.runner.hf_config
        model_config = self.config.model
        source = resolve_model_source(model_config.model, model_config.load_format)
        self.tokenizer = get_tokenizer(model_config.tokenizer or source)
        eos_ids = _config_eos_ids(self.hf_config, source)
        eos = self.tokenizer.eos_token_id
        if eos is None and eos_ids:
            eos = min(eos_ids)
        self.input_processor = InputProcessor(self.tokenizer, self.hf_config.vocab_size,
                                              self.core.max_model_len, eos, eos_ids - {eos})
        self.output_processor = OutputProcessor(self.tokenizer)
        self._ids = itertools.count()

    @property
    def stats(self) -> Any:
        """The core's :class:`~kilat.metrics.stats.EngineStats`."""
        return self.core.stats

    def new_request_id(self) -> str:
        """A fresh, unique request id."""
        return str(next(self._ids))

    def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams,
                    add_special_tokens: bool = True) -> None:
        """Validate and queue one request.

        Raises:
            ValueError: the prompt or parameters are invalid for this model (nothing is queued).
        """
        text, ids, params, core_requests = self.input_processor.process(request_id, prompt, params,
                                                                        add_special_tokens)
        self.output_processor.add_request(request_id, text, ids, params, core_requests)
        for request in core_requests:
            self.core.add_request(request)

    def abort_request(self, request_ids: list[str]) -> None:
        """Abort requests by their user-visible ids, freeing their KV blocks."""
        for rid in request_ids:
            self.core.abort_requests(self.output_processor.abort_request(rid))

    def has_unfinished_requests(self) -> bool:
        """True while any request is in flight."""
        return len(self.output_processor) > 0 or self.core.has_unfinished_requests()

    def step(self) -> list[RequestOutput]:
        """Run one engine step; return the requests it updated."""
        outputs, to_abort = self.output_processor.process_outputs(self.core.step())
        if to_abort:
            self.core.abort_requests(to_abort, RequestStatus.FINISHED_STOPPED)
        return outputs
