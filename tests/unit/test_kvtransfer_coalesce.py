"""Descriptor coalescing (kvtransfer/coalesce.py) against a byte-level reference: on random page
lists and region shapes, applying the planned entries to a byte buffer must give exactly the
page-by-page copy, with the fewest entries (no two consecutive entries could merge), and the
block-index form used with NIXL's prepared lists must name the same bytes. Plus one in-process
NIXL round trip through the prepared lists (skipped where nixl is not installed)."""

from __future__ import annotations

import ctypes
import importlib.util
import random
import threading
import time

import numpy as np
import pytest

from tandem.kvtransfer import KVRegion, page_runs, plan_layers
from tandem.kvtransfer.coalesce import block_indices, plan_entries
from tandem.kvtransfer.coalesce import page_runs as page_runs_np


def _runs_reference(src, dst):
    """The original per-pair loop: the specification of a run."""
    runs = []
    for s, d in zip(src, dst):
        if runs and runs[-1][0] + runs[-1][2] == s and runs[-1][1] + runs[-1][2] == d:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((s, d, 1))
    return runs


def _page_list(rng: random.Random, num_pages: int, n: int) -> list[int]:
    """Scattered, one run, a few runs, descending, or the whole pool."""
    kind = rng.choice(("scattered", "run", "runs", "descending", "all"))
    if kind == "scattered":
        return rng.sample(range(num_pages), n)
    if kind == "run":
        start = rng.randrange(num_pages - n + 1)
        return list(range(start, start + n))
    if kind == "descending":
        return sorted(rng.sample(range(num_pages), n), reverse=True)
    if kind == "all":
        return list(range(num_pages))[:n]
    pages = sorted(rng.sample(range(num_pages), n))  # dense: natural runs; then shuffle chunks
    cuts = sorted(rng.sample(range(1, n), min(n - 1, rng.randint(0, 3)))) if n > 1 else []
    chunks = [pages[a:b] for a, b in zip([0] + cuts, cuts + [n])]
    rng.shuffle(chunks)
    return [p for c in chunks for p in c]


@pytest.mark.parametrize("seed", range(300))
def test_entries_copy_exactly_the_pages_with_the_fewest_entries(seed):
    rng = random.Random(seed)
    layers_total = rng.randint(1, 4)
    src_np, dst_np = rng.randint(1, 24), rng.randint(1, 24)
    page_bytes = rng.choice((1, 8, 24, 64))
    n = rng.randint(1, min(src_np, dst_np))
    src_pages = _page_list(rng, src_np, n)
    dst_pages = _page_list(rng, dst_np, n)
    spare = [p for p in range(dst_np) if p not in set(dst_pages)]
    dst_pages += rng.sample(spare, rng.randint(0, len(spare)))  # decode reserved more
    lo = rng.randrange(layers_total)
    layers = range(lo, rng.randint(lo + 1, layers_total))
    src_base, dst_base = 4096, 1 << 20  # fake addresses: offsets into the buffers below

    src_buf = np.frombuffer(rng.randbytes(layers_total * src_np * page_bytes), dtype=np.uint8)
    want = np.zeros(layers_total * dst_np * page_bytes, dtype=np.uint8)
    for layer in layers:  # reference: one page at a time (extra dst pages get nothing)
        for s, d in zip(src_pages, dst_pages):
            so, do = (layer * src_np + s) * page_bytes, (layer * dst_np + d) * page_bytes
            want[do : do + page_bytes] = src_buf[so : so + page_bytes]

    runs = page_runs_np(src_pages, dst_pages)
    assert [tuple(r) for r in runs.tolist()] == _runs_reference(src_pages, dst_pages)
    e = plan_entries(src_base, src_np, dst_base, dst_np, page_bytes, runs, layers)
    got = np.zeros_like(want)
    for sa, da, ln in zip(e.src_addrs.tolist(), e.dst_addrs.tolist(), e.lengths.tolist()):
        so, do = sa - src_base, da - dst_base
        assert ln > 0 and so + ln <= src_buf.size and do + ln <= got.size
        got[do : do + ln] = src_buf[so : so + ln]
    assert np.array_equal(got, want)  # every page landed, nothing else was written
    assert e.nbytes == len(layers) * n * page_bytes  # no byte twice
    ends_s, ends_d = e.src_addrs[:-1] + e.lengths[:-1], e.dst_addrs[:-1] + e.lengths[:-1]
    assert not ((ends_s == e.src_addrs[1:]) & (ends_d == e.dst_addrs[1:])).any()  # maximal

    # The block-index form (NIXL prepared lists) names the same blocks, in order.
    src_idx = block_indices(e.src_addrs, e.lengths, src_base, page_bytes,
                            layers_total * src_np)
    dst_idx = block_indices(e.dst_addrs, e.lengths, dst_base, page_bytes,
                            layers_total * dst_np)
    assert src_idx.tolist() == [layer * src_np + s for layer in layers for s in src_pages]
    assert dst_idx.tolist() == [layer * dst_np + d for layer in layers
                                for d in dst_pages[:n]]


def test_layout_wrappers_agree_with_the_vectorized_planner():
    src = KVRegion(name="t", base_ptr=0x1000, num_layers=3, num_pages=16, page_bytes=64)
    dst = KVRegion(name="t", base_ptr=0x9000, num_layers=3, num_pages=16, page_bytes=64)
    runs = page_runs([3, 4, 5, 9, 1], [7, 8, 9, 2, 3])
    assert runs == [(3, 7, 3), (9, 2, 1), (1, 3, 1)]
    batches = plan_layers(src, dst, runs, range(3), max_entries=4)
    assert [len(b.lengths) for b in batches] == [4, 4, 1]
    assert plan_layers(src, dst, runs, range(3), max_entries=None)[0].lengths == (
        192, 64, 64) * 3
    e = plan_entries(0x1000, 16, 0x9000, 16, 64, np.array(runs), range(3))
    flat = [x for b in batches for x in zip(b.src_addrs, b.dst_addrs, b.lengths)]
    assert flat == list(zip(e.src_addrs.tolist(), e.dst_addrs.tolist(), e.lengths.tolist()))


def test_block_indices_reject_what_a_prepared_list_cannot_name():
    ok = block_indices(np.array([100, 164]), np.array([64, 128]), 100, 64, 4)
    assert ok.tolist() == [0, 1, 2] and ok.dtype == np.int32
    assert block_indices(np.array([36]), np.array([64]), 100, 64, 4) is None  # below the base
    assert block_indices(np.array([101]), np.array([64]), 100, 64, 4) is None  # misaligned
    assert block_indices(np.array([100]), np.array([32]), 100, 64, 4) is None  # part of a block
    assert block_indices(np.array([292]), np.array([128]), 100, 64, 4) is None  # past the end
    assert block_indices(np.zeros(0), np.zeros(0), 100, 64, 4).tolist() == []


@pytest.mark.skipif(importlib.util.find_spec("nixl") is None, reason="nixl is not installed")
def test_nixl_prepared_lists_move_scattered_and_run_pages_bit_exact(monkeypatch):
    """Sender and receiver in this process over UCX/TCP on loopback: page writes go through the
    prepared lists (scattered pages and runs), the bytes land exactly, nothing else moves."""
    monkeypatch.setenv("UCX_TLS", "tcp")
    monkeypatch.setenv("UCX_NET_DEVICES", "lo")
    monkeypatch.setenv("NIXL_LOG_LEVEL", "WARN")
    from tandem.kvtransfer import (AuxRegion, CompatInfo, DecodeReceiver, EndpointConfig,
                                   KVLayout, PrefillSender, Received)

    compat = CompatInfo(model="m", dtype="bf16", page_size=16, kv_layout="NHD", tp_size=1,
                        tp_rank=0, draft_model="d", draft_hidden_size=64, topk=1,
                        feature_layers=(3,))
    cfg = EndpointConfig(handshake_timeout_s=10, timeout_s=10.0, drain_timeout_s=1.0,
                         lease_margin_s=2.0, poll_sleep_s=0.0002)
    groups, num_pages = (("target", 3, 256), ("draft", 1, 128)), 40
    rng = random.Random(7)

    def memory(fill: bool):
        bufs, regions = {}, []
        for name, layers, pb in groups:
            data = rng.randbytes(layers * num_pages * pb) if fill else b"\xee" * (
                layers * num_pages * pb)
            bufs[name] = ctypes.create_string_buffer(data, len(data))
            regions.append(KVRegion(name=name, base_ptr=ctypes.addressof(bufs[name]),
                                    num_layers=layers, num_pages=num_pages, page_bytes=pb))
        aux = ctypes.create_string_buffer(4 * 256)
        bufs["aux"] = aux
        return bufs, KVLayout(regions=tuple(regions), aux=AuxRegion(
            base_ptr=ctypes.addressof(aux), num_slots=4, slot_bytes=256))

    sbufs, slayout = memory(True)
    rbufs, rlayout = memory(False)
    rx = DecodeReceiver("nixl", rlayout, compat, release=lambda r: None, config=cfg)
    tx = PrefillSender("nixl", slayout, compat, config=cfg)
    events: list = []
    try:
        done = threading.Event()

        def serve():  # the receiver answers the handshake while connect() waits
            while not done.is_set():
                events.extend(rx.poll())
                time.sleep(0.0002)

        t = threading.Thread(target=serve, daemon=True)
        t.start()
        tx.connect(rx.info())
        done.set()
        t.join()
        cases = [(rng.sample(range(num_pages), 9), rng.sample(range(num_pages), 12)),
                 (list(range(20, 30)), list(range(5, 15)))]
        for room, (src_pages, dst_pages) in enumerate(cases, start=1):
            dest = rx.expect(room, dst_pages, room % 4)
            tx.send(dest, src_pages, b"seed-%d" % room)
            end = time.monotonic() + 10
            while not any(isinstance(e, Received) and e.room == room for e in events):
                assert time.monotonic() < end, f"room {room} not received: {events}"
                events.extend(rx.poll())
                tx.poll()
            tx.wait(room, timeout_s=5)
            for name, layers, pb in groups:
                src, dst = sbufs[name].raw, rbufs[name].raw
                for layer in range(layers):
                    for s, d in zip(src_pages, dst_pages):
                        so, do = (layer * num_pages + s) * pb, (layer * num_pages + d) * pb
                        assert dst[do : do + pb] == src[so : so + pb], (name, layer, s, d)
        written = {(name, layer, d) for src_pages, dst_pages in cases
                   for name, layers, _ in groups for layer in range(layers)
                   for d in dst_pages[: len(src_pages)]}
        for name, layers, pb in groups:  # pages outside the lists keep the sentinel
            raw = rbufs[name].raw
            for layer in range(layers):
                for p in range(num_pages):
                    if (name, layer, p) not in written:
                        o = (layer * num_pages + p) * pb
                        assert raw[o : o + pb] == b"\xee" * pb
        # one write per group push, and each room's aux write (a whole slot) is prepared too
        assert tx.backend.num_prepped_writes == 2 * len(groups) + 2
    finally:
        tx.close()
        rx.close()


def test_block_indices_small_sequences_take_the_same_rules_as_arrays():
    """A few entries as plain ints (the usual push) go through the plain-Python path; it names
    the same blocks and refuses the same entries as the numpy path, on random cases."""
    rng = random.Random(5)
    for _ in range(300):
        bb, nb, base = rng.choice([64, 4096]), rng.randint(1, 40), rng.choice([0, 1 << 20])
        n = rng.randint(0, 6)
        addrs = [base + rng.randint(-2, nb) * bb + rng.choice([0, 0, 0, 1]) for _ in range(n)]
        lengths = [rng.randint(0, 4) * bb + rng.choice([0, 0, 0, 8]) for _ in range(n)]
        small = block_indices(addrs, lengths, base, bb, nb)
        # the numpy path never sees a negative address; it refuses those below the base too
        big = (None if any(a < 0 for a in addrs) else
               block_indices(np.array(addrs, dtype=np.uint64), np.array(lengths, dtype=np.uint64),
                             base, bb, nb))
        assert (small is None) == (big is None), (addrs, lengths)
        if small is not None:
            assert small.dtype == np.int32 and small.tolist() == big.tolist()


def test_small_plans_in_plain_python_equal_the_vectorized_planner():
    """plan_layers makes small plans (a few runs x layers) without numpy; on random page lists
    and layer ranges its batches equal those of the vectorized planner (plan_entries)."""
    from tandem.kvtransfer.layout import plan_entries as plan_entries_np, split_batches

    rng = random.Random(11)
    for _ in range(300):
        layers_total, np_src, np_dst = rng.randint(1, 5), rng.randint(4, 24), rng.randint(4, 24)
        src = KVRegion(name="t", base_ptr=0x10000, num_layers=layers_total, num_pages=np_src,
                       page_bytes=64)
        dst = KVRegion(name="t", base_ptr=0x90000, num_layers=layers_total, num_pages=np_dst,
                       page_bytes=64)
        n = rng.randint(1, min(np_src, np_dst))
        src_pages = rng.sample(range(np_src), n) if rng.random() < 0.5 else list(range(n))
        dst_pages = rng.sample(range(np_dst), n) if rng.random() < 0.5 else list(range(n))
        a = rng.randint(0, layers_total - 1)
        layers = range(a, rng.randint(a + 1, layers_total))
        runs = page_runs_np(src_pages, dst_pages)
        want = split_batches(plan_entries_np(src, dst, runs, layers), "cpu", "cpu", max_entries=3)
        assert len(runs) * len(layers) <= 64  # the plain-Python path
        assert plan_layers(src, dst, runs, layers, max_entries=3) == want
        assert plan_layers(src, dst, runs.tolist(), layers, max_entries=3) == want
