"""Token embedding and the output projection, split over the vocabulary across tensor-parallel ranks (vLLM's
``VocabParallelEmbedding`` and ``ParallelLMHead``; Megatron-LM's vocabulary-parallel embedding).

Rank ``r`` of ``tp`` holds vocabulary rows ``[r * n, (r + 1) * n)`` with ``n = ceil(vocab_size / tp)``; rows
past the vocabulary are zero padding, so every rank's table has the same shape and a tied ``lm_head`` shares
it as is. With one rank both hold the whole table and run no collective.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kilat.distributed.parallel_state import (
    get_tp_group,
    tensor_model_parallel_all_gather,
    tensor_model_parallel_all_reduce,
)
from kilat.model_executor.layers.linear import ColumnParallelLinear
from kilat.model_executor.layers.quantization import QuantizationConfig, kernels


def vocab_rows_per_rank(vocab_size: int, tp_size: int) -> int:
    """Rows of the vocabulary each of ``tp_size`` ranks holds (the last one's tail is padding)."""
    return -(-vocab_size // tp_size)


class VocabParallelEmbedding(nn.Module):
    """Embedding lookup ``weight[input_ids]`` with an uninitialized table of this rank's vocabulary rows
    (``[ceil(num_embeddings / tp), embedding_dim]``). Split, each rank looks up the ids it holds, writes zeros
    for the others, and the ranks' rows are summed (all-reduce).

    With one rank the table may instead be a quantized
    :class:`~kilat.model_executor.layers.quantization.kernels.QuantWeight` (:meth:`load_weight`, e.g. a GGUF
    file's Q8_0 table under ``--quantization gguf``): rows are then dequantized as they are looked up, and the
    dense ``weight`` is dropped after loading.

    Attributes:
        qweight: the quantized table, or ``None``.
        vocab_start: the first token id this rank holds; num_valid: how many it holds (the rest is padding).

    Shapes: int64 ``input_ids [T] -> [T, embedding_dim]`` in the model dtype.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        group = get_tp_group()
        self.num_embeddings, self.tp_size = num_embeddings, group.world_size
        rows = vocab_rows_per_rank(num_embeddings, group.world_size)
        self.vocab_start = group.rank * rows
        self.num_valid = max(0, min(num_embeddings - self.vocab_start, rows))
        self.weight = nn.Parameter(torch.empty(rows, embedding_dim, dtype=dtype), requires_grad=False)
        self.dtype = self.weight.dtype
        self.qweight: kernels.QuantWeight | None = None

    def load_weight(self, tensor: torch.Tensor | kernels.QuantWeight) -> None:
        """Copy this rank's rows of a dense ``[num_embeddings, embedding_dim]`` table into ``weight`` (zeros for
        the padding), or hold a quantized one (one rank only).

        Raises:
            ValueError: a shape mismatch, or a quantized table with several ranks.
        """
        dense = isinstance(tensor, torch.Tensor)
        shape = (self.num_embeddings, self.weight.shape[1])
        got = tuple(tensor.shape) if dense else (tensor.out_features, tensor.in_features)
        if got != shape:
            raise ValueError(f"embedding: expected shape {shape}, got {got}")
        if not dense:
            if self.tp_size > 1:
                raise ValueError("a quantized embedding table cannot be split across tensor-parallel ranks")
            self.qweight = tensor
            return
        self.weight.data[:self.num_valid].copy_(tensor[self.vocab_start:self.vocab_start + self.num_valid])
        self.weight.data[self.num_valid:].zero_()

    def process_weights_after_loading(self) -> None:
        """Drop the dense placeholder of a quantized table (its pages were never written)."""
        if self.qweight is not None and "weight" in self._parameters:
            del self.weight

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """int64 ``input_ids [T] -> [T, embedding_dim]``."""
        if self.qweight is not None:
            return kernels.embedding(input_ids, self.qweight, self.dtype)
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.num_valid)
        out = F.embedding(local.masked_fill(outside, 0), self.weight).masked_fill_(outside.unsqueeze(-1), 0)
        return tensor_model_parallel_all_reduce(out)

    def extra_repr(self) -> str:
        if self.qweight is not None:
            return f"{self.qweight.out_features}, {self.qweight.in_features}, {self.qweight.bits}-bit"
        split = f", rows {self.vocab_start}+{self.num_valid}" if self.tp_size > 1 else ""
        return f"{self.num_embeddings}, {self.weight.shape[1]}{split}"


class ParallelLMHead(ColumnParallelLinear):
    """The output projection, split over the vocabulary like :class:`VocabParallelEmbedding` (so a tied one
    shares the embedding's table); :meth:`compute_logits` gathers the ranks' logits.

    Args:
        hidden_size, vocab_size: the model's.
        dtype, quant_config: as :class:`~kilat.model_executor.layers.linear.Linear`.
        prefix: the checkpoint name (``lm_head``).
    """

    def __init__(self, hidden_size: int, vocab_size: int, dtype: torch.dtype | None = None,
                 quant_config: QuantizationConfig | None = None, prefix: str = "lm_head") -> None:
        group = get_tp_group()
        rows = vocab_rows_per_rank(vocab_size, group.world_size)
        self.vocab_size = vocab_size
        super().__init__(hidden_size, [rows * group.world_size], False, dtype, quant_config, prefix,
                         shard_slices=[(group.rank * rows, rows)])

    def narrow(self, name: str, tensor: torch.Tensor, shard: int | None) -> torch.Tensor:
        """This rank's vocabulary rows of the whole ``weight``, zero-padded past the vocabulary."""
        if self.tp_size == 1:
            return tensor
        start, rows = self.shard_slices[0]
        part = tensor[start:start + rows]
        if part.shape[0] < rows:
            part = torch.cat([part, part.new_zeros(rows - part.shape[0], *part.shape[1:])])
        return part

    def compute_logits(self, hidden: torch.Tensor, keep_dtype: bool = False) -> torch.Tensor:
        """``hidden [N, hidden_size] -> logits [N, vocab_size]`` (every rank gets all of them): float32, or with
        ``keep_dtype`` in the projection's own dtype (no float32 copy)."""
        logits = self(hidden)
        logits = tensor_model_parallel_all_gather(logits if keep_dtype else logits.float())
        return logits[..., :self.vocab_size] if logits.shape[-1] != self.vocab_size else logits
