"""Token embedding."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class VocabEmbedding(nn.Module):
    """Embedding lookup ``weight[input_ids]`` with an uninitialized ``[num_embeddings, embedding_dim]`` weight.

    Shapes: int64 ``input_ids [T] -> [T, embedding_dim]`` in the weight dtype.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_embeddings, embedding_dim, dtype=dtype), requires_grad=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """int64 ``input_ids [T] -> [T, embedding_dim]``."""
        return F.embedding(input_ids, self.weight)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, {self.weight.shape[1]}"
