"""Batched sampling of the next token, with the semantics of vLLM and the OpenAI API.

One :class:`Sampler` call turns the last-position logits of every scheduled request into one token each.
The processing order follows vLLM:

1. ``logit_bias`` is added (OpenAI ``logit_bias``).
2. ``min_tokens``: while fewer than ``min_tokens`` tokens were generated, ``stop_token_ids`` and (unless
   ``ignore_eos``) the EOS token get logit ``-inf``.
3. Penalties: the CTRL repetition penalty (Keskar et al. 2019, "CTRL: A Conditional Transformer Language
   Model for Controllable Generation", eq. 1) over prompt and output tokens divides positive logits and
   multiplies negative ones; the OpenAI frequency penalty subtracts ``frequency_penalty * count`` and the
   presence penalty ``presence_penalty * (count > 0)``, counting output tokens only. Then structured
   outputs' token bitmask (xgrammar) sets the tokens their grammar forbids to ``-inf``.
4. Greedy rows (``temperature < 1e-5``) take the argmax.
5. Other rows: temperature, top-k, top-p (nucleus), min-p, then a sample drawn by the exponential race
   ``argmax(probs / q)`` with ``q ~ Exponential(1)`` (drawn as ``-log U``), which picks token ``i`` with
   probability ``probs[i] / sum(probs)``. A seeded request draws ``q`` from its own ``torch.Generator``, so its samples
   do not depend on the rest of the batch.

Every step is a tensor operation over the whole batch; Python loops run over requests, never the vocab.
Log-probabilities are of the raw model distribution (log-softmax of the input logits), vLLM's default.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from kilat.model_executor.layers.cpu_kernels import cpu_layer_ops
from kilat.outputs import Logprob, PositionLogprobs
from kilat.sampling_params import SamplingParams

if TYPE_CHECKING:
    from kilat.structured_outputs.manager import TokenBitmask


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """Each row's argmax of ``x`` ``[B, V]`` (float32, bfloat16 or float16): int64 ``[B]``, the first maximum (the
    first NaN in a row that has one), ``torch.argmax``'s rule; for 16-bit ``x`` it equals the argmax of
    ``x.float()`` (the widening is exact). CPU rows go through kilat's vectorized kernel (``kilat_cpu_<isa>::argmax``,
    :mod:`kilat.model_executor.layers.cpu_kernels`; torch's CPU argmax reads a batch's logits at about a third of the
    memory's speed), others through ``torch.argmax``."""
    ops = cpu_layer_ops(x) if x.dim() == 2 else None
    return ops.argmax(x) if ops is not None else x.argmax(dim=-1)


class SamplingRow(Protocol):
    """What sampling reads of one logits row: a :class:`~kilat.core.request.Request`, or a view of one at a
    draft position (speculative decoding), whose ``output_token_ids`` then include the drafts before it."""

    sampling_params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    eos_token_id: int | None
    generator: torch.Generator | None


@dataclass
class SamplerOutput:
    """The result of one sampling step.

    Attributes:
        token_ids: the sampled token of each row, in row order.
        logprobs: per row, the raw log-probabilities of the sampled token and the top-N tokens when the
            request asked for ``logprobs``, else ``None``.
    """

    token_ids: list[int]
    logprobs: list[PositionLogprobs | None]


class Sampler:
    """Samples one token per row of a batch of logits.

    Stateless: all per-request state (parameters, token history, generator) comes from the requests.
    """

    def __call__(self, logits: torch.Tensor, requests: Sequence[SamplingRow],
                 bitmask: TokenBitmask | None = None) -> SamplerOutput:
        """Sample the next token of every request.

        Args:
            logits: float32 ``[B, V]``; row ``i`` holds the next-token logits of ``requests[i]``. Only a
                ``bitmask`` modifies it, in place, and only when no row asks for logprobs (which need it raw).
                When :func:`plain_greedy` holds it may be in the model's 16-bit dtype (:func:`argmax_rows`).
            requests: ``B`` requests supplying ``sampling_params``, ``prompt_token_ids``,
                ``output_token_ids``, ``generator`` and ``eos_token_id``.
            bitmask: structured outputs' allowed tokens of the constrained rows, applied after the
                penalties (a greedy row takes its best allowed token among its top candidates, and is masked
                only when none of them is allowed); ``None`` when no row is constrained.

        Returns:
            A :class:`SamplerOutput` with ``B`` token ids and ``B`` logprob entries.
        """
        if plain_greedy(requests, bitmask):
            return SamplerOutput(argmax_rows(logits).tolist(), [None] * len(requests))
        processed, picked = process_logits(logits, requests, bitmask)
        if len(picked) == len(requests):
            tokens = torch.tensor([picked[i] for i in range(len(requests))], device=logits.device)
        else:
            tokens = _sample(processed, requests)
            if picked:
                tokens[list(picked)] = torch.tensor(list(picked.values()), device=logits.device)
        return SamplerOutput(tokens.tolist(), sample_logprobs(logits, tokens, requests))


def process_logits(logits: torch.Tensor, rows: Sequence[SamplingRow],
                   bitmask: TokenBitmask | None = None) -> tuple[torch.Tensor, dict[int, int]]:
    """Steps 1-3 of the module docstring: logit bias, ``min_tokens``, penalties, then the grammar bitmask.

    Args:
        logits: float32 ``[B, V]``, row ``i`` for ``rows[i]``; only a bitmask modifies it, in place, and only
            when no row asks for logprobs (which need it raw).
        rows: ``B`` rows supplying ``sampling_params``, ``prompt_token_ids``, ``output_token_ids`` and
            ``eos_token_id``.
        bitmask: structured outputs' allowed tokens of the constrained rows, or ``None``.

    Returns:
        ``(processed, picked)``: the processed ``[B, V]`` logits (``logits`` itself when nothing applied) and
        the tokens already chosen for greedy constrained rows, ``{row: token id}``.
    """
    processed = apply_logit_bias(logits, rows)
    processed = apply_min_tokens(processed, rows)
    processed = apply_penalties(processed, rows)
    picked: dict[int, int] = {}
    if bitmask is not None:
        from kilat.structured_outputs.manager import allowed_argmax, apply_bitmask_

        picked = allowed_argmax(processed, bitmask, [r for r in bitmask.rows if rows[r].sampling_params.greedy])
        masked = [r for r in bitmask.rows if r not in picked]
        if masked:
            if processed is logits and any(r.sampling_params.logprobs is not None for r in rows):
                processed = logits.clone()
            apply_bitmask_(processed, bitmask, masked)
    return processed, picked


def compute_prompt_logprobs(logits: torch.Tensor, target_token_ids: list[int] | torch.Tensor,
                            num_logprobs: int) -> list[PositionLogprobs]:
    """Log-probabilities of prompt tokens under the raw model distribution (vLLM ``prompt_logprobs``).

    Args:
        logits: float32 ``[P, V]``; row ``j`` holds the logits computed at prompt position ``p + j``.
        target_token_ids: ``P`` token ids (list or int64 tensor), the prompt token at ``p + j + 1`` for
            each row ``j``.
        num_logprobs: how many of the most likely tokens to add to each entry (0 for none).

    Returns:
        ``P`` dicts ``{token_id: Logprob}`` holding the target token with its 1-based rank plus the top
        ``num_logprobs`` tokens with ranks ``1..num_logprobs``.
    """
    targets = torch.as_tensor(target_token_ids, dtype=torch.long, device=logits.device)
    return _logprob_entries(torch.log_softmax(logits.float(), dim=-1), targets,
                            [num_logprobs] * logits.shape[0])


def plain_greedy(rows: Sequence[SamplingRow], bitmask: TokenBitmask | None = None) -> bool:
    """Whether sampling ``rows`` is a bare argmax each (no grammar, and no row with a temperature, bias, penalty,
    active ``min_tokens`` or logprobs): then the logits need no float32 copy."""
    return bitmask is None and all(_is_plain_greedy(r) for r in rows)


def _is_plain_greedy(request: SamplingRow) -> bool:
    """True when the row is a bare argmax: greedy, no bias, penalties, active ``min_tokens`` or logprobs."""
    params = request.sampling_params
    return (params.greedy and params.logprobs is None and not params.logit_bias
            and not params.uses_penalties and len(request.output_token_ids) >= params.min_tokens)


def apply_logit_bias(logits: torch.Tensor, requests: Sequence[SamplingRow]) -> torch.Tensor:
    """Add each request's OpenAI ``logit_bias`` ({token id: bias}) to its row.

    Args:
        logits: float32 ``[B, V]``, row ``i`` for ``requests[i]``; not modified.

    Returns:
        A new ``[B, V]`` tensor, or ``logits`` itself when no request has a bias.
    """
    rows: list[int] = []
    cols: list[int] = []
    biases: list[float] = []
    for i, request in enumerate(requests):
        for token_id, bias in (request.sampling_params.logit_bias or {}).items():
            rows.append(i)
            cols.append(token_id)
            biases.append(bias)
    if not rows:
        return logits
    device = logits.device
    return logits.index_put((torch.tensor(rows, device=device), torch.tensor(cols, device=device)),
                            torch.tensor(biases, dtype=logits.dtype, device=device), accumulate=True)


def apply_min_tokens(logits: torch.Tensor, requests: Sequence[SamplingRow]) -> torch.Tensor:
    """Set to ``-inf`` the ``stop_token_ids`` and EOS (unless ``ignore_eos``) of rows below ``min_tokens``.

    Args:
        logits: float32 ``[B, V]``, row ``i`` for ``requests[i]``; not modified.

    Returns:
        A new ``[B, V]`` tensor, or ``logits`` itself when no row is masked.
    """
    rows: list[int] = []
    cols: list[int] = []
    for i, request in enumerate(requests):
        params = request.sampling_params
        if len(request.output_token_ids) >= params.min_tokens:
            continue
        banned = list(params.stop_token_ids)
        if not params.ignore_eos and request.eos_token_id is not None:
            banned.append(request.eos_token_id)
        rows.extend([i] * len(banned))
        cols.extend(banned)
    if not rows:
        return logits
    device = logits.device
    return logits.index_put((torch.tensor(rows, device=device), torch.tensor(cols, device=device)),
                            torch.tensor(float("-inf"), dtype=logits.dtype, device=device))


def _padded(seqs: list[list[int]], pad: int, device: torch.device) -> torch.Tensor:
    """int64 ``[len(seqs), max_len]`` of the sequences right-padded with ``pad``."""
    width = max(len(s) for s in seqs)
    return torch.tensor([s + [pad] * (width - len(s)) for s in seqs], dtype=torch.long, device=device)


def apply_penalties(logits: torch.Tensor, requests: Sequence[SamplingRow]) -> torch.Tensor:
    """Apply repetition, frequency and presence penalties to the rows that use any (vLLM order).

    Repetition (CTRL): a logit of a token seen in the prompt or output is divided by the penalty when
    positive and multiplied by it otherwise. Frequency/presence (OpenAI): subtract
    ``frequency_penalty * count + presence_penalty * (count > 0)``, counts over output tokens only.

    Args:
        logits: float32 ``[B, V]``, row ``i`` for ``requests[i]``; not modified.

    Returns:
        A new ``[B, V]`` tensor, or ``logits`` itself when no request uses a penalty.
    """
    rows = [i for i, r in enumerate(requests) if r.sampling_params.uses_penalties]
    if not rows:
        return logits
    vocab = logits.shape[1]
    device = logits.device
    params = [requests[i].sampling_params for i in rows]
    # Token ids are scattered into a [R, V + 1] buffer whose last column absorbs the padding.
    outputs = _padded([requests[i].output_token_ids for i in rows], vocab, device)
    counts = torch.zeros(len(rows), vocab + 1, dtype=logits.dtype, device=device)
    counts.scatter_add_(1, outputs, torch.ones_like(outputs, dtype=logits.dtype))
    counts = counts[:, :vocab]
    prompts = _padded([requests[i].prompt_token_ids for i in rows], vocab, device)
    seen = torch.zeros(len(rows), vocab + 1, dtype=torch.bool, device=device)
    seen.scatter_(1, prompts, True)
    generated = counts > 0
    seen = seen[:, :vocab] | generated

    def column(values: list[float]) -> torch.Tensor:
        return torch.tensor(values, dtype=logits.dtype, device=device).unsqueeze(1)

    sub = logits[rows]
    repetition = torch.where(seen, column([p.repetition_penalty for p in params]), 1.0)
    sub = torch.where(sub > 0, sub / repetition, sub * repetition)
    sub = sub - column([p.frequency_penalty for p in params]) * counts
    sub = sub - column([p.presence_penalty for p in params]) * generated
    return logits.index_put((torch.tensor(rows, device=device),), sub)


def _sample(logits: torch.Tensor, requests: Sequence[SamplingRow]) -> torch.Tensor:
    """int64 ``[B]``: argmax for greedy rows, a random sample for the others."""
    random_rows = [i for i, r in enumerate(requests) if not r.sampling_params.greedy]
    if not random_rows:
        return argmax_rows(logits)
    if len(random_rows) == len(requests):
        return _sample_random(logits, requests)
    tokens = argmax_rows(logits)
    index = torch.tensor(random_rows, device=logits.device)
    tokens[index] = _sample_random(logits[index], [requests[i] for i in random_rows])
    return tokens


def _sample_random(logits: torch.Tensor, requests: Sequence[SamplingRow]) -> torch.Tensor:
    """Temperature → top-k → top-p → min-p → exponential-race sample; int64 ``[R]``."""
    probs = sampling_probs(logits, requests)
    return argmax_rows(probs.div_(exponential_noise(probs.shape, requests, logits.device)))


def sampling_probs(logits: torch.Tensor, requests: Sequence[SamplingRow]) -> torch.Tensor:
    """The distribution a random row samples from: temperature, top-k, top-p, then min-p.

    Args:
        logits: float32 ``[R, V]`` processed logits of non-greedy rows; not modified.
        requests: ``R`` rows supplying ``sampling_params``.

    Returns:
        float32 ``[R, V]`` probabilities; min-p leaves them unnormalized (zeroed tokens are not renormalized),
        which the exponential race and the rejection test both allow: divide by the row sum for a distribution.
    """
    params = [r.sampling_params for r in requests]
    device = logits.device
    temperature = torch.tensor([p.temperature for p in params], dtype=logits.dtype, device=device)
    logits = logits / temperature.unsqueeze(1)
    top_k = [p.top_k for p in params]
    top_p = [p.top_p for p in params]
    if any(p < 1.0 for p in top_p) or any(k > 0 for k in top_k):
        logits = _truncate(logits, top_k, top_p)
    probs = torch.softmax(logits, dim=-1)
    min_p = [p.min_p for p in params]
    if any(m > 0.0 for m in min_p):
        threshold = torch.tensor(min_p, dtype=probs.dtype, device=device).unsqueeze(1)
        probs = probs.masked_fill(probs < threshold * probs.amax(dim=-1, keepdim=True), 0.0)
    return probs


def _truncate(logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """Top-k then top-p (nucleus) truncation: logits below each row's cut-off become ``-inf``.

    Top-k keeps the ``k`` largest logits (0 disables). Top-p then keeps the smallest set of most likely
    remaining tokens whose probability mass reaches ``p``: a token is dropped when the mass of the tokens
    ranked above it is already >= ``p``, so the top token always stays. Only the ``width`` largest logits
    are ranked, where ``width`` is the largest ``k`` of a truncating row (the whole vocab for a top-p row
    without top-k). Ties with the cut-off logit are kept.

    Args:
        logits: float32 ``[R, V]``, temperature already applied.
        top_k: ``R`` values of ``k``; top_p: ``R`` values of ``p`` in (0, 1].
    """
    vocab = logits.shape[1]
    device = logits.device
    ks = [min(k, vocab) if k > 0 else vocab for k in top_k]
    width = max((k for k, p in zip(ks, top_p, strict=True) if k < vocab or p < 1.0), default=0)
    if width == 0:  # every k covers the whole vocabulary and no top-p: nothing to cut
        return logits
    ordered = logits.topk(width, dim=-1).values
    keep = torch.tensor(ks, device=device).clamp_(max=width)
    ordered = ordered.masked_fill(torch.arange(width, device=device) >= keep.unsqueeze(1), float("-inf"))
    if any(p < 1.0 for p in top_p):
        probs = torch.softmax(ordered, dim=-1)
        mass_above = probs.cumsum(dim=-1) - probs
        p = torch.tensor([v if v < 1.0 else float("inf") for v in top_p], dtype=probs.dtype, device=device)
        # at least the top token, even when p underflows to 0 in float32
        keep = torch.minimum(keep, (mass_above < p.unsqueeze(1)).sum(dim=-1).clamp_(min=1))
    cutoff = ordered.gather(1, keep.unsqueeze(1) - 1)
    untouched = torch.tensor([k == vocab and p >= 1.0 for k, p in zip(ks, top_p, strict=True)], device=device)
    cutoff = cutoff.masked_fill(untouched.unsqueeze(1), float("-inf"))
    return logits.masked_fill(logits < cutoff, float("-inf"))


def exponential_noise(shape: torch.Size, requests: Sequence[SamplingRow], device: torch.device) -> torch.Tensor:
    """``[R, V]`` Exponential(1) noise.

    The unseeded rows share one draw from the global RNG. A seeded row's noise depends only on its
    request's generator, so it does not depend on the batch: drawn from that generator when it lives on
    ``device``; otherwise (a CPU generator with CUDA logits) the generator yields a per-step seed for one
    device generator, so no vocab-sized draw runs on the CPU.
    """
    seeded = [i for i, r in enumerate(requests) if r.generator is not None]
    noise = torch.empty(shape, device=device)
    if not seeded:
        return _fill_exponential(noise)
    unseeded = [i for i, r in enumerate(requests) if r.generator is None]
    if unseeded:
        noise[torch.tensor(unseeded, device=device)] = _fill_exponential(
            torch.empty(len(unseeded), shape[1], device=device))
    device_generator: torch.Generator | None = None
    for i in seeded:
        generator = requests[i].generator
        if generator.device != device:
            if device_generator is None:
                device_generator = torch.Generator(device)
            step_seed = torch.randint(2**62, (1,), generator=generator, device=generator.device)
            generator = device_generator.manual_seed(int(step_seed))
        _fill_exponential(noise[i], generator)
    return noise


def _fill_exponential(out: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """Fill ``out`` in place with Exponential(1) samples by inversion, ``-log(U)``, ``U ~ Uniform[0, 1)``.

    Several times faster than ``Tensor.exponential_`` on CPU. Never 0 (``U < 1``); ``U = 0`` gives
    ``+inf``, which only drops that token from the race.
    """
    return out.uniform_(generator=generator).log_().neg_()


def sample_logprobs(logits: torch.Tensor, tokens: torch.Tensor,
                     requests: Sequence[SamplingRow]) -> list[PositionLogprobs | None]:
    """Raw-distribution logprob entries for the rows whose request set ``logprobs``; ``None`` elsewhere."""
    rows = [i for i, r in enumerate(requests) if r.sampling_params.logprobs is not None]
    result: list[PositionLogprobs | None] = [None] * len(requests)
    if not rows:
        return result
    index = torch.tensor(rows, device=logits.device)
    logprobs = torch.log_softmax(logits[index].float(), dim=-1)
    entries = _logprob_entries(logprobs, tokens[index], [requests[i].sampling_params.logprobs for i in rows])
    for i, entry in zip(rows, entries, strict=True):
        result[i] = entry
    return result


def _logprob_entries(logprobs: torch.Tensor, token_ids: torch.Tensor,
                     num_top: list[int]) -> list[PositionLogprobs]:
    """One ``{token_id: Logprob}`` per row: the top ``num_top[i]`` tokens, then ``token_ids[i]``.

    Args:
        logprobs: float32 ``[N, V]`` log-probabilities.
        token_ids: int64 ``[N]``, the chosen token of each row; its rank is 1 + the number of tokens with a
            strictly larger log-probability.
        num_top: per row, how many top tokens to include (ranks ``1..num_top[i]``).
    """
    chosen = logprobs.gather(1, token_ids.unsqueeze(1))
    ranks = ((logprobs > chosen).sum(dim=-1) + 1).tolist()
    width = min(max(num_top, default=0), logprobs.shape[1])
    top_values, top_ids = logprobs.topk(width, dim=-1)
    top_values, top_ids = top_values.tolist(), top_ids.tolist()
    entries: list[PositionLogprobs] = []
    for i, (token_id, value) in enumerate(zip(token_ids.tolist(), chosen.squeeze(1).tolist(), strict=True)):
        n = num_top[i]
        entry = {tid: Logprob(lp, rank + 1)
                 for rank, (tid, lp) in enumerate(zip(top_ids[i][:n], top_values[i][:n], strict=True))}
        entry[token_id] = Logprob(value, ranks[i])
        entries.append(entry)
    return entries
