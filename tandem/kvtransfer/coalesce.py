"""Vectorized descriptor planning: page pairs -> runs -> (src, dst, len) entries, with numpy.

Pure functions (no backend, no torch): the sender plans every push with them, and a unit test
checks them against a byte-level reference on random page lists.

Two merges, both only where the bytes are contiguous on BOTH sides:
- `page_runs`: consecutive (src page, dst page) pairs whose ids both step by +1 form one run, so a
  request whose pages were allocated as one run on each side needs one entry per layer;
- `plan_entries`: entries in (layer, run) order merge when one ends where the next begins on both
  sides, e.g. every page of layer l followed by layer l+1 (a request that fills the pool).

A region addresses (layer l, page p) at `base + (l * num_pages + p) * page_bytes` (layout.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, slots=True, eq=False)
class Entries:
    """Contiguous copies, in posting order. All arrays [n] uint64."""

    src_addrs: np.ndarray  # [n] uint64 local start addresses
    dst_addrs: np.ndarray  # [n] uint64 remote start addresses
    lengths: np.ndarray  # [n] uint64 bytes

    def __len__(self) -> int:
        return int(self.lengths.shape[0])

    @property
    def nbytes(self) -> int:
        return int(self.lengths.sum())


def page_runs(src_pages: Sequence[int] | np.ndarray,
              dst_pages: Sequence[int] | np.ndarray) -> np.ndarray:
    """[R, 3] int64 rows (src_start, dst_start, count): maximal runs of pairs (src[i], dst[i])
    consecutive on both sides, in list order. `dst_pages` may be longer (decode reserves pages
    for generation too): only its first len(src_pages) ids pair up."""
    src = np.asarray(src_pages, dtype=np.int64).reshape(-1)
    dst = np.asarray(dst_pages, dtype=np.int64).reshape(-1)[: src.shape[0]]
    if src.shape[0] != dst.shape[0]:
        raise ValueError(f"page_runs: {src.shape[0]} source pages, {dst.shape[0]} destination")
    if src.shape[0] == 0:
        return np.zeros((0, 3), dtype=np.int64)
    # A run starts at 0 and wherever either side does not continue the previous pair by +1.
    starts = np.flatnonzero(np.concatenate((
        [True], (np.diff(src) != 1) | (np.diff(dst) != 1))))
    counts = np.diff(np.append(starts, src.shape[0]))
    return np.stack((src[starts], dst[starts], counts), axis=1)


def plan_entries(src_base: int, src_num_pages: int, dst_base: int, dst_num_pages: int,
                 page_bytes: int, runs: np.ndarray, layers: range) -> Entries:
    """Entries copying `runs` ([R, 3] from page_runs) of every layer in `layers`, layer-major,
    merged where contiguous on both sides. Both regions have blocks of `page_bytes`."""
    runs = np.asarray(runs, dtype=np.int64).reshape(-1, 3)
    lay = np.arange(layers.start, layers.stop, dtype=np.int64)
    if runs.shape[0] == 0 or lay.shape[0] == 0:
        empty = np.zeros(0, dtype=np.uint64)
        return Entries(src_addrs=empty, dst_addrs=empty.copy(), lengths=empty.copy())
    # [num_layers, R] block indices, flattened layer-major (the order prefill produces layers).
    src_blk = (lay[:, None] * src_num_pages + runs[None, :, 0]).reshape(-1)
    dst_blk = (lay[:, None] * dst_num_pages + runs[None, :, 1]).reshape(-1)
    cnt = np.broadcast_to(runs[None, :, 2], (lay.shape[0], runs.shape[0])).reshape(-1)
    # Merge entry i into i-1 when i-1 ends (in blocks) exactly where i starts, on both sides.
    cont = (src_blk[:-1] + cnt[:-1] == src_blk[1:]) & (dst_blk[:-1] + cnt[:-1] == dst_blk[1:])
    heads = np.flatnonzero(np.concatenate(([True], ~cont)))
    merged_cnt = np.add.reduceat(cnt, heads)
    pb = np.uint64(page_bytes)
    return Entries(
        src_addrs=np.uint64(src_base) + src_blk[heads].astype(np.uint64) * pb,
        dst_addrs=np.uint64(dst_base) + dst_blk[heads].astype(np.uint64) * pb,
        lengths=merged_cnt.astype(np.uint64) * pb,
    )


_SMALL = 16  # entries up to which block_indices runs in plain Python
_INT32_MAX = int(np.iinfo(np.int32).max)


def _block_indices_small(addrs: Sequence[int], lengths: Sequence[int], base: int,
                         block_bytes: int, num_blocks: int) -> np.ndarray | None:
    spans = []
    for a, n in zip(addrs, lengths):
        off = int(a) - base
        n = int(n)
        if off < 0 or off % block_bytes or n % block_bytes or n == 0:
            return None
        first, count = off // block_bytes, n // block_bytes
        if first + count > num_blocks or num_blocks > _INT32_MAX:
            return None
        spans.append(np.arange(first, first + count, dtype=np.int32))
    if not spans:
        return np.zeros(0, dtype=np.int32)
    return spans[0] if len(spans) == 1 else np.concatenate(spans)


def block_indices(addrs: np.ndarray, lengths: np.ndarray, base: int, block_bytes: int,
                  num_blocks: int) -> np.ndarray | None:
    """[sum(len) / block_bytes] int32: the block ids (block b = bytes [base + b * block_bytes,
    + block_bytes)) that entries cover, in order; None if any entry is not whole blocks inside
    [base, base + num_blocks * block_bytes). What a prepared one-descriptor-per-block list is
    indexed with (NIXL merges consecutive contiguous indices back into one descriptor).
    `addrs`/`lengths`: arrays, or sequences of ints (a few entries -- the usual push of runs --
    take a plain-Python path: a dozen numpy calls cost more than the entries themselves)."""
    if not isinstance(addrs, np.ndarray) and len(addrs) <= _SMALL:
        return _block_indices_small(addrs, lengths, base, block_bytes, num_blocks)
    addrs = np.asarray(addrs, dtype=np.uint64)
    lengths = np.asarray(lengths, dtype=np.uint64)
    if addrs.shape[0] == 0:
        return np.zeros(0, dtype=np.int32)
    base_u, bb = np.uint64(base), np.uint64(block_bytes)
    if (addrs < base_u).any():
        return None
    off = addrs - base_u
    if (off % bb).any() or (lengths % bb).any() or (lengths == 0).any():
        return None
    first = (off // bb).astype(np.int64)
    count = (lengths // bb).astype(np.int64)
    if (first + count > num_blocks).any() or num_blocks > np.iinfo(np.int32).max:
        return None
    total = int(count.sum())
    # Expand each (first, count) into first, first+1, ..., first+count-1, in entry order.
    ends = np.cumsum(count)
    shift = np.repeat(first - (ends - count), count)
    return (np.arange(total, dtype=np.int64) + shift).astype(np.int32)
