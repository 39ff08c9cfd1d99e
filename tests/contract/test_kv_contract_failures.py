"""Contract: failures end in a clear TransferError within the deadline (dead peer = kill -9, frozen
peer = SIGSTOP; simulated on the FakeFabric for `fake`), aborts from either side never release
pages while a writer may still write, and a mixed run gives every page and slot back exactly once.

Deadlines are short (config_wire: transfer 3 s, lease margin 2 s, drain 1.5 s)."""

from __future__ import annotations

import time

import pytest
from kvt_harness import LayoutSpec, compat_wire, config_wire
from kvt_runners import make_link

pytestmark = pytest.mark.timeout(120)

CFG = config_wire()
TIMEOUT, LEASE = CFG["timeout_s"], CFG["timeout_s"] + CFG["lease_margin_s"]
SLACK = 1.5  # scheduling noise on a loaded 2-core machine
# 32 MiB per layer group: a frozen TCP peer cannot absorb it in socket buffers.
BIG = LayoutSpec(groups=(("target", 4, 256 * 1024), ("draft", 1, 256 * 1024)), num_pages=40)
SMALL = LayoutSpec(groups=(("target", 8, 512), ("draft", 1, 256)), num_pages=64)
SRC, DST = tuple(range(0, 32)), tuple(range(8, 40))


def _granted(link, room):
    link.wait_state(link.r, room, ("transferring",), 15)


def _released(link):
    return [e for e in link.events(link.r) if e[0] == "released"]


@pytest.mark.slow
def test_dead_receiver_fails_the_sender_quickly(pair):
    sender, receiver = pair.local(), pair.remote()
    link, res = make_link(sender, receiver, SMALL)
    assert res == ("ok",)
    dest = receiver.call("expect", 1, DST, 0, TIMEOUT)
    sender.call("send", dest, SRC, b"seed", 0.25)  # one layer every 0.25 s
    _granted(link, 1)
    t_kill = time.monotonic()
    receiver.kill()
    (sent,) = link.wait_for(sender, lambda e: e[0] == "sent", TIMEOUT + SLACK + 5)
    assert sent[2] == "failed" and sent[3] in ("peer_dead", "timeout"), sent
    assert time.monotonic() - t_kill <= TIMEOUT + SLACK


@pytest.mark.slow
def test_dead_sender_fails_the_receiver_and_leases_the_pages(pair):
    sender, receiver = pair.remote(), pair.local()
    link, res = make_link(sender, receiver, SMALL)
    assert res == ("ok",)
    t0 = time.monotonic()
    dest = receiver.call("expect", 2, DST, 1, TIMEOUT)
    sender.call("send", dest, SRC, b"seed", 0.25)
    _granted(link, 2)
    sender.kill()
    (failed,) = link.wait_for(receiver, lambda e: e[0] == "failed", TIMEOUT + SLACK + 5)
    assert failed[2] in ("timeout", "peer_dead"), failed
    assert time.monotonic() - t0 <= TIMEOUT + SLACK
    assert _released(link) == []  # the writer never said it stopped: hold until the lease
    (rel,) = link.wait_for(receiver, lambda e: e[0] == "released", LEASE + 5)
    assert rel[1:6] == (2, DST, 1, "failed", "lease_fenced")
    assert rel[6] - t0 >= LEASE - 0.05


@pytest.mark.slow
def test_frozen_receiver_times_out_the_sender(pair):
    sender, receiver = pair.local(), pair.remote()
    link, res = make_link(sender, receiver, BIG)
    assert res == ("ok",)
    dest = receiver.call("expect", 3, DST, 0, TIMEOUT)
    t0 = time.monotonic()
    sender.call("send", dest, SRC, b"seed", 0.3)
    _granted(link, 3)
    receiver.freeze()
    try:
        link.locals = [sender]
        (sent,) = link.wait_for(sender, lambda e: e[0] == "sent", TIMEOUT + SLACK + 5)
        assert sent[2:4] == ("failed", "timeout"), sent
        assert time.monotonic() - t0 <= TIMEOUT + SLACK
    finally:
        receiver.thaw()


@pytest.mark.slow
def test_frozen_sender_times_out_the_receiver_and_pages_wait_for_the_lease(pair):
    sender, receiver = pair.remote(), pair.local()
    link, res = make_link(sender, receiver, SMALL)
    assert res == ("ok",)
    t0 = time.monotonic()
    dest = receiver.call("expect", 4, DST, 2, TIMEOUT)
    sender.call("send", dest, SRC, b"seed", 0.25)
    _granted(link, 4)
    sender.freeze()
    receiver.call("abort", 4)  # abort while the writer is frozen: must not release early
    assert _released(link) == []
    (rel,) = link.wait_for(receiver, lambda e: e[0] == "released", LEASE + 5)
    assert rel[1:6] == (4, DST, 2, "aborted", "lease_fenced")
    assert rel[6] - t0 >= LEASE - 0.05
    sender.kill()


def test_abort_by_decode_mid_transfer_waits_for_the_writer(pair):
    sender, receiver = pair.worker, pair.local()
    link, res = make_link(sender, receiver, SMALL, seed=5)
    assert res == ("ok",)
    dest = receiver.call("expect", 5, DST, 3, 10.0)
    sender.call("send", dest, SRC, b"seed", 0.15)
    _granted(link, 5)
    time.sleep(0.4)  # a few layers landed, more are coming
    receiver.call("abort", 5)
    (rel,) = link.wait_for(receiver, lambda e: e[0] == "released", 10)
    assert rel[1:6] == (5, DST, 3, "aborted", "writer_final")
    before = receiver.call("digest", DST)
    time.sleep(0.5)
    link.pump()
    assert receiver.call("digest", DST) == before  # nothing lands after the release
    (sent,) = link.wait_for(sender, lambda e: e[0] == "sent", 10)
    assert sent[1:4] == (5, "aborted", "aborted")


def test_abort_by_decode_before_the_writer_starts(pair):
    sender, receiver = pair.worker, pair.local()
    link, res = make_link(sender, receiver, SMALL)
    assert res == ("ok",)
    dest = receiver.call("expect", 6, DST, 4, 10.0)
    receiver.call("abort", 6)  # nobody was granted: released at once
    (rel,) = link.wait_for(receiver, lambda e: e[0] == "released", 5)
    assert rel[1:6] == (6, DST, 4, "aborted", "never_granted")
    sender.call("send", dest, SRC, b"seed")  # a late writer is refused, never writes
    (sent,) = link.wait_for(sender, lambda e: e[0] == "sent", 10)
    assert sent[1:4] == (6, "failed", "refused")
    assert receiver.call("verify", 1, (), DST) == (0, 0)  # every page still untouched


def test_abort_by_prefill_mid_transfer(pair):
    sender, receiver = pair.local(), pair.worker
    link, res = make_link(sender, receiver, SMALL)
    assert res == ("ok",)
    dest = receiver.call("expect", 7, DST, 5, 10.0)
    sender.call("send", dest, SRC, b"seed", 0.15)
    _granted(link, 7)
    time.sleep(0.3)
    sender.call("abort", 7)
    (failed,) = link.wait_for(receiver, lambda e: e[0] == "failed", 10)
    assert failed[1:3] == (7, "aborted")
    (rel,) = link.wait_for(receiver, lambda e: e[0] == "released", 10)
    assert rel[1:6] == (7, DST, 5, "aborted", "writer_final")


@pytest.mark.slow
def test_mixed_run_returns_every_page_and_slot_exactly_once(pair):
    """Decode in the worker; four prefill endpoints here: clean, corrupt seed, lost completion
    notification, failing writes. Two waves, so pages freed by wave 1 are reused by wave 2."""
    spec = LayoutSpec(groups=(("target", 3, 512), ("draft", 1, 256)), num_pages=49, aux_slots=6)
    receiver = pair.worker
    kinds = {"clean": None, "corrupt": (1.0, "corrupt_aux", 0, 0.0),
             "drop": (1.0, "drop_notification", 0, 0.0), "fail": (1.0, "fail_transfer", 0, 0.0)}
    info = receiver.call("make_receiver", spec, compat_wire(), CFG)
    senders = {}
    for name, fault in kinds.items():
        s = pair.local()
        s.call("make_sender", spec, compat_wire(), CFG, 9, fault)
        assert s.call("connect", info, 30.0) == ("ok",)
        senders[name] = s
    free_pages, free_slots = list(range(1, 49)), list(range(6))  # page 0 reserved, like KVPool
    held: dict[int, tuple] = {}
    plan = ["clean", "corrupt", "drop", "fail", "abort_decode", "abort_prefill"]
    expected = {"clean": "done", "corrupt": "failed", "drop": "failed", "fail": "failed",
                "abort_decode": "aborted", "abort_prefill": "aborted"}
    released: list[tuple] = []
    outcomes = {}

    def pump():
        for s in senders.values():
            s.step()
        for e in receiver.call("take_events"):
            if e[0] == "released":
                released.append(e)
                room, pages, slot = e[1], e[2], e[3]
                assert held.pop(room) == (pages, slot), "released twice or foreign"
                free_pages.extend(pages)
                free_slots.append(slot)
                outcomes[room] = e[4]

    room = 1000
    for wave in range(2):
        for what in plan:
            room += 1
            pages = tuple(free_pages.pop(0) for _ in range(8))
            slot = free_slots.pop(0)
            held[room] = (pages, slot)
            dest = receiver.call("expect", room, pages, slot, TIMEOUT)
            s = senders[what if what in kinds else "clean"]
            s.call("send", dest, tuple(range(2 + wave, 8 + wave)), b"x" * 16,
                   0.1 if what.startswith("abort") else 0.0)
            if what == "abort_decode":
                receiver.call("abort", room)
            elif what == "abort_prefill":
                s.call("abort", room)
            expected[room] = expected[what]
        end = time.monotonic() + LEASE + 10
        while held and time.monotonic() < end:
            pump()
            time.sleep(0.002)
        assert not held, f"not released: {sorted(held)}"
    assert sorted(free_pages) == list(range(1, 49)) and sorted(free_slots) == list(range(6))
    assert len(released) == len({e[1] for e in released}) == 12
    assert {r: outcomes[r] for r in outcomes} == {r: expected[r] for r in outcomes}
