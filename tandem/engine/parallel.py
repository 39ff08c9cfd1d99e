"""Process groups the layers shard over: tensor parallel (TP) and expert parallel (EP).

A layer receives a `ParallelGroup` and asks it for its rank/size and for collectives; with
size 1 every collective is the identity, so the single-device engine pays nothing. With
size > 1 the group wraps a `torch.distributed` group (gloo on CPU, NCCL on GPU).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True, slots=True)
class ParallelGroup:
    """One communicator: `rank` in `[0, size)`; `handle` is a torch.distributed group or None
    for the trivial single-rank group."""

    rank: int = 0
    size: int = 1
    handle: Any = None

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.size:
            raise ValueError(f"rank: {self.rank} outside [0, {self.size})")

    def shard_range(self, total: int, what: str) -> tuple[int, int]:
        """The `[start, end)` slice of `total` items this rank owns (even split)."""
        if total % self.size:
            raise ValueError(f"{what}: {total} is not divisible by the group size {self.size}")
        per = total // self.size
        return self.rank * per, (self.rank + 1) * per

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over ranks. Works on a copy: the caller's tensor is never modified."""
        if self.size == 1:
            return x
        import torch.distributed as dist

        out = x.clone()
        dist.all_reduce(out, group=self.handle)
        return out

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's `x` along the last dimension (rank order)."""
        if self.size == 1:
            return x
        import torch.distributed as dist

        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.handle)
        return torch.cat(parts, dim=-1)


SINGLE = ParallelGroup()


@dataclass(frozen=True, slots=True)
class ParallelContext:
    """The groups one model replica uses. `tp` shards attention heads, MLP columns and the
    vocabulary; `ep` shards MoE experts (by default the same ranks as `tp`)."""

    tp: ParallelGroup = SINGLE
    ep: ParallelGroup = SINGLE
