"""`PrefixCache`: automatic prefix caching -- full KV pages of prompt tokens reused by later
requests whose prompts start with the same tokens (EngineConfig.enable_prefix_caching).

Keys. A prompt is cut into pages of `page_size` tokens; page k's key is
    sha256(key of page k-1, tokens of page k, the `lookahead` tokens after it)
so two prompts share key k exactly when they share tokens [0, (k+1) * page_size + lookahead):
the page's KV (a function of every token up to its end) is then the same. A cryptographic
hash, not Python's `hash`: a collision would hand one prompt another prompt's KV, and prompts
come from users.

lookahead. A plain engine's page depends on nothing after it (lookahead 0). With an EAGLE draft
head the draft KV lives in the same page ids (kv_cache.py: all layer groups share page ids, one
allocation covers both), and the draft KV at position p is computed from (f_p, x_{p+1}) --
the token AFTER p. So the draft KV of a page's last slot depends on the next page's first
token, and `SpecEngine` caches with lookahead 1: a page is cached and matched only together
with that token (a prompt ending exactly at a page boundary keeps its last page private, its
next token being the sampled one).

Holders. The cache holds ONE allocator reference on every page it maps (refcount); a request
using a cached page holds another. A cached page whose only holder is the cache is
"evictable": it stays (LRU) until the allocator runs short, and `evict` frees the least
recently used ones -- before anyone is preempted (scheduler.py). Pages are read-only while
shared: only full pages are cached, and a request writes only at positions >= its
num_computed, which lie past its full cached pages (the partially filled page is never shared).

Owns: the key -> page map, the page -> key map and the LRU order. The scheduler is its only
caller; it decides when pages are complete (commit) and when requests take them (admission).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Iterable, Sequence

import numpy as np

from tandem.engine.kv_cache import PageAllocator


class PrefixCache:
    def __init__(self, allocator: PageAllocator, page_size: int, lookahead: int = 0) -> None:
        if lookahead < 0:
            raise ValueError(f"lookahead: must be >= 0, got {lookahead}")
        self.allocator, self.page_size, self.lookahead = allocator, page_size, lookahead
        self._page_of: dict[bytes, int] = {}  # key -> cached page id
        # page id -> key, least recently used first. Invariant: a chain's parent is used no
        # less recently than its children (`touch` walks a chain leaf -> root), so eviction
        # takes leaves before the pages that lead to them.
        self._lru: OrderedDict[int, bytes] = OrderedDict()

    @property
    def num_pages(self) -> int:
        """Pages the cache maps (held by requests or not)."""
        return len(self._lru)

    def page_keys(self, prompt_ids: Sequence[int]) -> list[bytes]:
        """Chained keys of the prompt's cacheable pages: page k such that its tokens and the
        `lookahead` tokens after it are all prompt tokens."""
        ps = self.page_size
        ids = np.asarray(prompt_ids, dtype=np.int64)
        keys: list[bytes] = []
        parent = b""
        for k in range((len(prompt_ids) - self.lookahead) // ps):
            parent = hashlib.sha256(parent + ids[k * ps : (k + 1) * ps + self.lookahead]
                                    .tobytes()).digest()
            keys.append(parent)
        return keys

    def match(self, keys: Sequence[bytes], max_pages: int) -> list[int]:
        """Page ids of the longest cached chain `keys[:n]`, n <= max_pages, marked as just used.
        Takes no reference: the caller `allocator.share`s the pages it keeps."""
        pages: list[int] = []
        for key in keys[:max_pages]:
            page = self._page_of.get(key)
            if page is None:  # a chain: page k is only valid after pages 0..k-1
                break
            pages.append(page)
        self.touch(pages)
        return pages

    def insert(self, key: bytes, page_id: int) -> bool:
        """Cache a page whose KV is complete (the caller holds it), taking the cache's
        reference. False if the key is already cached (another request computed the same
        prefix at the same time): the caller's page then stays private to it."""
        if key in self._page_of:
            return False
        if page_id in self._lru:
            raise ValueError(f"page_id: page {page_id} is already cached under another key")
        self.allocator.share([page_id])
        self._page_of[key] = page_id
        self._lru[page_id] = key
        return True

    def touch(self, chain: Sequence[int]) -> None:
        """Mark a chain of cached pages (root first) as just used, root most recent."""
        for page in reversed(chain):
            if page in self._lru:
                self._lru.move_to_end(page)

    def num_evictable(self) -> int:
        """Cached pages no request holds. O(cached pages): for the slow path only."""
        return sum(1 for p in self._lru if self.allocator.refcount(p) == 1)

    def evict(self, num_pages: int) -> int:
        """Free up to `num_pages` evictable pages, least recently used first. Returns how many
        were freed."""
        victims = []
        for page in self._lru:
            if len(victims) == num_pages:
                break
            if self.allocator.refcount(page) == 1:  # the cache is the only holder
                victims.append(page)
        self._drop(victims)
        return len(victims)

    def clear(self) -> int:
        """Evict every page no request holds (tests, shutdown). Returns how many."""
        return self.evict(len(self._lru))

    def _drop(self, page_ids: Iterable[int]) -> None:
        page_ids = list(page_ids)
        for page in page_ids:
            del self._page_of[self._lru.pop(page)]
        self.allocator.free(page_ids)
