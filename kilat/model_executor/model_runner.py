"""Turns a :class:`SchedulerOutput` into one model forward and one batched sampling call.

Owns the model, the paged KV cache tensors, the sampler, the speculative-decoding proposer and its own state of
every request it holds (:class:`CachedRequestState`), kept from the scheduler's data alone. Input tensors are
built once per step: ``input_ids`` / ``positions`` int64 ``[num_scheduled_tokens]`` and the shared
``AttentionMetadata``.

Under pipeline parallelism every stage's runner gets the same steps and keeps the same request states: a stage
after the first receives the previous stage's hidden states instead of embedding, a stage before the last sends
its own on and returns an empty output; only the last samples, proposes drafts and computes logprobs, and the
others learn the sampled tokens from the scheduler (``CachedRequestData.new_token_ids``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from kilat.config import EngineConfig
from kilat.core.kv_cache_groups import layer_placement, num_kv_tensors, plan_kv_cache_groups
from kilat.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from kilat.core.sliding_window import max_blocks_per_request
from kilat.distributed.parallel_state import get_pp_group, recv_from_prev_stage, send_to_next_stage
from kilat.kv_connector.base import KVCacheSpec, KVConnectorRole, create_kv_connector
from kilat.model_executor.attention import (
    AttentionMetadata,
    FullAttentionSpec,
    allocate_kv_cache,
    blocks_on_dim1,
    kv_cache_storage_dtype,
)
from kilat.model_executor.attention.backends import get_attention_backend, resolve_attention_backend
from kilat.model_executor.attention.layer import attention_windows
from kilat.model_executor.cpu_threads import ThreadGovernor
from kilat.model_executor.cuda_graphs import CUDAGraphRunner
from kilat.model_executor.forward_context import ForwardContext, set_forward_context
from kilat.model_executor.loader import get_model
from kilat.model_executor.loader.metadata import max_position_embeddings
from kilat.model_executor.models.llama_eagle3 import load_eagle3
from kilat.model_executor.request_state import CachedRequestState
from kilat.model_executor.sampler import Sampler, compute_prompt_logprobs, plain_greedy
from kilat.outputs import PositionLogprobs
from kilat.spec_decode import Proposer, TargetHiddenStates, build_proposer
from kilat.spec_decode.rejection import verify

logger = logging.getLogger("kilat")

_DEFAULT_CPU_KV_BYTES = 2 << 30


@dataclass
class _StepInputs:
    """One step's batch on the host, flattened in scheduling order (:meth:`ModelRunner._prepare_inputs`).

    Attributes:
        scheduled: (request state, tokens scheduled) per request.
        input_ids, positions: per new token (int lists of the step's ``num_scheduled_tokens`` entries).
        query_lens, seq_lens, block_tables: per request, what :meth:`AttentionMetadata.build` takes (every
            KV-cache group's table).
        sample_rows: the rows whose hidden states sample (``1 +`` drafts per sampling request).
        sample_reqs: the requests whose chunk reaches their last known token.
        prompt_logprobs: (request, first row, first position, count) of the prompt positions whose logprobs
            this step computes.
        first_rows, first_positions: per scheduled request, its first row and that row's position.
    """

    scheduled: list[tuple[CachedRequestState, int]] = field(default_factory=list)
    input_ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    query_lens: list[int] = field(default_factory=list)
    seq_lens: list[int] = field(default_factory=list)
    block_tables: list[list[list[int]]] = field(default_factory=list)
    sample_rows: list[int] = field(default_factory=list)
    sample_reqs: list[CachedRequestState] = field(default_factory=list)
    prompt_logprobs: list[tuple[CachedRequestState, int, int, int]] = field(default_factory=list)
    first_rows: list[int] = field(default_factory=list)
    first_positions: list[int] = field(default_factory=list)


class ModelRunner:
    """Runs the model for the engine core.

    Args:
        config: validated engine configuration.

    Attributes:
        max_model_len: longest context in tokens, capped by the model's positions and the KV cache.
        num_blocks: KV blocks allocated.
        kv_cache_dtype: the KV cache's storage dtype (``CacheConfig.kv_cache_dtype`` resolved: the model dtype,
            ``torch.int8`` or a float8 dtype).
        bytes_per_block: bytes one KV block takes over all layers, scales and the draft model's cache included.
        sliding_windows: each KV cache's attention window (``None``: full attention), this stage's target layers
            then the draft model's (what the engine core's KV cache manager frees blocks by).
        kv_cache_groups: the layers that share a block table (:mod:`kilat.core.kv_cache_groups`): several for a
            hybrid model (sliding and full layers) without a KV connector, draft model or pipeline stages.
        layer_groups: the KV-cache group of each KV cache index.
        kv_caches, kv_scales: the KV cache tensors and, for int8/fp8, their scales (else ``None``), one per layer
            (with several KV-cache groups the layers at one position of every group share a tensor).
        attn_backend: the attention kernels (``ExecutionConfig.attention_backend`` resolved for the device).
        fused_kernels: whether RMSNorm, SiLU-and-mul and rotary run as fused Triton kernels (CUDA + Triton).
        cuda_graphs: the captured decode graphs, or ``None`` (CPU, ``enforce_eager``, ungraphable backend).
        draft_model: the speculative-decoding draft model (method ``draft_model``) or EAGLE-3 head (method
            ``eagle3``), or ``None``.
        draft_aux_layers: the target layers whose inputs the EAGLE-3 head reads (empty without one).
        draft_kv_caches, draft_kv_scales: its KV cache (in the same ``kv_cache_dtype``) and scales, with the
            target's block ids and block size, or ``None``.
        proposer: the speculative-decoding proposer (``speculative_config``; on the last pipeline stage), or
            ``None``.
        num_lookahead_tokens: KV slots the scheduler reserves after a request's last token for the proposer's
            drafts (0 without a draft model).
        requests: request id → this runner's state of it, from its first scheduling until it finishes.
    """

    def __init__(self, config: EngineConfig):
        self.config = config
        self.device = torch.device(config.device)
        self.threads = ThreadGovernor(config.num_threads, config.frontend_pid) if self.device.type == "cpu" else None
        self.pp = get_pp_group()
        self.model, self.hf_config, self.dtype = get_model(config.model, self.device)
        self.attn_backend = get_attention_backend(resolve_attention_backend(
            config.execution.attention_backend, self.device, config.cache.kv_cache_dtype, self.dtype))
        self.fused_kernels = self.device.type == "cuda" and self.attn_backend.name == "triton"
        model_max = max_position_embeddings(self.hf_config)
        self.max_model_len = config.model.max_model_len or model_max
        if self.max_model_len > model_max:
            raise ValueError(f"max_model_len ({self.max_model_len}) must be <= the model's "
                             f"max_position_embeddings ({model_max})")
        block_size = config.cache.block_size
        self.block_size = block_size
        self.kv_cache_dtype = kv_cache_storage_dtype(config.cache.kv_cache_dtype, self.dtype)
        self.draft_aux_layers: tuple[int, ...] = ()
        self.draft_model = self._load_draft_model()
        self.sliding_windows = tuple(w for m in (self.model, self.draft_model) if m is not None
                                     for w in attention_windows(m, m.num_layers))
        # MLA and a proposer that reads the target's layer inputs (EAGLE-3): eager
        graphable = self.device.type == "cuda" and self.attn_backend.graphable and not config.execution.enforce_eager \
            and self.pp.world_size == 1 and isinstance(self.model.kv_spec, FullAttentionSpec) \
            and not self.draft_aux_layers
        # KV-cache groups need one table per group in every kernel's metadata: not with a KV connector, a draft
        # model or pipeline stages, nor (yet) in captured CUDA graphs, which a hybrid model keeps by default
        hybrid = self.draft_model is None and self.pp.world_size == 1 and config.kv_connector_name is None \
            and isinstance(self.model.kv_spec, FullAttentionSpec) and not graphable
        self.kv_cache_groups = plan_kv_cache_groups(self.sliding_windows, self.max_model_len, hybrid)
        self.layer_groups, self._layer_tensor = layer_placement(self.kv_cache_groups)
        self.bytes_per_block = sum(self._num_kv_tensors(m) * block_size * m.kv_spec.bytes_per_token(self.kv_cache_dtype)
                                   for m in (self.model, self.draft_model) if m is not None)
        self.num_blocks = self._num_blocks(self.bytes_per_block)
        self._check_capacity()
        if not config.scheduler.enable_chunked_prefill and \
                config.scheduler.max_num_batched_tokens < self.max_model_len:
            raise ValueError(f"max_num_batched_tokens ({config.scheduler.max_num_batched_tokens}) must be >= "
                             f"max_model_len ({self.max_model_len}) when chunked prefill is disabled")
        self.kv_caches, self.kv_scales = self._allocate_kv(self.model, self.num_blocks)
        self.draft_kv_caches, self.draft_kv_scales = (None, None) if self.draft_model is None else \
            self._allocate_kv(self.draft_model, self.num_blocks)
        self.sampler = Sampler()
        self.cuda_graphs = None
        if graphable:
            self.cuda_graphs = CUDAGraphRunner(self.model, self.kv_caches, self.attn_backend, self.fused_kernels,
                                               block_size, self.max_model_len, config.scheduler.max_num_seqs,
                                               self.device, self.kv_scales)
        self.requests: dict[str, CachedRequestState] = {}
        self.kv_connector = create_kv_connector(config, KVConnectorRole.WORKER, self.kv_cache_spec)
        if self.kv_connector is not None:
            self.kv_connector.register_kv_caches([blocks_on_dim1(t) for group in (
                self.kv_caches, self.kv_scales, self.draft_kv_caches, self.draft_kv_scales) for t in group or ()])
        spec = config.speculative
        self.proposer: Proposer | None = None if spec is None or not self.pp.is_last else build_proposer(spec, self)
        self.num_lookahead_tokens = self.proposer.num_lookahead_tokens if self.proposer is not None else 0
        self._aux_layers = frozenset(self.proposer.aux_hidden_state_layers if self.proposer is not None else ())
        logger.info("attention backend %s%s, %s", self.attn_backend.name,
                    " with fused kernels" if self.fused_kernels else "",
                    "CUDA graphs for decode" if self.cuda_graphs is not None else "eager")
        logger.info("KV cache: %d bytes per token, %d layers of %s%s", self.bytes_per_block // block_size,
                    self.model.num_layers, self.model.kv_spec,
                    f"; {len(self.kv_cache_groups)} KV-cache groups sharing {num_kv_tensors(self.kv_cache_groups)} "
                    f"cache tensor(s)" if len(self.kv_cache_groups) > 1 else "")

    def _num_kv_tensors(self, model: torch.nn.Module) -> int:
        """Cache tensors ``model`` needs: one per layer, or with several KV-cache groups the largest group's size."""
        return num_kv_tensors(self.kv_cache_groups) if model is self.model and len(self.kv_cache_groups) > 1 \
            else model.num_layers

    def _check_capacity(self) -> None:
        """Refuse a KV cache too small for one request: ``max_model_len`` tokens in each KV-cache group, or, where
        the engine core frees blocks behind a sliding window (every layer of a group has one, no KV connector, one
        pipeline stage: a stage does not see the others' layers), the most blocks a request then holds at once in
        that group, besides the null block.

        Raises:
            ValueError: too few blocks.
        """
        config = self.config
        windows = [g.sliding_window for g in self.kv_cache_groups]
        if len(windows) == 1 and (config.kv_connector_name is not None or self.pp.world_size > 1):
            windows = [None]
        lookahead = config.speculative.num_speculative_tokens if self.draft_model is not None else 0
        needed = sum(max_blocks_per_request(self.max_model_len, self.block_size, window,
                                            config.scheduler.max_num_batched_tokens + lookahead) for window in windows)
        usable = self.num_blocks - any(w is not None for w in windows)
        if usable >= needed:
            return
        if windows == [None]:
            raise ValueError(f"the KV cache holds {self.num_blocks * self.block_size} tokens ({self.num_blocks} "
                             f"blocks), fewer than max_model_len ({self.max_model_len}); raise kv_cache_memory / "
                             f"gpu_memory_utilization or lower max_model_len")
        raise ValueError(f"the KV cache has {usable} blocks besides the null block, fewer than the {needed} that one "
                         f"request may hold at once with sliding windows {windows} (one per KV-cache group; "
                         f"max_num_batched_tokens {config.scheduler.max_num_batched_tokens}); raise kv_cache_memory / "
                         f"gpu_memory_utilization or lower max_num_batched_tokens")

    @property
    def kv_cache_spec(self) -> KVCacheSpec:
        """The KV cache as a KV connector sees it."""
        return KVCacheSpec(self.num_blocks, self.block_size, self.bytes_per_block,
                           str(self.dtype).removeprefix("torch."), str(self.kv_cache_dtype).removeprefix("torch."))

    def shutdown(self) -> None:
        """Finish the KV connector's queued writes (the offload tier's saves)."""
        if self.kv_connector is not None:
            self.kv_connector.shutdown()

    def context(self, meta: AttentionMetadata, kv_caches: list[torch.Tensor],
                kv_scales: list[torch.Tensor] | None) -> ForwardContext:
        """The forward context of one step over ``kv_caches`` (and their scales) with this runner's kernels."""
        return ForwardContext(meta, kv_caches, self.attn_backend, self.fused_kernels, kv_scales)

    def _allocate_kv(self, model: torch.nn.Module, num_blocks: int
                     ) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
        """``model``'s KV cache of ``num_blocks`` blocks in :attr:`kv_cache_dtype`, and its scales (or ``None``), one
        entry per layer: with several KV-cache groups, layer ``i`` gets the shared tensor of its position in its
        group."""
        caches, scales = allocate_kv_cache(model.kv_spec, self._num_kv_tensors(model), num_blocks, self.block_size,
                                           self.kv_cache_dtype, self.device, self.attn_backend.kv_cache_shape)
        if model is not self.model or len(self.kv_cache_groups) == 1:
            return caches, scales
        return [caches[t] for t in self._layer_tensor], None if scales is None else [scales[t]
                                                                                   for t in self._layer_tensor]

    def _load_draft_model(self) -> torch.nn.Module | None:
        """The draft model of ``speculative_config`` (method ``draft_model``) or its EAGLE-3 head (method
        ``eagle3``, also setting :attr:`draft_aux_layers`) in the target's dtype, or ``None``.

        Raises:
            ValueError: the draft's vocabulary differs from the target's, or its positions end before
                ``max_model_len``; an EAGLE-3 head that does not fit the target (:func:`load_eagle3`).
        """
        spec = self.config.speculative
        if spec is None or spec.method not in ("draft_model", "eagle3"):
            return None
        if spec.method == "eagle3":
            head, self.draft_aux_layers = load_eagle3(spec.model, self.hf_config, self.max_model_len, self.dtype,
                                                      self.device, spec.quantization)
            head.bind_target(self.model.model.embed_tokens)
            return head
        from kilat.spec_decode.draft_model import draft_model_config

        model, hf_config, _ = get_model(draft_model_config(spec, self.config.model, self.dtype), self.device)
        if hf_config.vocab_size != self.hf_config.vocab_size:
            raise ValueError(f"speculative_config.model: the draft's vocab_size ({hf_config.vocab_size}) must "
                             f"equal the target's ({self.hf_config.vocab_size})")
        draft_max = max_position_embeddings(hf_config)
        if draft_max < self.max_model_len:
            raise ValueError(f"speculative_config.model: the draft's max_position_embeddings ({draft_max}) must "
                             f"be >= max_model_len ({self.max_model_len})")
        return model

    def _num_blocks(self, bytes_per_block: int) -> int:
        cache = self.config.cache
        if cache.num_gpu_blocks_override is not None:
            return cache.num_gpu_blocks_override
        if self.device.type == "cuda":
            return self._profile_cuda_blocks(bytes_per_block)
        return max(2, (cache.kv_cache_memory or _DEFAULT_CPU_KV_BYTES) // bytes_per_block)

    def _profile_cuda_blocks(self, bytes_per_block: int) -> int:
        """Run a forward at the full token budget and logits for ``max_num_seqs`` rows (times ``1 + k`` with
        ``k`` speculative tokens), then give the KV cache what is left of ``gpu_memory_utilization`` × device
        memory after the peak (the draft model's weights included; its activations are not profiled)."""
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        num_tokens = min(self.config.scheduler.max_num_batched_tokens, self.max_model_len)
        meta = AttentionMetadata.build([num_tokens], [num_tokens], [[0] * -(-num_tokens // self.block_size)],
                                       self.block_size, self.device)
        caches, scales = self._allocate_kv(self.model, -(-num_tokens // self.block_size))
        ids = torch.zeros(num_tokens, dtype=torch.long, device=self.device)
        intermediate = None if self.pp.is_first else \
            torch.zeros(2, num_tokens, self.hf_config.hidden_size, dtype=self.dtype, device=self.device)
        with torch.inference_mode(), set_forward_context(self.context(meta, caches, scales)):
            hidden = self.model(ids, torch.arange(num_tokens, device=self.device), intermediate)
            spec = self.config.speculative
            rows_per_seq = 1 + (spec.num_speculative_tokens if spec is not None else 0)  # verified drafts
            rows = min(num_tokens, self.config.scheduler.max_num_seqs * rows_per_seq)
            if self.pp.is_last:
                self.model.compute_logits(hidden[:rows])
        del hidden
        peak = torch.cuda.max_memory_allocated(self.device)
        del caches, scales
        _, total = torch.cuda.mem_get_info(self.device)
        budget = int(total * self.config.cache.gpu_memory_utilization) - peak
        num_blocks = max(2, budget // bytes_per_block)
        logger.info("profiled peak %.2f GiB of %.2f GiB; KV cache gets %.2f GiB: %d blocks, %d tokens",
                    peak / 2**30, total / 2**30, budget / 2**30, num_blocks, num_blocks * self.block_size)
        return num_blocks

    def _update_states(self, sched: SchedulerOutput) -> None:
        """Drop finished requests, add new ones, apply the others' changes and this step's drafts."""
        for rid in sched.finished_req_ids:
            state = self.requests.pop(rid, None)
            if state is not None and self.proposer is not None:
                self.proposer.request_finished(state)
        for rid in sched.preempted_req_ids:  # their drafts were dropped; free the draft distributions now
            if rid in self.requests:
                self.requests[rid].clear_drafts()
        for new in sched.scheduled_new_reqs:
            self.requests[new.req_id] = CachedRequestState(new)
        cached = sched.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            self.requests[rid].update(cached, i, append_new_tokens=not self.pp.is_last)
        for rid in sched.num_scheduled_tokens:
            self.requests[rid].set_scheduled_drafts(sched.scheduled_spec_decode_tokens.get(rid, []))

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step (:meth:`_execute`), with the KV connector's jobs before it (loads of blocks, copies of
        blocks to save) and its report in ``kv_connector_output``."""
        connector = self.kv_connector
        if connector is None:
            return self._execute(sched)
        connector.bind_connector_metadata(sched.kv_connector_metadata)
        try:
            connector.start_load_kv()
            result = self._execute(sched)
        finally:
            connector.clear_connector_metadata()
        result.kv_connector_output = connector.get_finished(sched.finished_req_ids)
        return result

    def _execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        """Compute the scheduled tokens, sample for requests whose chunk reaches their last token, and propose
        the next drafts.

        A request's scheduled tokens past its known ones are its draft tokens
        (``sched.scheduled_spec_decode_tokens``), which are verified (:mod:`kilat.spec_decode.rejection`).
        Each sampling request's new tokens are the accepted drafts then one sampled token.

        Before the last pipeline stage, the step's hidden states go to the next stage and the output is empty.

        Raises:
            RuntimeError: ``sched.structured_output_request_ids`` does not name the requests that sample.
        """
        self._update_states(sched)
        result = ModelRunnerOutput()
        if not sched.num_scheduled_tokens:
            return result
        if self.threads is not None:
            self.threads.maybe_adjust()
        step = self._prepare_inputs(sched)
        hidden, aux = self._forward(step)
        if not self.pp.is_last:
            send_to_next_stage(hidden)
            return result
        for request, row0, pos_from, count in step.prompt_logprobs:
            result.prompt_logprobs[request.request_id] = self._prompt_logprobs(
                request, hidden[row0:row0 + count], pos_from)
        for request, num_new in step.scheduled:
            request.num_computed_tokens += num_new
        if step.sample_reqs:
            self._sample(hidden, step.sample_rows, step.sample_reqs, sched, result)
        if self.proposer is not None:  # above disable_by_batch_size requests, none counts as sampled: no drafts
            limit = self.config.speculative.disable_by_batch_size
            drafted = set(result.sampled_token_ids) if limit is None or len(step.scheduled) <= limit else set()
            self.proposer.propose([request for request, _ in step.scheduled], drafted,
                                  TargetHiddenStates(hidden, aux, step.first_rows, step.first_positions))
            result.spec_token_ids = {r.request_id: r.spec_token_ids for r, _ in step.scheduled if r.spec_token_ids}
        return result

    def _prepare_inputs(self, sched: SchedulerOutput) -> _StepInputs:
        """The step's flattened batch, from the request states (after :meth:`_update_states`): each scheduled
        request's new tokens (its known ones, then its drafts) and positions, which rows sample, and which prompt
        positions want logprobs."""
        step = _StepInputs()
        input_ids, positions = step.input_ids, step.positions
        for rid, num_new in sched.num_scheduled_tokens.items():
            request = self.requests[rid]
            step.scheduled.append((request, num_new))
            start = request.num_computed_tokens
            end = start + num_new
            row0 = len(input_ids)
            step.first_rows.append(row0)
            step.first_positions.append(start)
            num_tokens = request.num_tokens
            if num_new == 1 and end <= num_tokens:  # a decode: its last token
                input_ids.append(request.all_token_ids[start])
                positions.append(start)
            else:
                input_ids.extend(request.all_token_ids[start:end])
                input_ids.extend(request.spec_token_ids[:max(0, end - num_tokens)])
                positions.extend(range(start, end))
            step.query_lens.append(num_new)
            step.seq_lens.append(end)
            step.block_tables.append(request.block_ids)
            if request.sampling_params.prompt_logprobs is not None:
                lp_from = max(start, request.num_prompt_logprobs - 1)
                lp_to = min(end, request.num_prompt_tokens - 1)
                if lp_from < lp_to:
                    step.prompt_logprobs.append((request, row0 + lp_from - start, lp_from, lp_to - lp_from))
            if end >= num_tokens:
                step.sample_rows.extend(range(len(input_ids) - 1 - len(request.spec_token_ids), len(input_ids)))
                step.sample_reqs.append(request)
        return step

    def _forward(self, step: _StepInputs) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The model's forward over the step's batch: a captured CUDA graph for a batch of decodes that fits one,
        else eagerly over every KV-cache group's attention metadata (after the first pipeline stage, on the hidden
        states the previous stage sends).

        Returns:
            The hidden states (before the last stage, what it sends on), and the inputs of the proposer's
            ``aux_hidden_state_layers`` concatenated (``[T, n * hidden]``), or ``None`` when it names none.
        """
        graphs = self.cuda_graphs
        if graphs is not None and len(step.input_ids) == len(step.query_lens) <= graphs.max_batch_size:
            return graphs.run(step.input_ids, step.positions, step.seq_lens,
                              [tables[0] for tables in step.block_tables]), None
        metas = [AttentionMetadata.build(step.query_lens, step.seq_lens, [tables[g] for tables in step.block_tables],
                                         self.block_size, self.device) for g in range(len(self.kv_cache_groups))]
        ids_t = torch.tensor(step.input_ids, dtype=torch.long, device=self.device)
        pos_t = torch.tensor(step.positions, dtype=torch.long, device=self.device)
        intermediate = None if self.pp.is_first else recv_from_prev_stage(
            (2, len(step.input_ids), self.hf_config.hidden_size), self.dtype, self.device)
        context = self.context(metas[0], self.kv_caches, self.kv_scales)
        if len(metas) > 1:
            context.group_metadata, context.layer_groups = metas, self.layer_groups
        context.aux_hidden_state_layers = self._aux_layers
        with set_forward_context(context):
            hidden = self.model(ids_t, pos_t, intermediate)
        return hidden, torch.cat(context.aux_hidden_states, dim=-1) if context.aux_hidden_states else None

    def _sample(self, hidden: torch.Tensor, sample_rows: list[int], sample_reqs: list[CachedRequestState],
                sched: SchedulerOutput, result: ModelRunnerOutput) -> None:
        """Sample (or verify the drafts of) ``sample_reqs`` from ``hidden``'s ``sample_rows``; record their new
        tokens in their states and in ``result``."""
        if sched.grammar_bitmask is not None and \
                sched.structured_output_request_ids != [r.request_id for r in sample_reqs]:
            raise RuntimeError("the grammar bitmask's requests are not the requests that sample this step")
        if len(sample_rows) < hidden.shape[0]:  # else every row samples (the rows are distinct, in order)
            hidden = hidden.index_select(0, torch.tensor(sample_rows, dtype=torch.long, device=self.device))
        drafts = any(r.spec_token_ids for r in sample_reqs)
        # a bare argmax per row reads the head's own dtype: its pick equals the float32 copy's
        logits = self.model.compute_logits(hidden, keep_dtype=not drafts and plain_greedy(sample_reqs,
                                                                                         sched.grammar_bitmask))
        if drafts:
            outcomes = verify(logits, sample_reqs, sched.grammar_bitmask)
        else:
            out = self.sampler(logits, sample_reqs, sched.grammar_bitmask)
            outcomes = [([tok], [lp] if lp is not None else None)
                        for tok, lp in zip(out.token_ids, out.logprobs, strict=True)]
        for request, (tokens, logprobs) in zip(sample_reqs, outcomes, strict=True):
            request.num_computed_tokens -= len(request.spec_token_ids) - (len(tokens) - 1)  # rejected drafts
            request.clear_drafts()
            request.append_tokens(tokens)
            result.sampled_token_ids[request.request_id] = tokens
            if logprobs is not None:
                result.logprobs[request.request_id] = logprobs

    def _prompt_logprobs(self, request: CachedRequestState, hidden: torch.Tensor, pos_from: int
                         ) -> list[PositionLogprobs | None]:
        """Logprobs of prompt tokens ``pos_from + 1 ..`` predicted by ``hidden`` [count, H] (led by position 0's
        ``None`` the first time)."""
        new: list[PositionLogprobs | None] = [] if request.num_prompt_logprobs else [None]
        targets = request.prompt_token_ids[pos_from + 1:pos_from + 1 + hidden.shape[0]]
        logits = self.model.compute_logits(hidden)
        new.extend(compute_prompt_logprobs(logits, targets, request.sampling_params.prompt_logprobs))
        request.num_prompt_logprobs += len(new)
        return new
