"""Vocabulary-parallel token embedding and LM head: each TP rank owns a contiguous slice of
the vocabulary rows. Tied models share one weight tensor between the two."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tandem.engine import kernels
from tandem.engine.layers.linear import check_shape
from tandem.engine.parallel import ParallelGroup


class VocabParallelEmbedding(nn.Module):
    def __init__(
        self, vocab_size: int, dim: int, tp: ParallelGroup, dtype: torch.dtype
    ) -> None:
        super().__init__()
        self.tp, self.vocab_size, self.dim = tp, vocab_size, dim
        self.start, self.end = tp.shard_range(vocab_size, "vocab_size")
        self.weight = nn.Parameter(torch.empty(self.end - self.start, dim, dtype=dtype), False)

    def load_weight(self, name: str, full: torch.Tensor) -> None:
        check_shape(name, full.shape, (self.vocab_size, self.dim))
        self.weight.data.copy_(full[self.start : self.end])

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:  # [T] int64 -> [T, dim]
        if self.tp.size == 1:
            return F.embedding(token_ids, self.weight)
        # Ids outside this rank's slice look up row 0 and are zeroed; the all-reduce fills
        # them in from the owning rank.
        local = token_ids - self.start
        outside = (local < 0) | (local >= self.weight.shape[0])
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out = out.masked_fill(outside.unsqueeze(-1), 0)
        return self.tp.all_reduce(out)


class ParallelLMHead(nn.Module):
    """logits = hidden @ W.T over the full vocabulary (gathered from every rank's slice)."""

    def __init__(
        self, vocab_size: int, dim: int, tp: ParallelGroup, dtype: torch.dtype,
        tied_to: VocabParallelEmbedding | None,
    ) -> None:
        super().__init__()
        self.tp, self.vocab_size, self.dim = tp, vocab_size, dim
        self.start, self.end = tp.shard_range(vocab_size, "vocab_size")
        self.tied_to = tied_to
        if tied_to is None:
            self.weight = nn.Parameter(torch.empty(self.end - self.start, dim, dtype=dtype), False)

    def head_weight(self) -> torch.Tensor:  # [vocab/tp, dim]
        return self.tied_to.weight if self.tied_to is not None else self.weight

    def load_weight(self, name: str, full: torch.Tensor) -> None:
        check_shape(name, full.shape, (self.vocab_size, self.dim))
        self.weight.data.copy_(full[self.start : self.end])

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # [n, dim] -> [n, vocab] float32
        logits = kernels.linear(hidden, self.head_weight(), out_dtype=torch.float32)
        return self.tp.all_gather_last_dim(logits)
