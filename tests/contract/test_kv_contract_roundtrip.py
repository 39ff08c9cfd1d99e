"""Contract: bit-exact round trips (KV pages of every group and layer + the aux slot) over every
backend, the handshake refusing incompatible peers with the field named, and the aux room check.

The receiver runs in the worker (another OS process for mooncake/nixl), the sender here."""

from __future__ import annotations

import random

import pytest
from kvt_harness import LayoutSpec, compat_wire, config_wire
from kvt_runners import make_link

pytestmark = pytest.mark.timeout(120)

LAYOUTS = {
    # one group, 4 KiB pages, contiguous pages: coalesces to one entry per... whole transfer
    "one_group_contiguous": (LayoutSpec(groups=(("target", 4, 4096),), num_pages=64),
                             list(range(8, 40)), list(range(20, 60))),
    # target + draft of different page sizes, shuffled (non-contiguous) pages on both sides
    "target_draft_shuffled": (LayoutSpec(groups=(("target", 6, 1024), ("draft", 1, 512)),
                                         num_pages=96), "shuffle", "shuffle"),
    # three groups with odd page sizes; runs of consecutive pages mixed with gaps
    "three_groups_odd_sizes": (LayoutSpec(groups=(("target", 3, 96), ("draft", 2, 200),
                                                  ("extra", 1, 8)), num_pages=50),
                               [1, 2, 3, 7, 8, 20, 21, 22, 23, 40],
                               [30, 31, 32, 2, 3, 4, 5, 6, 9, 10]),
    # 2 groups x 4 layers x 600 alternating pages = 4800 entries: >1024, forces batch splitting
    "over_1024_entries": (LayoutSpec(groups=(("target", 4, 64), ("draft", 1, 32)), num_pages=1300),
                          list(range(0, 1200, 2)), list(range(1, 1201, 2))),
}


def _pages(spec: LayoutSpec, src, dst, rng: random.Random):
    if src == "shuffle":
        src = rng.sample(range(spec.num_pages), 40)
        dst = rng.sample(range(spec.num_pages), 48)  # decode reserves more than the prompt needs
    return tuple(src), tuple(dst)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_round_trip_is_bit_exact(pair, layout):
    spec, src, dst = LAYOUTS[layout]
    src, dst = _pages(spec, src, dst, random.Random(layout))
    sender, receiver = pair.local(), pair.worker
    link, res = make_link(sender, receiver, spec, seed=7)
    assert res == ("ok",)
    payload = bytes(random.Random(3).randbytes(spec.aux_slot_bytes - 24))  # a full slot
    dest = receiver.call("expect", 101, dst, 3, 10.0)
    sender.call("send", dest, src, payload)

    (got,) = link.wait_for(receiver, lambda e: e[0] in ("received", "failed"), 30)
    assert got == ("received", 101, dst[: len(src)], payload)
    assert receiver.call("verify", 7, src, dst) == (0, 0)  # exact bytes, nothing else touched
    (sent,) = link.wait_for(sender, lambda e: e[0] == "sent", 10)
    assert sent[1:3] == (101, "done")
    releases = [e for e in link.events(receiver) if e[0] == "released"]
    assert [(e[1], e[2], e[3], e[4]) for e in releases] == [(101, dst, 3, "done")]


def test_many_transfers_reuse_slots_and_empty_seed(pair):
    """Several rooms in flight at once, one empty seed; every room released exactly once."""
    spec = LayoutSpec(groups=(("target", 2, 256), ("draft", 1, 128)), num_pages=64, aux_slots=4)
    sender, receiver = pair.local(), pair.worker
    link, res = make_link(sender, receiver, spec, seed=11)
    assert res == ("ok",)
    rooms = {}
    for i in range(4):
        src = tuple(range(i * 8, i * 8 + 6))
        dst = tuple(range(32 + i * 8, 32 + i * 8 + 8))
        dest = receiver.call("expect", 500 + i, dst, i, 10.0)
        payload = b"" if i == 0 else bytes([i]) * (10 * i)
        sender.call("send", dest, src, payload)
        rooms[500 + i] = (src, dst, payload)
    got = link.wait_for(receiver, lambda e: e[0] == "received", 30)
    while len(got) < 4:
        got = link.wait_for(receiver, lambda e: e[0] == "received", 30)
    for _, room, pages, payload in got:
        src, dst, want = rooms[room]
        assert pages == dst[: len(src)] and payload == want
    released = sorted(e[1] for e in link.events(receiver) if e[0] == "released")
    assert released == sorted(rooms)
    m = receiver.call("metrics")
    assert m["num_done"] >= 4 and m["bytes"] > 0 and m["gbps"] > 0


@pytest.mark.parametrize("field,value", [("dtype", "float16"), ("topk", 8),
                                         ("feature_layers", [2, 15, 28])])
def test_wrong_compat_is_refused_naming_the_field(pair, field, value):
    spec = LayoutSpec(groups=(("target", 1, 64),), num_pages=4)
    _, res = make_link(pair.local(), pair.worker, spec, sender_compat=compat_wire(**{field: value}))
    assert res[0] == "error" and res[1] == "handshake", res
    mine = tuple(value) if isinstance(value, list) else value
    theirs = compat_wire()[field]
    theirs = tuple(theirs) if isinstance(theirs, list) else theirs
    assert f"{field}: prefill={mine!r} decode={theirs!r}" in res[2], res[2]


def test_layout_mismatch_is_refused_by_decode(pair):
    """The decode side checks too: a page size that differs is named with both values."""
    spec = LayoutSpec(groups=(("target", 2, 64), ("draft", 1, 32)), num_pages=8)
    other = LayoutSpec(groups=(("target", 2, 128), ("draft", 1, 32)), num_pages=8)
    _, res = make_link(pair.local(), pair.worker, spec, sender_spec=other)
    assert res[0] == "error" and res[1] == "handshake", res
    assert "target.page_bytes: prefill=128 decode=64" in res[2]


def test_unequal_tp_without_num_kv_heads_is_refused(pair):
    """Different TP sizes re-slice only when both sides state the model's KV heads."""
    spec = LayoutSpec(groups=(("target", 1, 64),), num_pages=4)
    _, res = make_link(pair.local(), pair.worker, spec,
                       sender_compat=compat_wire(tp_size=2, tp_rank=1))
    assert res[:2] == ("error", "handshake") and "tp_size: prefill=2" in res[2]
    assert "num_kv_heads" in res[2]


@pytest.mark.parametrize("fault,needle", [("wrong_room", "holds room"),
                                          ("corrupt_aux", "checksum")])
def test_bad_aux_slot_is_caught(pair, fault, needle):
    """A seed written for another room (or corrupted) fails the request; pages still released."""
    spec = LayoutSpec(groups=(("target", 2, 64),), num_pages=16)
    sender, receiver = pair.local(), pair.worker
    link, res = make_link(sender, receiver, spec, faults=(1.0, fault, 0, 0.0))
    assert res == ("ok",)
    dst = (9, 10, 11)
    dest = receiver.call("expect", 77, dst, 1, 10.0)
    sender.call("send", dest, (1, 2), b"seed-bytes")
    (failed,) = link.wait_for(receiver, lambda e: e[0] in ("received", "failed"), 30)
    assert failed[:3] == ("failed", 77, "corrupt") and needle in failed[3]
    rel = link.wait_for(receiver, lambda e: e[0] == "released", 10)
    assert [(e[1], e[2], e[4]) for e in rel] == [(77, dst, "failed")]


def test_config_is_validated():
    from tandem.kvtransfer import EndpointConfig

    with pytest.raises(ValueError, match="lease_margin_s"):
        EndpointConfig(**config_wire(lease_margin_s=0.5, drain_timeout_s=1.0))
