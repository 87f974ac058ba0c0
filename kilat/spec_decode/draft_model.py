"""Draft-model proposer: a smaller model with the target's vocabulary drafts tokens autoregressively.

The draft model has its own paged KV cache with the target's block layout: the same block ids, so a
request's block table serves both models and prefix-cache hits hold the draft's KV as well as the target's.
To keep that true, after every step the draft computes exactly the positions the target confirmed
(``request.draft_num_computed`` catches up with ``num_computed_tokens``, prompt chunks included, and for
requests that finished in the step too); for a decoding request it continues through the last sampled token and
drafts ``k`` tokens, writing their KV into the lookahead slots the scheduler reserved. The runner does not know
which requests finished in the step (a stop token): it drafts for those too, and the scheduler drops the drafts.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kilat.config import ModelConfig, SpeculativeConfig, dtype_name
from kilat.model_executor.attention import AttentionMetadata
from kilat.model_executor.forward_context import set_forward_context
from kilat.spec_decode.proposer import TargetHiddenStates, num_draft_slots, sample_drafts

if TYPE_CHECKING:
    from kilat.model_executor.model_runner import ModelRunner
    from kilat.model_executor.request_state import CachedRequestState


def draft_model_config(config: SpeculativeConfig, target: ModelConfig, dtype: torch.dtype) -> ModelConfig:
    """The draft's :class:`ModelConfig`: ``config.model`` in the target's resolved ``dtype``."""
    return ModelConfig(model=config.model, load_format=config.load_format, dtype=dtype_name(dtype),
                       seed=target.seed + 1)


class DraftModelProposer:
    """Drafts with the runner's draft model (``runner.draft_model``, KV in ``runner.draft_kv_caches`` and, for an
    int8/fp8 cache, ``runner.draft_kv_scales``).

    Greedy requests get the draft's argmax; random ones a sample from the draft's distribution ``q`` after
    their temperature, top-k, top-p and min-p, with ``q`` kept in ``request.spec_probs`` for verification.

    Args:
        config: ``num_speculative_tokens``.
        runner: the target's runner, holding the loaded draft model and its KV cache.
    """

    def __init__(self, config: SpeculativeConfig, runner: ModelRunner):
        if runner.draft_model is None or runner.draft_kv_caches is None:
            raise ValueError("speculative_config.method 'draft_model' needs the runner to load the draft model")
        self.config = config
        self.num_lookahead_tokens = config.num_speculative_tokens
        self.aux_hidden_state_layers: tuple[int, ...] = ()
        self.model = runner.draft_model
        self.kv_caches = runner.draft_kv_caches
        self.kv_scales = runner.draft_kv_scales
        self.context = runner.context
        self.block_size = runner.block_size
        self.device = runner.device
        self.max_model_len = runner.max_model_len

    def request_finished(self, request: CachedRequestState) -> None:
        """Nothing to keep: the draft's KV lives in the target's blocks, which the scheduler frees."""

    @torch.inference_mode()
    def propose(self, requests: list[CachedRequestState], sampled: set[str], hidden: TargetHiddenStates) -> None:
        """Bring the draft's KV up to each request's confirmed tokens and draft for the decoding ones."""
        batch: list[tuple[CachedRequestState, int, int, int]] = []  # (request, first position, end, drafts wanted)
        tables: dict[str, list[int]] = {}
        for request in requests:
            request.clear_drafts()
            request.draft_num_computed = min(request.draft_num_computed, request.num_computed_tokens)
            wanted = num_draft_slots(request, self.config.num_speculative_tokens, self.max_model_len,
                                     sampled=request.request_id in sampled)
            # (a request that stopped inside its accepted drafts computed tokens past its last one)
            end = request.num_tokens if wanted else min(request.num_computed_tokens, request.num_tokens)
            if end > request.draft_num_computed:
                batch.append((request, request.draft_num_computed, end, wanted))
                tables[request.request_id] = request.block_ids[0]  # with a draft model there is one KV-cache group
        if not batch:
            return
        ids: list[int] = []
        query_lens = []
        for request, start, end, _ in batch:
            ids.extend(request.all_token_ids[start:end])
            query_lens.append(end - start)
        states = self._forward(ids, [p for _, start, end, _ in batch for p in range(start, end)], query_lens,
                               [end for _, _, end, _ in batch], [tables[r.request_id] for r, _, _, _ in batch])
        last_rows = torch.tensor(query_lens, device=self.device).cumsum(0) - 1
        drafting = [(n, r, wanted) for n, (r, _, end, wanted) in enumerate(batch) if wanted]
        for request, _, end, _ in batch:
            request.draft_num_computed = end
        if not drafting:
            return
        active = [(r, wanted) for _, r, wanted in drafting]
        logits = self.model.compute_logits(states[last_rows[[n for n, _, _ in drafting]]])
        q_rows: dict[str, list[torch.Tensor]] = {r.request_id: [] for r, _ in active}
        sample_drafts(logits, [r for r, _ in active], q_rows)
        for step in range(1, max(wanted for _, wanted in active)):
            active = [(r, wanted) for r, wanted in active if wanted > step]
            positions = [r.num_tokens - 1 + step for r, _ in active]
            states = self._forward([r.spec_token_ids[-1] for r, _ in active], positions, [1] * len(active),
                                   [p + 1 for p in positions], [tables[r.request_id] for r, _ in active])
            sample_drafts(self.model.compute_logits(states), [r for r, _ in active], q_rows)
        for request, wanted in ((r, w) for _, r, w in drafting):
            request.draft_num_computed = request.num_tokens + wanted - 1
            if q_rows[request.request_id]:
                request.spec_probs = torch.stack(q_rows[request.request_id])

    def _forward(self, ids: list[int], positions: list[int], query_lens: list[int], seq_lens: list[int],
                 block_tables: list[list[int]]) -> torch.Tensor:
        """Run the draft model over new tokens (writing their KV); float ``[len(ids), hidden]``."""
        meta = AttentionMetadata.build(query_lens, seq_lens, block_tables, self.block_size, self.device)
        ids_t = torch.tensor(ids, dtype=torch.long, device=self.device)
        pos_t = torch.tensor(positions, dtype=torch.long, device=self.device)
        with set_forward_context(self.context(meta, self.kv_caches, self.kv_scales)):
            return self.model(ids_t, pos_t)
