"""The model runner's own state of each request it holds, kept up to date from :class:`SchedulerOutput` data alone
(vLLM V1's ``CachedRequestState``): the runner never reads the scheduler's ``Request`` objects.
"""

from __future__ import annotations

import torch

from kilat.core.block_pool import NULL_BLOCK_ID
from kilat.core.request import TokenSequence
from kilat.core.scheduler_output import CachedRequestData, NewRequestData
from kilat.sampling_params import SamplingParams


class CachedRequestState(TokenSequence):
    """One request as the runner sees it: what sampling, verification and the proposers read.

    Created from :class:`NewRequestData` and dropped when the request's id comes in ``finished_req_ids``; a
    preempted request keeps its state (tokens, generator, prompt logprobs done) until it resumes.

    Args:
        new: the request's first scheduling.

    Attributes:
        request_id, prompt_token_ids, sampling_params, eos_token_id: as sent.
        output_token_ids: tokens the runner sampled for it (accepted drafts included).
        all_token_ids: prompt then output tokens.
        max_tokens: ``sampling_params.max_tokens``.
        generator: a CPU generator seeded with ``seed + index`` when the request has a seed, else ``None``.
        block_ids: its KV block table of each KV-cache group (entries a sliding window left behind are the null
            block).
        num_null_blocks: leading entries of each group's table known to be the null block.
        num_computed_tokens: positions whose target KV is computed.
        spec_token_ids: the drafts to verify this step, or (after the step) those proposed for the next.
        spec_probs: float32 ``[len(spec_token_ids), V]``, the draft model's ``q`` for random drafts, else ``None``.
        draft_num_computed: leading positions whose draft-model KV is valid.
        num_prompt_logprobs: prompt positions whose logprobs were sent (position 0's ``None`` included).
    """

    def __init__(self, new: NewRequestData):
        self.request_id = new.req_id
        self.prompt_token_ids = list(new.prompt_token_ids)
        self.num_prompt_tokens = len(self.prompt_token_ids)
        self.all_token_ids = list(self.prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.sampling_params: SamplingParams = new.sampling_params
        self.eos_token_id = new.eos_token_id
        self.max_tokens = new.sampling_params.max_tokens
        self.generator: torch.Generator | None = None
        if new.sampling_params.seed is not None:
            self.generator = torch.Generator()
            self.generator.manual_seed(new.sampling_params.seed + new.index)
        self.block_ids = [list(table) for table in new.block_ids]
        self.num_null_blocks = [0] * len(self.block_ids)
        self.num_computed_tokens = new.num_computed_tokens
        self.spec_token_ids: list[int] = []
        self.spec_probs: torch.Tensor | None = None
        self.draft_num_computed = new.num_computed_tokens  # cached blocks hold a draft model's KV too
        self.num_prompt_logprobs = 0

    def update(self, cached: CachedRequestData, i: int, append_new_tokens: bool = False) -> None:
        """Apply row ``i`` of ``cached`` (this request's changes since its last step); with ``append_new_tokens``
        (a pipeline stage that does not sample) also record the tokens sampled since."""
        self.num_computed_tokens = cached.num_computed_tokens[i]
        if append_new_tokens:
            self.append_tokens(cached.new_token_ids[i])
        if cached.resumed_from_preemption[i]:
            self.block_ids = [list(table) for table in cached.new_block_ids[i]]
            self.draft_num_computed = self.num_computed_tokens
            self.num_null_blocks = list(cached.num_null_blocks[i])
            return
        for g, (table, new_blocks) in enumerate(zip(self.block_ids, cached.new_block_ids[i], strict=True)):
            del table[cached.num_blocks[i][g] - len(new_blocks):]
            table.extend(new_blocks)
            num_null, known = cached.num_null_blocks[i][g], self.num_null_blocks[g]
            if num_null > known:  # blocks freed behind the window
                table[known:num_null] = [NULL_BLOCK_ID] * (num_null - known)
                self.num_null_blocks[g] = num_null

    def set_scheduled_drafts(self, drafts: list[int]) -> None:
        """Keep the drafts the scheduler sent for this step (a prefix of those proposed, maybe none)."""
        self.spec_probs = self.spec_probs[:len(drafts)] if self.spec_probs is not None and drafts else None
        self.spec_token_ids = list(drafts)

    def clear_drafts(self) -> None:
        """Drop the drafts and their distributions."""
        self.spec_token_ids = []
        self.spec_probs = None

    def append_tokens(self, tokens: list[int]) -> None:
        """Record the step's new tokens (its accepted drafts, then the target's token)."""
        self.output_token_ids.extend(tokens)
        self.all_token_ids.extend(tokens)
