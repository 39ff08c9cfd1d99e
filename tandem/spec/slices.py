"""The per-forward sequence slices of a speculative round, as pure functions of plain ints.

Eager phases and their CUDA graphs build their metadata from these same functions, so a graph
replay attends to and writes exactly what the eager forward would (DESIGN §3 "Per-step
slots", "Positions", "Metadata per step"). Padding rows (graph batch buckets) live on the
reserved scratch page and never touch a real request's pages.
"""

from __future__ import annotations

from collections.abc import Sequence

from tandem.engine.attention.metadata import SeqSlice, tree_mask
from tandem.engine.cuda_graphs import SCRATCH_PAGE
from tandem.spec.phases import VerifyInput


def chain_step_slices(page_ids: Sequence[Sequence[int]], num_cached: Sequence[int],
                      step: int) -> list[SeqSlice]:
    """Chain draft step `step` (1-based): each request consumes (hidden, d_step) at draft
    position num_cached + step - 1, writes that one slot and attends to num_cached + step
    keys."""
    if step < 1:
        raise ValueError(f"step: chain draft steps count from 1, got {step}")
    return [SeqSlice(page_ids=p, num_cached=nc + step - 1, num_new=1)
            for p, nc in zip(page_ids, num_cached)]


def verify_slices(verify: VerifyInput, masked: bool | None = None) -> list[SeqSlice]:
    """One slice per request: N nodes at positions num_cached + depth, written at slots
    num_cached + j. masked=None: a custom (ancestor) mask unless the tree is a chain (then
    causal); True: always the tree mask (a chain's equals the causal mask), as a graph
    captured with masked kernels needs; False: causal (only for chains)."""
    chain = verify.is_chain
    if masked is None:
        masked = not chain
    if not masked and not chain:
        raise ValueError("verify_slices: a causal mask cannot verify a branching tree")
    return [
        SeqSlice(page_ids=p, num_cached=nc, num_new=verify.num_nodes,
                 mask=tree_mask(nc, parents) if masked else None,
                 positions=None if chain else [nc + d for d in depths])
        for p, nc, parents, depths in zip(verify.page_ids, verify.num_cached, verify.parents,
                                          verify.depths)
    ]


def pad_fixed_slices(slices: Sequence[SeqSlice], batch_size: int, num_new: int,
                     page_size: int, masked: bool) -> list[SeqSlice]:
    """`slices` (each with num_new new tokens) plus padding rows up to batch_size: num_new
    tokens at positions 0.., written into the scratch page (repeated when num_new exceeds a
    page: padding rows may overwrite each other, nobody reads them), attending causally
    (through an explicit causal mask when `masked`)."""
    if len(slices) > batch_size:
        raise ValueError(f"batch_size: {batch_size} < {len(slices)} sequences")
    for i, s in enumerate(slices):
        if s.num_new != num_new:
            raise ValueError(f"slices[{i}]: {s.num_new} new tokens, the graph takes {num_new}")
    pages = (SCRATCH_PAGE,) * -(-num_new // page_size)
    pad = SeqSlice(page_ids=pages, num_cached=0, num_new=num_new,
                   mask=tree_mask(0, list(range(-1, num_new - 1))) if masked else None)
    return list(slices) + [pad] * (batch_size - len(slices))
