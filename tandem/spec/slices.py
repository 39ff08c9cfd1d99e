"""The per-forward sequence slices of a speculative round, as pure functions of plain ints.

Eager phases and their CUDA graphs build their metadata from these same functions, so a graph
replay attends to and writes exactly what the eager forward would (docs/architecture.md,
"Per-step slots", "Positions", "Metadata per step"). Padding rows (graph batch buckets) live on
the reserved scratch page and never touch a real request's pages.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence

import torch

from tandem.engine import h2d
from tandem.engine.attention.metadata import (
    BatchLayout,
    SeqSlice,
    tree_mask,
)
from tandem.engine.cuda_graphs import SCRATCH_PAGE
from tandem.engine.h2d import build_layout
from tandem.spec import kernels as spec_kernels
from tandem.spec.phases import VerifyInput


def chain_step_slices(page_ids: Sequence[Sequence[int]], num_cached: Sequence[int],
                      step: int) -> list[SeqSlice]:
    """Chain draft step `step` (1-based): each request consumes (hidden, d_step) at draft
    position num_cached + step - 1, writes that one slot and attends to num_cached + step
    keys. The host-side statement of what the drafting graph derives on the device
    (`propose.chain_steps`); tests hold the two equal."""
    if step < 1:
        raise ValueError(f"step: chain draft steps count from 1, got {step}")
    return [SeqSlice(page_ids=p, num_cached=nc + step - 1, num_new=1)
            for p, nc in zip(page_ids, num_cached)]


def chain_draft_table(page_ids: Sequence[Sequence[int]], num_cached: Sequence[int],
                      rows: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """What chain drafting reads for a whole round (steps 1..k-1 derive their positions, slots
    and key counts from it on the device: `engine/attention/device_decode`, with
    `chain_step_slices` as the host-side reference): (page table [rows, P] int32, num_cached
    [rows] int64), host tensors, P the longest page list. Padding rows (rows > len(page_ids))
    sit at position 0 of the scratch page; unused table entries are the scratch page too (never
    read: a sequence reads only the pages its keys fill). The caller moves them once, to where
    it reads them (`h2d`: a new device tensor, or a graph's buffer)."""
    bs = len(page_ids)
    rows = bs if rows is None else rows
    if rows < bs:
        raise ValueError(f"rows: {rows} < {bs} sequences")
    width = max([len(p) for p in page_ids] + [1])
    table = [list(p) + [SCRATCH_PAGE] * (width - len(p)) for p in page_ids]
    table += [[SCRATCH_PAGE] * width] * (rows - bs)
    base = list(num_cached) + [0] * (rows - bs)
    return torch.tensor(table, dtype=torch.int32), torch.tensor(base, dtype=torch.int64)


def load_draft_table(table_buf: torch.Tensor, base_buf: torch.Tensor,
                     page_ids: Sequence[Sequence[int]], num_cached: Sequence[int],
                     rows: int) -> None:
    """`chain_draft_table` of a round copied into a graph's buffers (page table [B_max, P_max]
    int32, num_cached [B_max] int64) without a stream sync; raises when the requests' page
    lists outgrow the buffers (the graph's max_kv_len)."""
    table, base = chain_draft_table(page_ids, num_cached, rows=rows)  # host
    if table.shape[1] > table_buf.shape[1]:
        raise ValueError(f"propose: {table.shape[1]} pages per request exceed the graph's "
                         f"{table_buf.shape[1]} (max_kv_len)")
    h2d.copy_into(table_buf[:rows, : table.shape[1]], table)
    h2d.copy_into(base_buf[:rows], base)


def verify_slices(verify: VerifyInput, masked: bool | None = None,
                  host_mask: bool = True) -> list[SeqSlice]:
    """One slice per request: N nodes at positions num_cached + depth, written at slots
    num_cached + j. masked=None: a custom (ancestor) mask unless the tree is a chain (then
    causal); True: always the tree mask (a chain's equals the causal mask), as a graph
    captured with masked kernels needs; False: causal (only for chains). host_mask=False
    leaves the masks out of the slices (`verify_layout` builds them on the device)."""
    chain = verify.is_chain
    if masked is None:
        masked = not chain
    if not masked and not chain:
        raise ValueError("verify_slices: a causal mask cannot verify a branching tree")
    return [
        SeqSlice(page_ids=p, num_cached=nc, num_new=verify.num_nodes,
                 mask=tree_mask(nc, parents) if masked and host_mask else None,
                 positions=None if chain else [nc + d for d in depths])
        for p, nc, parents, depths in zip(verify.page_ids, verify.num_cached, verify.parents,
                                          verify.depths)
    ]


def verify_layout(verify: VerifyInput, page_size: int, device: torch.device | str,
                  masked: bool | None = None, rows: int | None = None,
                  device_mask: bool | None = None) -> BatchLayout:
    """The verify forward's metadata (padded to `rows` requests when given). On CUDA
    (device_mask=None) the custom mask -- every node's [num_cached + N] row, mostly the True
    prefix -- is built by one kernel on the device (`kernels.tree_mask`) instead of Python
    loops and a host-to-device copy; elsewhere from `tree_mask` per request. Both give the
    same flat mask."""
    if masked is None:
        masked = not verify.is_chain
    device = torch.device(device)
    n, bs = verify.num_nodes, verify.batch_size
    rows = bs if rows is None else rows
    if device_mask is None:
        device_mask = device.type == "cuda"
    on_device = masked and device_mask
    slices = verify_slices(verify, masked=masked, host_mask=not on_device)
    if rows > bs:
        slices = pad_fixed_slices(slices, rows, n, page_size, masked and not on_device)
    layout = build_layout(slices, page_size, device)  # never waits for the GPU
    if not on_device:
        return layout
    chain = tuple(range(-1, n - 1))
    parents = list(verify.parents) + [chain] * (rows - bs)
    num_cached = list(verify.num_cached) + [0] * (rows - bs)
    sizes = [n * (nc + n) for nc in num_cached]
    offsets = list(itertools.accumulate(sizes, initial=0))[:-1]
    dev = h2d.tensor([num_cached, offsets], torch.int64, device)
    mask = spec_kernels.tree_mask(h2d.tensor(parents, torch.int32, device),
                                  dev[0], dev[1], sum(sizes), max(num_cached))
    return BatchLayout(attn=dataclasses.replace(layout.attn, custom_mask=mask),
                       positions=layout.positions)


def device_tree_layout(page_ids: Sequence[Sequence[int]], num_cached: Sequence[int],
                       parents: torch.Tensor, depths: torch.Tensor, page_size: int,
                       device: torch.device | str, rows: int | None = None) -> BatchLayout:
    """`verify_layout` of a tree whose shape is on the device only: parents [bs, N] (tree
    positions, -1 for the root) and depths [bs, N], device tensors. The host metadata is a
    chain's of N nodes (the same pages, key counts and slots num_cached + j); the positions
    num_cached + depth and the ancestor mask are built on the device. Never waits."""
    bs, n = parents.shape
    rows = bs if rows is None else rows
    slices = [SeqSlice(page_ids=p, num_cached=nc, num_new=n)
              for p, nc in zip(page_ids, num_cached)]
    if rows > bs:
        slices = pad_fixed_slices(slices, rows, n, page_size, False)
    layout = build_layout(slices, page_size, device)
    num_all = list(num_cached) + [0] * (rows - bs)
    sizes = [n * (nc + n) for nc in num_all]
    offsets = list(itertools.accumulate(sizes, initial=0))[:-1]
    meta = h2d.tensor([num_all, offsets], torch.int64, device)  # [2, rows]
    chain = torch.arange(-1, n - 1, device=parents.device).expand(rows - bs, n)
    mask = spec_kernels.tree_mask(torch.cat([parents, chain]).to(torch.int32), meta[0], meta[1],
                                  sum(sizes), max(num_all))
    positions = torch.cat([(meta[0, :bs, None] + depths).reshape(-1),
                           layout.positions[bs * n:]])  # [rows * N]
    return BatchLayout(attn=dataclasses.replace(layout.attn, custom_mask=mask),
                       positions=positions)


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


def extend_rows(spec_num_steps: int, tree_size: int) -> int:
    """Rows per request of the fixed-shape draft-extend (its CUDA graph): the root plus the
    deepest path a tree of `tree_size` nodes and `spec_num_steps` levels can accept."""
    return min(spec_num_steps, tree_size - 1) + 1


def extend_slices(page_ids: Sequence[Sequence[int]], num_cached: Sequence[int],
                  rows: int) -> list[SeqSlice]:
    """The fixed-shape draft-extend: every request runs `rows` tokens at draft positions
    num_cached .. num_cached + rows - 1, causally. Row j < a + 1 carries the accepted path (root
    feature with the first accepted token, ..., last accepted feature with the bonus); rows past
    a + 1 are filler whose outputs nobody reads. Causality keeps the real rows exact: row j
    attends to num_cached + j + 1 keys, all of them accepted ones (docs/architecture.md, "Seq
    lens after rejection"). The filler rows' K/V land in slots >= num_cached + a + 1, past the
    next round's cache, which every later forward writes before it reads them (the next draft
    step writes its slot first; the next verify and extend write theirs)."""
    return [SeqSlice(page_ids=p, num_cached=nc, num_new=rows)
            for p, nc in zip(page_ids, num_cached)]
