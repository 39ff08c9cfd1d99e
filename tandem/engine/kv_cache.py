"""The paged KV cache: memory (`KVPool`) and page ownership (`PageAllocator`).

Layout. Each layer group ("target", "draft", ...) is ONE contiguous tensor
    [num_layers, num_pages, 2, page_size, num_kv_heads, head_dim]
so that (layer l, page p) is one contiguous block of `page_bytes` bytes -- what a KV transfer
moves -- and layer l's view [num_pages, 2, page_size, Hkv, D] is FlashInfer's NHD paged layout.
All groups share page ids: a request's page list indexes the target's and the draft's KV alike,
so one allocation (and one transfer page list) covers both.

Page 0 is reserved as a scratch page (padding slots of CUDA-graph batches write there) and is
never handed out.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import torch


class PageError(RuntimeError):
    """Misuse of the page allocator (double free, foreign page id)."""


class OutOfPages(RuntimeError):
    """Not enough free pages for an allocation; the caller may wait or preempt."""


class PageAllocator:
    """Owns which pages are free. Sole writer of the free set and the reference counts.

    Invariants: every page id in [reserved, num_pages) is either free (refcount 0, marked in
    `_free_mask`) or held (refcount > 0, unmarked). `num_free + held = usable`. Reference counts
    let several requests share a page (prefix reuse); a page returns to the free set when its
    last holder frees it.

    Policy: a KV transfer moves one descriptor per run of pages that are consecutive on both
    sides (kvtransfer/coalesce.py), so multi-page allocations prefer runs: the smallest free run
    that fits (best fit keeps long runs for long prompts), else the longest runs first. `after`
    asks for the pages right after a page the caller already holds (a request growing by a
    chunk). Small allocations (< RUN_SEARCH_MIN_PAGES: decode growth, the hot path) take the
    lowest free ids from a min-heap, O(log n) a page, which fills holes before it cuts into
    long runs; the run search is a numpy pass over the pool (~0.2 ms at 100k pages), paid once
    per prompt-sized allocation."""

    RUN_SEARCH_MIN_PAGES = 8

    def __init__(self, num_pages: int, reserved: int = 1) -> None:
        if num_pages <= reserved:
            raise ValueError(f"num_pages: {num_pages} leaves no usable page ({reserved} reserved)")
        self.num_pages, self.reserved = num_pages, reserved
        self._refcount = [0] * num_pages
        self._free_mask = np.zeros(num_pages, dtype=bool)  # [num_pages] True = free
        self._free_mask[reserved:] = True
        self._num_free = num_pages - reserved
        # Lazy min-heap of free ids: entries of pages taken by a run allocation stay behind and
        # are skipped when popped (mask says held); rebuilt when stale entries pile up.
        self._heap: list[int] = list(range(reserved, num_pages))  # sorted = a valid heap
        self.num_freed = 0  # pages returned to the pool so far (a decode worker's `settle`)

    @property
    def num_usable(self) -> int:
        return self.num_pages - self.reserved

    @property
    def num_free(self) -> int:
        return self._num_free

    def can_alloc(self, n: int) -> bool:
        return n <= self._num_free

    def alloc(self, n: int, *, after: int | None = None) -> list[int]:
        """`n` pages, refcount 1. `after`: a page id; if the n pages following it are all free,
        those are returned (in order), so a growing request stays one run."""
        if n < 0:
            raise ValueError(f"n: cannot allocate {n} pages")
        if n > self._num_free:
            raise OutOfPages(f"need {n} pages, {self._num_free} free of {self.num_usable}")
        if n == 0:
            return []
        if (after is not None and self.reserved <= after + 1 and after + 1 + n <= self.num_pages
                and self._free_mask[after + 1 : after + 1 + n].all()):
            pages = list(range(after + 1, after + 1 + n))
        elif n < self.RUN_SEARCH_MIN_PAGES:
            pages = [self._pop_lowest() for _ in range(n)]
        else:
            pages = self._take_runs(n)
        for p in pages:
            self._refcount[p] = 1
        self._free_mask[pages] = False
        self._num_free -= n
        return pages

    def _pop_lowest(self) -> int:
        while True:
            p = heapq.heappop(self._heap)  # never empty: num_free >= 1 and free pages are in it
            if self._free_mask[p]:
                self._free_mask[p] = False  # taken: a second heap entry of p is now stale
                return p

    def _take_runs(self, n: int) -> list[int]:
        """n free pages as few runs as this policy finds: best fit, else longest first."""
        edges = np.diff(self._free_mask.astype(np.int8), prepend=0, append=0)
        starts = np.flatnonzero(edges == 1)  # [R] first page of each free run
        lengths = np.flatnonzero(edges == -1) - starts  # [R]
        fits = np.flatnonzero(lengths >= n)
        if fits.size:  # smallest run that fits; ties: lowest id (argmin takes the first)
            r = fits[np.argmin(lengths[fits])]
            return list(range(int(starts[r]), int(starts[r]) + n))
        pages: list[int] = []
        for r in np.lexsort((starts, -lengths)):  # longest first, then lowest id
            take = min(int(lengths[r]), n - len(pages))
            pages.extend(range(int(starts[r]), int(starts[r]) + take))
            if len(pages) == n:
                break
        return pages

    def share(self, page_ids: Iterable[int]) -> None:
        """Add a holder to pages that are already held (prefix reuse)."""
        for p in page_ids:
            self._check_id(p)
            if self._refcount[p] == 0:
                raise PageError(f"page {p}: cannot share a free page")
            self._refcount[p] += 1

    def free(self, page_ids: Iterable[int]) -> None:
        page_ids = list(page_ids)
        for p in page_ids:  # validate all first: a bad call changes nothing
            self._check_id(p)
            if self._refcount[p] == 0:
                raise PageError(f"page {p}: double free")
        if len(set(page_ids)) != len(page_ids):
            raise PageError(f"free: page ids repeated in one call {sorted(page_ids)}")
        for p in page_ids:
            self._refcount[p] -= 1
            if self._refcount[p] == 0:
                self._free_mask[p] = True
                self._num_free += 1
                self.num_freed += 1
                heapq.heappush(self._heap, p)
        if len(self._heap) > 2 * self.num_pages:  # mostly stale entries: rebuild
            self._heap = np.flatnonzero(self._free_mask).tolist()

    def refcount(self, page_id: int) -> int:
        return self._refcount[page_id]

    def _check_id(self, p: int) -> None:
        if not self.reserved <= p < self.num_pages:
            raise PageError(f"page {p}: not a usable page id [{self.reserved}, {self.num_pages})")


@dataclass(frozen=True, slots=True, kw_only=True)
class KVGroupSpec:
    """Shape of one layer group's KV (per rank: heads already divided by TP)."""

    name: str
    num_layers: int
    num_kv_heads: int
    head_dim: int


@dataclass(frozen=True, slots=True, kw_only=True)
class KVRegionInfo:
    """Where a group's KV lives, for registering it with a transfer engine."""

    name: str
    base_ptr: int
    num_layers: int
    num_pages: int
    page_bytes: int  # bytes of one (layer, page) block: 2 * page_size * Hkv * D * itemsize
    device: str


class KVPool:
    """Owns the KV memory of every layer group. Attention backends write new K/V into the
    layer views during a forward; transfer backends write whole pages between forwards."""

    def __init__(
        self, groups: Sequence[KVGroupSpec], num_pages: int, page_size: int,
        dtype: torch.dtype, device: torch.device | str,
    ) -> None:
        names = [g.name for g in groups]
        if len(set(names)) != len(names):
            raise ValueError(f"groups: duplicate layer group names {names}")
        self.page_size, self.num_pages, self.dtype = page_size, num_pages, dtype
        self.specs = {g.name: g for g in groups}
        # [L, num_pages, 2, page_size, Hkv, D] per group
        self._kv = {
            g.name: torch.zeros(
                g.num_layers, num_pages, 2, page_size, g.num_kv_heads, g.head_dim,
                dtype=dtype, device=device,
            )
            for g in groups
        }

    def layer(self, group: str, layer: int) -> torch.Tensor:
        """[num_pages, 2, page_size, Hkv, D] view of one layer's pages."""
        return self._kv[group][layer]

    def group_tensor(self, group: str) -> torch.Tensor:
        return self._kv[group]

    def move_tokens(self, group: str, src_slots: torch.Tensor, dst_slots: torch.Tensor) -> None:
        """Copy the K/V of token slots `src_slots` [n] to `dst_slots` [n] (slot = page *
        page_size + offset) in every layer of `group`. Sources are read before any write, so
        overlapping lists are safe. Used to compact an accepted tree path."""
        kv, ps = self._kv[group], self.page_size
        values = kv[:, src_slots // ps, :, src_slots % ps]  # [n, L, 2, Hkv, D] gathered copy
        kv[:, dst_slots // ps, :, dst_slots % ps] = values

    def regions(self) -> list[KVRegionInfo]:
        out = []
        for name, t in self._kv.items():
            out.append(KVRegionInfo(
                name=name, base_ptr=t.data_ptr(), num_layers=t.shape[0], num_pages=t.shape[1],
                page_bytes=t[0, 0].numel() * t.element_size(), device=str(t.device),
            ))
        return out

    @staticmethod
    def bytes_per_page(groups: Sequence[KVGroupSpec], page_size: int, dtype: torch.dtype) -> int:
        item = torch.empty((), dtype=dtype).element_size()
        return sum(2 * page_size * g.num_layers * g.num_kv_heads * g.head_dim * item
                   for g in groups)
