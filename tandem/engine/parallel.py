"""Process groups the layers shard over: tensor parallel (TP), expert parallel (EP) and
data-parallel attention (DP).

A layer receives a `ParallelGroup` and asks it for its rank/size and for collectives; with
size 1 every collective is the identity, so the single-device engine pays nothing. With
size > 1 the group wraps a `torch.distributed` group (gloo on CPU, NCCL on GPU); on GPUs a TP
group may also carry a `FastAllReduce` (allreduce.py: symmetric memory over NVLink) that takes
the small all-reduces it was measured faster on.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True, slots=True)
class ParallelGroup:
    """One communicator: `rank` in `[0, size)`; `handle` is a torch.distributed group or None
    for the trivial single-rank group. `fast`: a `FastAllReduce` (allreduce.py) that owns a
    symmetric buffer over the same ranks and picks, per message size, a custom all-reduce or
    NCCL; None (CPU, TP 1, `all_reduce: nccl`): every all-reduce is the backend's."""

    rank: int = 0
    size: int = 1
    handle: Any = None
    fast: Any = None

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.size:
            raise ValueError(f"rank: {self.rank} outside [0, {self.size})")

    def shard_range(self, total: int, what: str) -> tuple[int, int]:
        """The `[start, end)` slice of `total` items this rank owns (even split)."""
        if total % self.size:
            raise ValueError(f"{what}: {total} is not divisible by the group size {self.size}")
        per = total // self.size
        return self.rank * per, (self.rank + 1) * per

    def all_reduce(self, x: torch.Tensor, owned: bool = False) -> torch.Tensor:
        """Sum over ranks. Works on a copy: the caller's tensor is never modified, unless
        `owned` (x is a temporary nobody reads again: NCCL then sums it in place and skips a
        copy kernel). Inside a CUDA graph capture too (both paths only launch kernels on the
        current stream)."""
        if self.size == 1:
            return x
        if self.fast is not None:
            out = self.fast.all_reduce(x)  # None: the table says NCCL for this message
            if out is not None:
                return out
        import torch.distributed as dist

        out = x if owned else x.clone()
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

    def all_gather_counts(self, n: int, device: torch.device) -> tuple[int, ...]:
        """Every rank's `n`, rank order. SYNC: one host read per forward (DP token counts)."""
        if self.size == 1:
            return (n,)
        import torch.distributed as dist

        mine = torch.tensor([n], dtype=torch.int64, device=device)
        parts = [torch.empty_like(mine) for _ in range(self.size)]
        dist.all_gather(parts, mine, group=self.handle)
        return tuple(int(v) for v in torch.cat(parts).tolist())

    def all_gather_rows(self, x: torch.Tensor, counts: tuple[int, ...]) -> torch.Tensor:
        """x [counts[rank], H] on each rank -> [sum(counts), H], rank order. Rows are padded to
        the largest count for the collective (ranks may have 0 rows)."""
        if self.size == 1:
            return x
        import torch.distributed as dist

        width = max(counts)
        padded = x.new_zeros((width, *x.shape[1:]))
        padded[: x.shape[0]] = x
        parts = [torch.empty_like(padded) for _ in range(self.size)]
        dist.all_gather(parts, padded, group=self.handle)
        return torch.cat([p[:c] for p, c in zip(parts, counts)])

    def all_reduce_max(self, n: int, device: torch.device) -> int:
        """The largest `n` over ranks (e.g. "does any rank still have work")."""
        if self.size == 1:
            return n
        import torch.distributed as dist

        t = torch.tensor([n], dtype=torch.int64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.handle)
        return int(t.item())

    def max_over_ranks(self, values: Sequence[float], device: torch.device) -> tuple[float, ...]:
        """Element-wise largest of `values` over ranks (e.g. a measured cost table that every
        rank must use alike)."""
        if self.size == 1:
            return tuple(values)
        import torch.distributed as dist

        t = torch.tensor(list(values), dtype=torch.float64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.handle)
        return tuple(t.tolist())


SINGLE = ParallelGroup()


@dataclass(frozen=True, slots=True)
class ParallelContext:
    """The groups one model replica uses. `tp` shards attention heads, MLP columns and the
    vocabulary; `ep` shards MoE experts (by default the same ranks as `tp`).

    `dp` (DP attention): every rank of the worker, DP-major (world rank = DP rank * tp.size +
    TP rank). Each DP rank -- a TP group of `tp.size` ranks, often 1 -- runs attention,
    embedding and LM head for its own requests over its own KV pages, heads sharded over `tp`;
    around every MLP/MoE block the DP ranks all-gather their tokens, run the block sharded over
    every rank of `dp` (dense columns; MoE experts over `ep`, which is then the dp group, else
    columns) and each keeps its own rows. The TP ranks of one DP rank hold the same rows after
    attention's all-reduce, so only the first of them (the TP lead) adds them to the gather:
    the block runs each token once. A rank with no tokens still runs the block's collectives
    (an empty batch)."""

    tp: ParallelGroup = SINGLE
    ep: ParallelGroup = SINGLE
    dp: ParallelGroup = SINGLE

    def __post_init__(self) -> None:
        if self.dp.size > 1 and (self.dp.size % self.tp.size
                                 or self.dp.rank % self.tp.size != self.tp.rank):
            raise ValueError(f"dp: rank {self.dp.rank} of {self.dp.size} is not TP rank "
                             f"{self.tp.rank} of a DP-major layout with tp {self.tp.size}")

    @property
    def mlp_tp(self) -> ParallelGroup:
        """The group dense MLP columns (and un-EP'd MoE columns) split over."""
        return self.dp if self.dp.size > 1 else self.tp

    @property
    def every_rank(self) -> ParallelGroup:
        """The group of every rank of the worker: the one the dense MLP splits over (DP is
        DP-major over all of them; else TP)."""
        return self.mlp_tp

    @property
    def num_dp_ranks(self) -> int:
        """DP attention ranks (each a TP group); 1 without DP attention."""
        return self.dp.size // self.tp.size if self.dp.size > 1 else 1

    @property
    def dp_rank(self) -> int:
        """This rank's DP rank, in [0, num_dp_ranks)."""
        return self.dp.rank // self.tp.size if self.dp.size > 1 else 0

    def dp_gather_rows(self, num_tokens: int) -> int:
        """How many of this rank's `num_tokens` rows it adds to the MLP's all-gather: all of
        them on a TP lead, none on the other TP ranks (they hold the same rows)."""
        return num_tokens if self.tp.rank == 0 else 0

    def static_dp_counts(self, num_tokens: int) -> tuple[int, ...]:
        """Every world rank's `dp_gather_rows` when each DP rank runs `num_tokens` rows (a
        decode graph of that size on every rank): known without asking the others."""
        return tuple(num_tokens if r % self.tp.size == 0 else 0 for r in range(self.dp.size))

    def dp_lead_offset(self, dp_counts: tuple[int, ...]) -> int:
        """Where this DP rank's rows start in the gathered batch (`dp_counts`: every rank's
        `dp_gather_rows`, world rank order)."""
        return sum(dp_counts[: self.dp.rank - self.tp.rank])
