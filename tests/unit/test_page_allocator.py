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


# -- contiguous allocation policy (KV transfers move one descriptor per run of pages) ----------


def _runs(pages: list[int]) -> int:
    """Number of maximal +1 runs in list order (what a transfer coalesces)."""
    return 1 + sum(1 for a, b in zip(pages, pages[1:]) if b != a + 1) if pages else 0


def _free_runs(alloc: PageAllocator) -> list[tuple[int, int]]:
    """(start, length) of every free run, by brute force over refcounts."""
    out: list[tuple[int, int]] = []
    for p in range(alloc.reserved, alloc.num_pages):
        if alloc.refcount(p) == 0:
            if out and out[-1][0] + out[-1][1] == p:
                out[-1] = (out[-1][0], out[-1][1] + 1)
            else:
                out.append((p, 1))
    return out


def test_fresh_and_churned_pools_hand_out_runs():
    alloc = PageAllocator(1024)
    assert alloc.alloc(256) == list(range(1, 257))  # a fresh request: one run
    rng = random.Random(0)
    held = [alloc.alloc(rng.randint(1, 20)) for _ in range(40)]
    for i in range(0, len(held), 2):  # free every other request: holes of 1..20 pages
        alloc.free(held[i])
    pages = alloc.alloc(256)
    assert _runs(pages) == 1  # the untouched tail still serves a long prompt as one run
    hole = max(_free_runs(alloc)[:-1], key=lambda r: r[1])  # the largest hole before the tail
    assert alloc.alloc(hole[1]) == list(range(hole[0], hole[0] + hole[1]))  # best fit


@pytest.mark.parametrize("seed", range(20))
def test_prompt_sized_allocations_pick_the_smallest_run_that_fits(seed):
    rng = random.Random(seed)
    alloc = PageAllocator(200)
    held: list[list[int]] = []
    for _ in range(300):
        if held and (rng.random() < 0.45 or not alloc.can_alloc(16)):
            alloc.free(held.pop(rng.randrange(len(held))))
            continue
        n = rng.randint(1, 16)
        runs = _free_runs(alloc)
        pages = alloc.alloc(n)
        held.append(pages)
        assert len(pages) == n and len(set(pages)) == n
        fits = [r for r in runs if r[1] >= n]
        if n < PageAllocator.RUN_SEARCH_MIN_PAGES:  # small (decode growth): the lowest ids
            assert pages == [p for s, ln in runs for p in range(s, s + ln)][:n]
        elif fits:
            start, _ = min(fits, key=lambda r: (r[1], r[0]))
            assert pages == list(range(start, start + n))
        else:  # no run fits: the longest runs first, so as few runs as possible
            longest = sorted(runs, key=lambda r: (-r[1], r[0]))
            k = next(i for i in range(1, len(longest) + 1)
                     if sum(r[1] for r in longest[:i]) >= n)
            assert _runs(pages) <= k
    for pages in held:
        alloc.free(pages)
    assert alloc.num_free == alloc.num_usable


def test_growth_after_a_held_page_extends_the_run():
    alloc = PageAllocator(64)
    first = alloc.alloc(8)
    other = alloc.alloc(1)  # someone else takes the page after the run...
    alloc.free(other)  # ...and gives it back
    more = alloc.alloc(4, after=first[-1])
    assert first + more == list(range(1, 13))
    blocker = alloc.alloc(1, after=more[-1])
    assert blocker == [13]
    rest = alloc.alloc(3, after=more[-1])  # page 13 is held: a run elsewhere, never page 13
    assert 13 not in rest and _runs(rest) == 1
    with pytest.raises(OutOfPages):
        alloc.alloc(alloc.num_free + 1, after=1)
