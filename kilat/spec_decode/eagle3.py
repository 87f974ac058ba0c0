"""EAGLE-3 proposer: a one-layer head drafts from the target's own hidden states (Li et al., 2025; the head is
:mod:`kilat.model_executor.models.llama_eagle3`).

The head has its own one-layer paged KV cache in the target's blocks (like a draft model's). Its entry at position
``p`` is computed from the token ``t[p + 1]`` and a feature of ``p``: the target's hidden states of ``p`` for the
target's sequence, the head's own pre-norm output at ``p - 1`` for drafted positions. After every step the head
computes exactly the positions the target confirmed in it (the first rows of each request's span whose tokens
were accepted; prompt chunks included), from the step's :class:`TargetHiddenStates`; blocks the prefix cache hands
to a later request therefore hold its KV as well (computed with the next token the first request had). For a
decoding request its output at the last confirmed position gives the first draft; each further draft is one
decode step of the head at the next position, fed its previous pre-norm output. Drafted positions are
overwritten once the target has verified them, so the head writes at most ``k - 1`` slots past a request's last
token (its ``num_lookahead_tokens``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kilat.config import SpeculativeConfig
from kilat.model_executor.attention import AttentionMetadata
from kilat.model_executor.forward_context import set_forward_context
from kilat.spec_decode.proposer import TargetHiddenStates, num_draft_slots, sample_drafts

if TYPE_CHECKING:
    from kilat.model_executor.model_runner import ModelRunner
    from kilat.model_executor.request_state import CachedRequestState


class Eagle3Proposer:
    """Drafts with the runner's EAGLE-3 head (``runner.draft_model``, its KV in ``runner.draft_kv_caches``).

    Greedy requests get the head's argmax; random ones a sample from its distribution ``q`` (over the draft
    vocabulary, zero elsewhere) after their temperature, top-k, top-p and min-p, kept in ``request.spec_probs``
    for verification.

    Args:
        config: ``num_speculative_tokens``.
        runner: the target's runner, holding the loaded head, its KV cache and the aux layers it reads.

    Raises:
        ValueError: the runner holds no EAGLE-3 head.
    """

    def __init__(self, config: SpeculativeConfig, runner: ModelRunner):
        if runner.draft_model is None or runner.draft_kv_caches is None or not runner.draft_aux_layers:
            raise ValueError("speculative_config.method 'eagle3' needs the runner to load the EAGLE-3 head")
        self.config = config
        self.num_lookahead_tokens = config.num_speculative_tokens - 1
        self.aux_hidden_state_layers: tuple[int, ...] = runner.draft_aux_layers
        self.model = runner.draft_model
        self.kv_caches = runner.draft_kv_caches
        self.kv_scales = runner.draft_kv_scales
        self.context = runner.context
        self.block_size = runner.block_size
        self.device = runner.device
        self.max_model_len = runner.max_model_len

    def request_finished(self, request: CachedRequestState) -> None:
        """Nothing to keep: the head's KV lives in the target's blocks, which the scheduler frees."""

    @torch.inference_mode()
    def propose(self, requests: list[CachedRequestState], sampled: set[str], hidden: TargetHiddenStates) -> None:
        """Run the head over each request's confirmed positions of the step and draft for the decoding ones."""
        if hidden.aux is None:
            raise RuntimeError("the EAGLE-3 proposer got no auxiliary hidden states from the target")
        rows: list[int] = []
        ids: list[int] = []
        positions: list[int] = []
        query_lens: list[int] = []
        seq_lens: list[int] = []
        tables: list[list[int]] = []
        drafting: list[tuple[int, CachedRequestState, int]] = []  # (last row in the head's batch, request, drafts)
        for request, row0, start in zip(requests, hidden.first_rows, hidden.first_positions, strict=True):
            request.clear_drafts()
            # positions whose next token is known: a request that stopped inside its accepted drafts computed
            # tokens past its last one
            end = min(request.num_computed_tokens, request.num_tokens - 1)
            if end <= start:
                continue
            rows.extend(range(row0, row0 + end - start))
            ids.extend(request.all_token_ids[start + 1:end + 1])
            positions.extend(range(start, end))
            query_lens.append(end - start)
            seq_lens.append(end)
            tables.append(request.block_ids[0])  # with a head there is one KV-cache group
            wanted = num_draft_slots(request, self.config.num_speculative_tokens, self.max_model_len,
                                     sampled=request.request_id in sampled)
            if wanted:
                drafting.append((len(ids) - 1, request, wanted))
        if not ids:
            return
        features = hidden.aux.index_select(0, torch.tensor(rows, dtype=torch.long, device=self.device))
        normed, prenorm = self._forward(ids, positions, query_lens, seq_lens, tables, features)
        if not drafting:
            return
        last = torch.tensor([row for row, _, _ in drafting], dtype=torch.long, device=self.device)
        active = [(request, wanted) for _, request, wanted in drafting]
        q_rows: dict[str, list[torch.Tensor]] = {r.request_id: [] for r, _ in active}
        normed, prenorm = normed[last], prenorm[last]
        self._draft(normed, [r for r, _ in active], q_rows)
        for step in range(1, max(wanted for _, wanted in active)):
            keep = [i for i, (_, wanted) in enumerate(active) if wanted > step]
            if len(keep) < len(active):
                prenorm = prenorm[torch.tensor(keep, dtype=torch.long, device=self.device)]
                active = [active[i] for i in keep]
            step_positions = [r.num_tokens - 2 + step for r, _ in active]
            normed, prenorm = self._forward([r.spec_token_ids[-1] for r, _ in active], step_positions,
                                            [1] * len(active), [p + 1 for p in step_positions],
                                            [r.block_ids[0] for r, _ in active], prenorm)
            self._draft(normed, [r for r, _ in active], q_rows)
        for _, request, _ in drafting:
            if q_rows[request.request_id]:
                request.spec_probs = torch.stack(q_rows[request.request_id])

    def _draft(self, normed: torch.Tensor, requests: list[CachedRequestState], q_rows: dict[str, list[torch.Tensor]]
               ) -> None:
        """Append one draft per request from the head's states ``normed [len(requests), hidden]``: for all-greedy
        rows the argmax over the draft vocabulary mapped to its target id (no logits spread over the whole
        vocabulary), else :func:`sample_drafts`."""
        if all(r.sampling_params.greedy for r in requests):
            picks = self.model.draft_to_target[self.model.lm_head.compute_logits(normed).argmax(-1)]
            for request, token in zip(requests, picks.tolist(), strict=True):
                request.spec_token_ids.append(token)
            return
        sample_drafts(self.model.compute_logits(normed), requests, q_rows)

    def _forward(self, ids: list[int], positions: list[int], query_lens: list[int], seq_lens: list[int],
                 block_tables: list[list[int]], features: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Run the head over new positions (writing their KV); ``(normed, prenorm)``, each ``[len(ids), hidden]``."""
        meta = AttentionMetadata.build(query_lens, seq_lens, block_tables, self.block_size, self.device)
        ids_t = torch.tensor(ids, dtype=torch.long, device=self.device)
        pos_t = torch.tensor(positions, dtype=torch.long, device=self.device)
        with set_forward_context(self.context(meta, self.kv_caches, self.kv_scales)):
            return self.model(ids_t, pos_t, features)
