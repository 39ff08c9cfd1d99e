"""Page allocator invariants: conservation under random alloc/share/free, errors on misuse."""

from __future__ import annotations

import random

import pytest

from tandem.engine import OutOfPages, PageAllocator, PageError


@pytest.mark.parametrize("seed", range(5))
def test_random_sequences_conserve_pages(seed):
    rng = random.Random(seed)
    alloc = PageAllocator(64)
    held: list[list[int]] = []  # one entry per holder
    for _ in range(2000):
        op = rng.random()
        if op < 0.45:
            n = rng.randint(0, 8)
            if alloc.can_alloc(n):
                held.append(alloc.alloc(n))
            else:
                with pytest.raises(OutOfPages):
                    alloc.alloc(n)
        elif op < 0.55 and held:
            pages = rng.choice(held)
            alloc.share(pages)
            held.append(list(pages))
        elif held:
            alloc.free(held.pop(rng.randrange(len(held))))
        counts: dict[int, int] = {}
        for pages in held:
            for p in pages:
                counts[p] = counts.get(p, 0) + 1
        assert alloc.num_free + len(counts) == alloc.num_usable
        assert all(alloc.refcount(p) == c for p, c in counts.items())
    for pages in held:
        alloc.free(pages)
    assert alloc.num_free == alloc.num_usable
    assert sorted(alloc.alloc(alloc.num_usable)) == list(range(1, 64))  # page 0 stays reserved


def test_double_free_is_an_error():
    alloc = PageAllocator(8)
    pages = alloc.alloc(2)
    alloc.free(pages)
    with pytest.raises(PageError, match="double free"):
        alloc.free(pages)
    assert alloc.num_free == alloc.num_usable


def test_bad_free_changes_nothing():
    alloc = PageAllocator(8)
    a = alloc.alloc(2)
    with pytest.raises(PageError):
        alloc.free([a[0], 0])  # page 0 is reserved, never handed out
    with pytest.raises(PageError):
        alloc.free([a[0], a[0]])
    assert alloc.num_free == alloc.num_usable - 2
    alloc.free(a)


def test_shared_page_returns_after_last_holder():
    alloc = PageAllocator(4)
    pages = alloc.alloc(1)
    alloc.share(pages)
    alloc.free(pages)
    assert alloc.num_free == alloc.num_usable - 1
    alloc.free(pages)
    assert alloc.num_free == alloc.num_usable
    with pytest.raises(PageError):
        alloc.share(pages)
