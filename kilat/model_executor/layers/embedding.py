"""Token embedding."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kilat.model_executor.layers.quantization import kernels


class VocabEmbedding(nn.Module):
    """Embedding lookup ``weight[input_ids]`` with an uninitialized ``[num_embeddings, embedding_dim]`` weight.

    The table may instead be a quantized :class:`~kilat.model_executor.layers.quantization.kernels.QuantWeight`
    (:meth:`load_weight`, e.g. a GGUF file's Q8_0 table under ``--quantization gguf``): rows are then dequantized
    as they are looked up, and the dense ``weight`` is dropped after loading.

    Attributes:
        qweight: the quantized table, or ``None``.

    Shapes: int64 ``input_ids [T] -> [T, embedding_dim]`` in the model dtype.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_embeddings, embedding_dim, dtype=dtype), requires_grad=False)
        self.dtype = self.weight.dtype
        self.qweight: kernels.QuantWeight | None = None

    def load_weight(self, tensor: torch.Tensor | kernels.QuantWeight) -> None:
        """Copy a dense ``[num_embeddings, embedding_dim]`` table into ``weight``, or hold a quantized one.

        Raises:
            ValueError: a shape mismatch.
        """
        shape = tuple(self.weight.shape)
        dense = isinstance(tensor, torch.Tensor)
        got = tuple(tensor.shape) if dense else (tensor.out_features, tensor.in_features)
        if got != shape:
            raise ValueError(f"embedding: expected shape {shape}, got {got}")
        if dense:
            self.weight.data.copy_(tensor)
        else:
            self.qweight = tensor

    def process_weights_after_loading(self) -> None:
        """Drop the dense placeholder of a quantized table (its pages were never written)."""
        if self.qweight is not None and "weight" in self._parameters:
            del self.weight

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """int64 ``input_ids [T] -> [T, embedding_dim]``."""
        if self.qweight is not None:
            return kernels.embedding(input_ids, self.qweight, self.dtype)
        return F.embedding(input_ids, self.weight)

    def extra_repr(self) -> str:
        if self.qweight is not None:
            return f"{self.qweight.out_features}, {self.qweight.in_features}, {self.qweight.bits}-bit"
        return f"{self.weight.shape[0]}, {self.weight.shape[1]}"
