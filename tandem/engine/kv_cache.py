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

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch


class PageError(RuntimeError):
    """Misuse of the page allocator (double free, foreign page id)."""


class OutOfPages(RuntimeError):
    """Not enough free pages for an allocation; the caller may wait or preempt."""


class PageAllocator:
    """Owns which pages are free. Sole writer of the free list and the reference counts.

    Invariants: every page id in [reserved, num_pages) is either free (refcount 0, in the free
    list exactly once) or held (refcount > 0, not in the free list). `num_free + held = usable`.
    Reference counts let several requests share a page (prefix reuse); a page returns to the
    free list when its last holder frees it."""

    def __init__(self, num_pages: int, reserved: int = 1) -> None:
        if num_pages <= reserved:
            raise ValueError(f"num_pages: {num_pages} leaves no usable page ({reserved} reserved)")
        self.num_pages, self.reserved = num_pages, reserved
        self._refcount = [0] * num_pages
        # Low ids first: keeps early allocations contiguous, which transfers coalesce.
        self._free: list[int] = list(range(num_pages - 1, reserved - 1, -1))

    @property
    def num_usable(self) -> int:
        return self.num_pages - self.reserved

    @property
    def num_free(self) -> int:
        return len(self._free)

    def can_alloc(self, n: int) -> bool:
        return n <= len(self._free)

    def alloc(self, n: int) -> list[int]:
        if n < 0:
            raise ValueError(f"n: cannot allocate {n} pages")
        if n > len(self._free):
            raise OutOfPages(f"need {n} pages, {len(self._free)} free of {self.num_usable}")
        pages = [self._free.pop() for _ in range(n)]
        for p in pages:
            self._refcount[p] = 1
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
                self._free.append(p)

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
