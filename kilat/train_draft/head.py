"""The trainable EAGLE-3 head: the math of :mod:`kilat.model_executor.models.llama_eagle3` in plain, differentiable
torch, with the training-time test of EAGLE-3 (Li et al., 2025) — the head learns from its own drafted features.

Its ``state_dict`` carries the checkpoint names vLLM and SGLang load (``midlayer.self_attn.q_proj.weight``,
``fc.weight``, ``norm.weight``, ``lm_head.weight``, buffers ``d2t`` and ``t2d``); the target's embedding table is
held frozen and not saved (a head without ``embed_tokens`` uses the target's).

Training-time test, for one sequence of ``T`` tokens: step 0 computes, at every row ``p``, position ``p`` from the
token ``t[p + 1]`` and ``fc`` of the target's hidden states at ``p``, attending causally to step 0's keys — what
the head computes over the target's confirmed positions at serving time. Step ``j > 0`` treats row ``p`` as the
last confirmed position and computes position ``p + j`` from ``t[p + j + 1]`` and step ``j - 1``'s pre-norm output
at row ``p``, attending to step 0's keys at rows ``<= p`` and to its own row's keys of steps ``1 .. j`` — what the
``j``-th draft sees. Every step's logits at row ``p`` predict ``t[p + j + 2]``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class _RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class _Attention(nn.Module):
    def __init__(self, hidden: int, heads: int, kv_heads: int, head_dim: int) -> None:
        super().__init__()
        self.q_proj = nn.Linear(2 * hidden, heads * head_dim, bias=False)
        self.k_proj = nn.Linear(2 * hidden, kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(2 * hidden, kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(heads * head_dim, hidden, bias=False)


class _MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class _Layer(nn.Module):
    def __init__(self, hidden: int, heads: int, kv_heads: int, head_dim: int, intermediate: int, eps: float) -> None:
        super().__init__()
        self.input_layernorm = _RMSNorm(hidden, eps)
        self.hidden_norm = _RMSNorm(hidden, eps)
        self.self_attn = _Attention(hidden, heads, kv_heads, head_dim)
        self.post_attention_layernorm = _RMSNorm(hidden, eps)
        self.mlp = _MLP(hidden, intermediate)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding (GPT-NeoX halves) of ``x [T, heads, head_dim]`` with ``cos``/``sin`` ``[T, head_dim]``."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos[:, None] + rotated * sin[:, None]


class TrainableEagle3Head(nn.Module):
    """An EAGLE-3 head for a Llama-family target, trained with the training-time test (module docstring).

    Args:
        hidden_size, num_heads, num_kv_heads, head_dim, intermediate_size, rms_norm_eps: the decoder layer's shape
            (the target's own under ``kilat train-draft``).
        inv_freq, attention_scaling: the rotary embedding (float32 ``[head_dim // 2]`` and the cos/sin scale, as
            :func:`~kilat.model_executor.layers.rope_inv_freq` gives them for the head's config).
        target_hidden_size: the target's hidden size (``fc`` reads three of its hidden states).
        draft_ids: int64 ``[draft_vocab]``, the target ids of the draft vocabulary in increasing order.
        vocab_size: the target's vocabulary size.
        embed_tokens: the target's embedding table ``[vocab_size, hidden_size]`` (frozen, not saved).
    """

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int, intermediate_size: int,
                 rms_norm_eps: float, inv_freq: torch.Tensor, attention_scaling: float, target_hidden_size: int,
                 draft_ids: torch.Tensor, vocab_size: int, embed_tokens: torch.Tensor) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.fc = nn.Linear(3 * target_hidden_size, hidden_size, bias=False)
        self.midlayer = _Layer(hidden_size, num_heads, num_kv_heads, head_dim, intermediate_size, rms_norm_eps)
        self.norm = _RMSNorm(hidden_size, rms_norm_eps)
        self.lm_head = nn.Linear(hidden_size, draft_ids.numel(), bias=False)
        self.register_buffer("d2t", draft_ids - torch.arange(draft_ids.numel()))
        t2d = torch.zeros(vocab_size, dtype=torch.bool)
        t2d[draft_ids] = True
        self.register_buffer("t2d", t2d)
        self.register_buffer("target_to_draft", torch.full((vocab_size,), -1, dtype=torch.long).index_put_(
            (draft_ids,), torch.arange(draft_ids.numel())), persistent=False)
        self.register_buffer("embed", embed_tokens.detach().float(), persistent=False)
        self.register_buffer("inv_freq", inv_freq.float(), persistent=False)
        self.attention_scaling = attention_scaling

    def _rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * self.inv_freq[None]
        angles = torch.cat([freqs, freqs], dim=-1)
        return angles.cos() * self.attention_scaling, angles.sin() * self.attention_scaling

    def _qkv(self, tokens: torch.Tensor, features: torch.Tensor, positions: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        layer = self.midlayer
        normed = layer.hidden_norm(features)
        x = torch.cat([layer.input_layernorm(self.embed[tokens]), normed], dim=-1)
        attn = layer.self_attn
        cos, sin = self._rope(positions)
        q = _rotate(attn.q_proj(x).view(-1, self.num_heads, self.head_dim), cos, sin)
        k = _rotate(attn.k_proj(x).view(-1, self.num_kv_heads, self.head_dim), cos, sin)
        v = attn.v_proj(x).view(-1, self.num_kv_heads, self.head_dim)
        return q, k, v, features

    def _finish(self, attended: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(logits over the draft vocabulary, pre-norm output)`` from the attention's output ``[R, heads*hd]``."""
        layer = self.midlayer
        h = layer.self_attn.o_proj(attended) + residual
        out = layer.mlp(layer.post_attention_layernorm(h)) + h
        return self.lm_head(self.norm(out)), out

    def forward(self, tokens: torch.Tensor, aux: torch.Tensor, num_steps: int, first_label: int = 0
                ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The training-time test over one sequence.

        Args:
            tokens: int64 ``[T]``, the sequence.
            aux: float ``[T, 3 * target_hidden]``, the target's hidden states at each position.
            num_steps: drafts simulated (1: step 0 only).
            first_label: the first token index the head learns to predict (the response's start): rows whose every
                prediction lies before it are skipped (they still serve as step 0's keys).

        Returns:
            Per step ``j``: ``(logits [R_j, draft_vocab], labels [R_j])`` for anchor rows ``p`` from
            ``max(0, first_label - 1 - num_steps)`` to ``T - 2 - j``: the logits predicting ``t[p + j + 2]`` and
            that token's draft id (-1 where it is before ``first_label``, past the end or outside the draft
            vocabulary: not learned).
        """
        length = tokens.shape[0]
        device = tokens.device
        group = self.num_heads // self.num_kv_heads
        rows = length - 1  # positions with a known next token
        lo = max(0, min(first_label - 1 - num_steps, rows - 1))
        labels = torch.full((length + num_steps + 1,), -1, dtype=torch.long, device=device)
        labels[first_label:length] = self.target_to_draft[tokens[first_label:]]
        q, k0, v0, residual = self._qkv(tokens[1:], self.fc(aux[:rows]), torch.arange(rows, device=device))
        k0 = k0.repeat_interleave(group, 1).transpose(0, 1)  # [heads, rows, head_dim]
        v0 = v0.repeat_interleave(group, 1).transpose(0, 1)
        anchors = torch.arange(lo, rows, device=device)
        visible = torch.arange(rows, device=device)[None] <= anchors[:, None]  # step 0's keys at positions <= p
        attended = F.scaled_dot_product_attention(q[lo:].transpose(0, 1), k0, v0, attn_mask=visible)
        logits, prenorm = self._finish(attended.transpose(0, 1).reshape(rows - lo, -1), residual[lo:])
        out = [(logits, labels[lo + 2:rows + 2])]
        scale = self.head_dim ** -0.5
        own_k: list[torch.Tensor] = []
        own_v: list[torch.Tensor] = []
        for step in range(1, num_steps):
            count = rows - step - lo  # anchors lo .. rows - step - 1 (their token t[p + step + 1] is known)
            if count <= 0:
                break
            q, k, v, residual = self._qkv(tokens[lo + step + 1:length], prenorm[:count],
                                          torch.arange(lo + step, rows, device=device))
            own_k.append(k.repeat_interleave(group, 1).transpose(0, 1))  # [heads, count, head_dim]
            own_v.append(v.repeat_interleave(group, 1).transpose(0, 1))
            q = q.transpose(0, 1)
            scores = (q @ k0.transpose(1, 2)) * scale  # [heads, count, rows]
            scores = scores.masked_fill(~visible[:count], float("-inf"))
            mine = torch.stack([(q * ok[:, :count]).sum(-1) for ok in own_k], dim=-1) * scale  # [heads, count, step]
            weights = torch.cat([scores, mine], dim=-1).softmax(-1)
            attended = weights[..., :rows] @ v0 + (weights[..., rows:, None] * torch.stack(
                [ov[:, :count] for ov in own_v], dim=2)).sum(2)
            logits, prenorm = self._finish(attended.transpose(0, 1).reshape(count, -1), residual)
            out.append((logits, labels[lo + step + 2:lo + step + 2 + count]))
        return out
