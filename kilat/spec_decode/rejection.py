"""Verification of draft tokens by the target model: greedy prefix matching and speculative sampling.

Speculative sampling (Leviathan et al., ICML 2023, "Fast Inference from Transformers via Speculative
Decoding", Algorithm 1; Chen et al. 2023) keeps the target's output distribution exactly. With the target's
sampling distribution ``p`` and the proposer's ``q`` at each draft position, draft token ``d`` is accepted with
probability ``min(1, p(d) / q(d))``; at the first rejection the token is drawn from
``norm(max(0, p - q))`` and the rest of the drafts are dropped; when every draft is accepted, one more token is
drawn from ``p`` at the position after them. For the n-gram proposer ``q`` is a point mass on ``d``, and the test
reduces to sampling ``t ~ p`` and accepting ``d`` when ``t == d`` (probability ``p(d)``; otherwise ``t`` is a
sample of ``p`` without ``d``, the residual): each position is sampled exactly as without speculation, with
the same draws from a seeded request's generator, so seeded outputs do not change with n-gram speculation.
Greedy rows accept the longest prefix of drafts equal to the target's argmax, then add the target's argmax
after it.

Row ``j`` of a request with ``k`` drafts holds the target's logits after its drafts ``0 .. j-1``; logit bias,
``min_tokens`` and penalties see those drafts as already generated, so every position is processed as the
non-speculative sampler would process it had the drafts been sampled.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kilat.model_executor.sampler import (
    argmax_rows,
    exponential_noise,
    process_logits,
    sample_logprobs,
    sampling_probs,
)
from kilat.outputs import PositionLogprobs
from kilat.sampling_params import SamplingParams

if TYPE_CHECKING:
    from kilat.model_executor.request_state import CachedRequestState
    from kilat.structured_outputs.manager import TokenBitmask


class DraftPositionRow:
    """A request seen at draft position ``j``: its output followed by its first ``j`` drafts.

    Args:
        request: the request being verified.
        j: how many of its drafts precede this row's position.
    """

    def __init__(self, request: CachedRequestState, j: int):
        self.sampling_params: SamplingParams = request.sampling_params
        self.prompt_token_ids = request.prompt_token_ids
        self.output_token_ids = request.output_token_ids + request.spec_token_ids[:j] if j else \
            request.output_token_ids
        self.eos_token_id = request.eos_token_id
        self.generator = request.generator


def verify(logits: torch.Tensor, requests: list[CachedRequestState], bitmask: TokenBitmask | None = None
           ) -> list[tuple[list[int], list[PositionLogprobs] | None]]:
    """Verify every request's drafts and produce its accepted drafts plus one token of the target's.

    Args:
        logits: float32 ``[N, V]``, ``N = Σ (len(r.spec_token_ids) + 1)``: for each request in order, the
            target's logits at its last known token and at each of its drafts.
        requests: the requests, with ``spec_token_ids`` (and ``spec_probs``, float32 ``[k, V]``, for drafts a
            draft model sampled; ``None`` means point masses).
        bitmask: structured outputs' allowed tokens, by row of ``logits`` (a constrained request's rows are
            filled after each of its drafts, see :func:`~kilat.structured_outputs.manager.build_bitmask`).

    Returns:
        Per request: ``(token_ids, logprobs)``, with ``1 .. k + 1`` tokens (the accepted drafts, then the
        target's) and, when the request asks for logprobs, the raw logprobs of each.
    """
    rows = [DraftPositionRow(r, j) for r in requests for j in range(len(r.spec_token_ids) + 1)]
    processed, picked = process_logits(logits, rows, bitmask)
    device = logits.device
    greedy = [i for i, row in enumerate(rows) if row.sampling_params.greedy]
    argmax: list[int] = []
    if greedy:
        argmax = argmax_rows(processed).tolist()
        for i, token in picked.items():
            argmax[i] = token
    random_rows = [i for i, row in enumerate(rows) if not row.sampling_params.greedy]
    dist = torch.empty(0)
    if random_rows:
        index = torch.tensor(random_rows, device=device)
        dist = sampling_probs(processed[index], [rows[i] for i in random_rows])

    results: list[list[int]] = []
    emitted_rows: list[int] = []
    row0 = 0
    num_random = 0  # rows of dist used so far (a request's rows are all greedy or all random)
    for request in requests:
        k = len(request.spec_token_ids)
        if request.sampling_params.greedy:
            tokens = _accept_greedy(request.spec_token_ids, argmax[row0:row0 + k + 1])
        elif request.spec_probs is None:
            tokens = _sample_point_mass(dist[num_random:num_random + k + 1], request.spec_token_ids,
                                        rows[row0:row0 + k + 1])
            num_random += k + 1
        else:
            tokens = _accept_sampled(dist[num_random:num_random + k + 1], request, rows[row0])
            num_random += k + 1
        results.append(tokens)
        emitted_rows.extend(range(row0, row0 + len(tokens)))
        row0 += k + 1

    token_tensor = torch.tensor([t for tokens in results for t in tokens], device=device)
    logprobs = sample_logprobs(logits[torch.tensor(emitted_rows, device=device)], token_tensor,
                               [rows[i] for i in emitted_rows])
    out = []
    n = 0
    for tokens in results:
        entries = logprobs[n:n + len(tokens)]
        out.append((tokens, entries if entries[0] is not None else None))
        n += len(tokens)
    return out


def _accept_greedy(drafts: list[int], argmax: list[int]) -> list[int]:
    """The longest prefix of ``drafts`` equal to the target's argmax, then the argmax after it."""
    accepted = 0
    while accepted < len(drafts) and drafts[accepted] == argmax[accepted]:
        accepted += 1
    return argmax[:accepted + 1]


def _race(probs: torch.Tensor, row: DraftPositionRow) -> int:
    """A sample of ``probs`` ``[V]`` (not necessarily normalized) by the sampler's exponential race, drawn
    from ``row``'s generator as the non-speculative sampler draws it."""
    noise = exponential_noise(torch.Size((1, probs.shape[0])), [row], probs.device)
    return int((probs.unsqueeze(0) / noise).argmax())


def _sample_point_mass(p: torch.Tensor, drafts: list[int], rows: list[DraftPositionRow]) -> list[int]:
    """Verify point-mass drafts: sample each position from ``p`` ``[k + 1, V]`` in turn and keep going while
    the sample equals the draft; the first sample that differs (or the one after the last draft) ends it."""
    tokens: list[int] = []
    for j, row in enumerate(rows):
        tokens.append(_race(p[j], row))
        if j == len(drafts) or tokens[-1] != drafts[j]:
            return tokens
    return tokens


def _accept_sampled(p: torch.Tensor, request: CachedRequestState, row: DraftPositionRow) -> list[int]:
    """Speculative sampling of one request whose drafts a draft model sampled from ``request.spec_probs``.

    Args:
        p: float32 ``[k + 1, V]``, the target's sampling distribution at each position (min-p may leave it
            unnormalized).
        request: supplies ``spec_token_ids``, ``spec_probs`` (``q``, float32 ``[k, V]``, normalized) and
            ``generator``.
        row: the request's row at position 0 (its generator draws the uniforms and the final sample).
    """
    drafts = request.spec_token_ids
    q = request.spec_probs
    assert q is not None
    p = p / p.sum(dim=-1, keepdim=True)
    k = len(drafts)
    device = p.device
    d = torch.tensor(drafts, device=device)
    p_d = p[:k].gather(1, d.unsqueeze(1)).squeeze(1)
    q_d = q.gather(1, d.unsqueeze(1)).squeeze(1)
    generator = request.generator
    uniform = torch.rand(k, generator=generator, device=generator.device if generator is not None else device)
    accept = (uniform.to(device) * q_d < p_d).tolist()
    accepted = 0
    while accepted < k and accept[accepted]:
        accepted += 1
    if accepted == k:
        return drafts + [_race(p[k], row)]
    residual = (p[accepted] - q[accepted]).clamp_(min=0.0)
    if not bool(residual.sum() > 0):  # only when p and q agree to rounding: then p itself is the residual
        residual = p[accepted]
    return drafts[:accepted] + [_race(residual, row)]
