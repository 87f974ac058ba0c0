"""Verification of draft tokens by the target model: greedy prefix matching and speculative sampling.

Speculative sampling (Leviathan et al., ICML 2023, "Fast Inference from Transformers via Speculative
Decoding", Algorithm 1; Chen et al. 2023) keeps the target's output distribution exactly. With the target's
sampling distribution ``p`` and the proposer's ``q`` at each draft position, draft token ``d`` is accepted with
probability ``min(1, p(d) / q(d))``; at the first rejection the token is drawn from
``norm(max(0, p - q))`` and the rest of the drafts are dropped; when every draft is accepted, one more token is
drawn from ``p`` at the position after them. For the n-gram proposer ``q`` is a point mass on ``d``: ``d`` is
accepted with probability ``p(d)`` and a rejection samples from ``p`` without ``d``. Greedy rows accept the
longest prefix of drafts equal to the target's argmax, then add the target's argmax after it.

Row ``j`` of a request with ``k`` drafts holds the target's logits after its drafts ``0 .. j-1``; logit bias,
``min_tokens`` and penalties see those drafts as already generated, so every position is processed as the
non-speculative sampler would process it had the drafts been sampled.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kilat.core.request import Request
from kilat.model_executor.sampler import (
    exponential_noise,
    process_logits,
    sample_logprobs,
    sampling_probs,
)
from kilat.outputs import PositionLogprobs
from kilat.sampling_params import SamplingParams

if TYPE_CHECKING:
    from kilat.structured_outputs.manager import TokenBitmask


class DraftPositionRow:
    """A request seen at draft position ``j``: its output followed by its first ``j`` drafts.

    Args:
        request: the request being verified.
        j: how many of its drafts precede this row's position.
    """

    def __init__(self, request: Request, j: int):
        self.sampling_params: SamplingParams = request.sampling_params
        self.prompt_token_ids = request.prompt_token_ids
        self.output_token_ids = request.output_token_ids + request.spec_token_ids[:j] if j else \
            request.output_token_ids
        self.eos_token_id = request.eos_token_id
        self.generator = request.generator


def verify(logits: torch.Tensor, requests: list[Request], bitmask: TokenBitmask | None = None
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
        argmax = processed.argmax(dim=-1).tolist()
        for i, token in picked.items():
            argmax[i] = token
    random_rows = [i for i, row in enumerate(rows) if not row.sampling_params.greedy]
    probs: dict[int, torch.Tensor] = {}
    if random_rows:
        index = torch.tensor(random_rows, device=device)
        dist = sampling_probs(processed[index], [rows[i] for i in random_rows])
        dist = dist / dist.sum(dim=-1, keepdim=True)
        probs = {row: dist[n] for n, row in enumerate(random_rows)}

    results: list[list[int]] = []
    emitted_rows: list[int] = []
    row0 = 0
    for request in requests:
        k = len(request.spec_token_ids)
        if request.sampling_params.greedy:
            tokens = _accept_greedy(request.spec_token_ids, argmax[row0:row0 + k + 1])
        else:
            tokens = _accept_sampled(torch.stack([probs[row0 + j] for j in range(k + 1)]), request,
                                     rows[row0])
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


def _accept_sampled(p: torch.Tensor, request: Request, row: DraftPositionRow) -> list[int]:
    """Speculative sampling of one request.

    Args:
        p: float32 ``[k + 1, V]``, the target's normalized sampling distribution at each position.
        request: supplies ``spec_token_ids``, ``spec_probs`` (``q``, ``[k, V]``, or ``None`` for point
            masses) and ``generator``.
        row: the request's row at position 0 (its generator draws the uniforms and the final sample).
    """
    drafts = request.spec_token_ids
    k = len(drafts)
    device = p.device
    accepted = 0
    q = request.spec_probs
    if k:
        d = torch.tensor(drafts, device=device)
        p_d = p[:k].gather(1, d.unsqueeze(1)).squeeze(1)
        q_d = q.gather(1, d.unsqueeze(1)).squeeze(1) if q is not None else torch.ones_like(p_d)
        generator = request.generator
        uniform = torch.rand(k, generator=generator, device=generator.device if generator is not None else device)
        accept = (uniform.to(device) * q_d < p_d).tolist()
        while accepted < k and accept[accepted]:
            accepted += 1
    if accepted < k:
        if q is not None:
            dist = (p[accepted] - q[accepted]).clamp_(min=0.0)
        else:
            dist = p[accepted].clone()
            dist[drafts[accepted]] = 0.0
        if not bool(dist.sum() > 0):  # only when p and q agree to rounding: then p itself is the residual
            dist = p[accepted]
    else:
        dist = p[k]
    noise = exponential_noise(torch.Size((1, dist.shape[0])), [row], device)
    return drafts[:accepted] + [int((dist.unsqueeze(0) / noise).argmax())]
