"""KV head re-slicing planner (kvtransfer/reslice.py) against a byte-level reference: numpy
arrays stand for every rank's KV pool; after applying every prefill rank's entries (memmove), each
decode pool holds the full-head KV sliced to its heads on the request's pages, and nothing else
changed (other pages, the prefill pools)."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

from tandem.kvtransfer import coalesce
from tandem.kvtransfer.reslice import (RegionGeometry, kv_head_range, plan_slice_entries,
                                       reslice_problem, slice_bytes_per_page, slices_from_prefill,
                                       slices_to_decode)

pytestmark = pytest.mark.timeout(60)

L, T, DH = 3, 4, 2  # layers, page size, head dim (float32: 8 bytes a head)


def _geom(pool: np.ndarray, head_start: int, num_heads: int) -> RegionGeometry:
    return RegionGeometry(base_ptr=pool.ctypes.data, num_pages=pool.shape[1],
                          page_bytes=pool[0, 0].nbytes, head_start=head_start,
                          num_heads=num_heads)


def _apply(entries: coalesce.Entries, src: np.ndarray, dst: np.ndarray) -> None:
    s0, d0 = src.ctypes.data, dst.ctypes.data
    for a, b, n in zip(entries.src_addrs.tolist(), entries.dst_addrs.tolist(),
                       entries.lengths.tolist()):
        assert s0 <= a and a + n <= s0 + src.nbytes, "entry reads outside the prefill region"
        assert d0 <= b and b + n <= d0 + dst.nbytes, "entry writes outside the decode region"
        ctypes.memmove(b, a, n)


def _run(P: int, D: int, hkv: int, rng: np.random.Generator) -> None:
    n_req, np_pages, nd_pages = int(rng.integers(1, 7)), 10, 12
    full = rng.standard_normal((L, n_req, 2, T, hkv, DH)).astype(np.float32)
    draft_full = rng.standard_normal((1, n_req, 2, T, 2, DH)).astype(np.float32)
    # Page lists: random, sometimes consecutive (runs), the decode list longer (budget).
    src_pages = (np.sort(rng.choice(np_pages, n_req, replace=False)) if rng.random() < 0.5
                 else rng.choice(np_pages, n_req, replace=False))
    dst_pages = rng.choice(nd_pages, n_req + 2, replace=False)
    runs = coalesce.page_runs(src_pages, dst_pages)

    pre, pre_draft = [], []
    for p in range(P):
        h0, hn = kv_head_range(p, P, hkv)
        pool = rng.standard_normal((L, np_pages, 2, T, hn, DH)).astype(np.float32)
        pool[:, src_pages] = full[..., h0:h0 + hn, :]
        draft = rng.standard_normal((1, np_pages, 2, T, 2, DH)).astype(np.float32)
        draft[:, src_pages] = draft_full
        pre.append(pool)
        pre_draft.append(draft)
    pre_before = [x.copy() for x in pre + pre_draft]
    dec, dec_draft = [], []
    for d in range(D):
        _, hn = kv_head_range(d, D, hkv)
        dec.append(rng.standard_normal((L, nd_pages, 2, T, hn, DH)).astype(np.float32))
        dec_draft.append(rng.standard_normal((1, nd_pages, 2, T, 2, DH)).astype(np.float32))
    dec_before = [x.copy() for x in dec]
    draft_before = [x.copy() for x in dec_draft]

    primaries = {d: [] for d in range(D)}
    for p in range(P):
        for piece in slices_from_prefill(p, P, D, hkv):
            d = piece.decode_rank
            if piece.primary:
                primaries[d].append(p)
            src_g = _geom(pre[p], *kv_head_range(p, P, hkv))
            dst_g = _geom(dec[d], *kv_head_range(d, D, hkv))
            # Split layers in two pushes, as layer-wise push does.
            moved = 0
            for layers in (range(0, 1), range(1, L)):
                e = plan_slice_entries(src_g, dst_g, runs, layers, T, piece)
                moved += e.nbytes
                _apply(e, pre[p], dec[d])
            assert moved == n_req * L * slice_bytes_per_page(dst_g, piece)
            e = plan_slice_entries(_geom(pre_draft[p], 0, 0), _geom(dec_draft[d], 0, 0), runs,
                                   range(1), T, piece)
            assert e.nbytes == n_req * slice_bytes_per_page(_geom(dec_draft[d], 0, 0), piece)
            _apply(e, pre_draft[p], dec_draft[d])

    used = dst_pages[:n_req]
    rest = np.setdiff1d(np.arange(nd_pages), used)
    for d in range(D):
        assert len(primaries[d]) == 1, f"decode rank {d}: primaries {primaries[d]}"
        h0, hn = kv_head_range(d, D, hkv)
        np.testing.assert_array_equal(dec[d][:, used], full[..., h0:h0 + hn, :])
        np.testing.assert_array_equal(dec[d][:, rest], dec_before[d][:, rest])
        np.testing.assert_array_equal(dec_draft[d][:, used], draft_full)
        np.testing.assert_array_equal(dec_draft[d][:, rest], draft_before[d][:, rest])
    for before, after in zip(pre_before, pre + pre_draft):
        np.testing.assert_array_equal(before, after)


@pytest.mark.parametrize("hkv", [4, 2])
@pytest.mark.parametrize("P", [1, 2, 4])
@pytest.mark.parametrize("D", [1, 2, 4])
def test_reslice_byte_exact(P: int, D: int, hkv: int) -> None:
    rng = np.random.default_rng(1000 * P + 10 * D + hkv)
    for _ in range(8):
        _run(P, D, hkv, rng)


def test_each_head_sent_once_and_senders() -> None:
    # P=2 -> D=1: both prefill ranks send, rank 0 is the primary.
    s = slices_to_decode(0, 1, 2, 4)
    assert [(x.prefill_rank, x.head_start, x.num_heads, x.primary) for x in s] == [
        (0, 0, 2, True), (1, 2, 2, False)]
    # P=1 -> D=2: rank 0 sends to both and is primary for both.
    assert [(x.decode_rank, x.head_start, x.num_heads, x.primary)
            for x in slices_from_prefill(0, 1, 2, 4)] == [(0, 0, 2, True), (1, 2, 2, True)]
    # Replicated heads (tp 4 > 2 KV heads): ranks 1 and 3 hold copies and send nothing.
    assert slices_from_prefill(1, 4, 1, 2) == () and slices_from_prefill(3, 4, 2, 2) == ()


def test_whole_pages_coalesce_when_heads_match() -> None:
    src = RegionGeometry(base_ptr=0, num_pages=8, page_bytes=256, head_start=2, num_heads=2)
    dst = RegionGeometry(base_ptr=1 << 20, num_pages=8, page_bytes=256, head_start=2, num_heads=2)
    piece = slices_to_decode(1, 2, 2, 4)[0]
    runs = coalesce.page_runs([0, 1, 2, 3], [4, 5, 6, 7])
    e = plan_slice_entries(src, dst, runs, range(1), 4, piece)
    assert len(e) == 1 and e.nbytes == 4 * 256
    # Half the heads: per token chunks (2 x page_size per page), none mergeable on the source.
    src2 = RegionGeometry(base_ptr=0, num_pages=8, page_bytes=512, head_start=0, num_heads=4)
    e2 = plan_slice_entries(src2, dst, runs, range(1), 4, piece)
    assert len(e2) == 4 * 2 * 4 and e2.nbytes == 4 * 256


def test_reslice_problem_names_the_field() -> None:
    assert reslice_problem(4, 1, 2) == "" and reslice_problem(2, 4, 1) == ""
    assert reslice_problem(6, 4, 2).startswith("prefill.tp")
    assert reslice_problem(4, 2, 3).startswith("decode.tp")
