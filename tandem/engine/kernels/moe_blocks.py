"""Routing on the device for the fused MoE: the (token, top-k slot) pairs sorted by expert into
blocks of rows that share one expert, with no host read and shapes fixed by the batch.

A pair a = token * k + slot routes token `a // k` to global expert `experts[token, slot]`.
`align_blocks` groups the pairs of this rank's experts (global ids [expert_start,
expert_start + num_local)) by local expert, in ascending pair order within an expert, and pads
each expert's group to a multiple of `block` rows, so every block of `block` sorted rows
belongs to one expert: a grouped GEMM runs one tile per block with that expert's weights.
Pairs routed to other ranks' experts are left out (their outputs are 0: the EP all-reduce
sums every rank's part, as the expert loop did).

Every step is a device op (scatter_add, cumsum, stable argsort, searchsorted, index_copy):
counts never reach the host, so the path is capturable in a CUDA graph. The buffers are sized
by `max_sorted_rows`, a host bound from shapes alone: each of the at most
min(num_pairs, num_local) experts that receive pairs wastes at most block - 1 padding rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class MoeBlocks:
    """Sorted, block-padded pairs of one MoE forward on one rank (built by `align_blocks`)."""

    sorted_pairs: torch.Tensor  # [R] int64 pair index of each sorted row; num_pairs on padding
    block_expert: torch.Tensor  # [R // block] int64 local expert of each block; -1: unused block
    block: int  # rows per block (the grouped GEMM's BLOCK_M)
    top_k: int  # slots per token (pair a is token a // top_k)
    num_pairs: int  # A = tokens * top_k

    @property
    def num_rows(self) -> int:
        return self.sorted_pairs.shape[0]


def max_sorted_rows(num_pairs: int, num_local: int, block: int) -> int:
    """Upper bound on the padded rows: sum over experts of ceil(c_e / block) * block, with
    sum c_e <= num_pairs and at most min(num_pairs, num_local) experts non-empty, each padded
    by at most block - 1 rows. The sum is a multiple of block, so rounding down keeps it a
    bound."""
    return (num_pairs + min(num_pairs, num_local) * (block - 1)) // block * block


def block_rows(num_pairs: int, num_local: int) -> int:
    """Rows per block: 16 while an expert gets few rows on average (decode: less padding),
    64 for prefill-sized batches (fewer, fuller tiles). Host ints from shapes only."""
    return 16 if num_pairs < 32 * num_local else 64


def align_blocks(
    experts: torch.Tensor,  # [T, k] int64 global expert ids
    expert_start: int,  # first global expert id this rank owns
    num_local: int,  # experts this rank owns
    block: int,
) -> MoeBlocks:
    num_tokens, top_k = experts.shape
    num_pairs = num_tokens * top_k
    dev = experts.device
    local = experts.reshape(-1) - expert_start  # [A] local expert id, out of range: elsewhere
    mine = (local >= 0) & (local < num_local)
    key = torch.where(mine, local, num_local)  # [A] int64; num_local: another rank's expert
    # [E + 1] pairs per local expert (+ the others); scatter_add, not bincount, which sizes
    # its output from a device read on CUDA
    counts = torch.zeros(num_local + 1, dtype=torch.int64, device=dev)
    counts.scatter_add_(0, key, torch.ones_like(key))
    padded = (counts[:num_local] + block - 1) // block * block  # [E] rows per expert, padded
    padded_end = torch.cumsum(padded, 0)  # [E] end row of each expert's group
    num_rows = max_sorted_rows(num_pairs, num_local, block)
    # [E + 1] first row of each group; the others' pairs start at num_rows (scratch rows)
    group_start = torch.cat([padded_end - padded, padded_end.new_full((1,), num_rows)])
    order = torch.argsort(key, stable=True)  # [A] pairs by local expert, pair order within
    sorted_key = key[order]  # [A]
    first_of_key = torch.cumsum(counts, 0) - counts  # [E + 1] first sorted position per key
    rank_in_group = torch.arange(num_pairs, device=dev) - first_of_key[sorted_key]  # [A]
    dest = group_start[sorted_key] + rank_in_group  # [A] distinct rows: no write races
    rows = torch.full((num_rows + num_pairs,), num_pairs, dtype=torch.int64, device=dev)
    rows.index_copy_(0, dest, order)
    # [R // block] the expert whose group holds each block's first row; past the last
    # group (searchsorted gives num_local): -1, a block the kernels skip
    starts = torch.arange(0, num_rows, block, device=dev)
    owner = torch.searchsorted(padded_end, starts, right=True)
    block_expert = torch.where(owner < num_local, owner, -1)
    return MoeBlocks(sorted_pairs=rows[:num_rows], block_expert=block_expert, block=block,
                     top_k=top_k, num_pairs=num_pairs)
