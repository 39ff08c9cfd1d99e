"""Aborts over the in-process fake backend: wherever a room is when either side (or both, in
either order) gives up, decode's claim comes back within a second -- not at the transfer
deadline or the lease -- and never while a write of the room can still land.

Deadlines are production's (transfer 30 s, lease 75 s), so "promptly" cannot be the deadline.
Writes take WRITE_S to land; with `cancellable=False` a posted write cannot be cancelled (as
Mooncake's submitted entries, or a NIXL transfer whose release fails): the sender must wait for
it before its final word, and decode must wait for that word."""

from __future__ import annotations

import ctypes
import random
import threading
import time

import pytest

from tandem.kvtransfer import (AuxRegion, BackendOptions, CompatInfo, DecodeReceiver,
                               EndpointConfig, ErrorKind, KVLayout, KVRegion, PrefillSender,
                               Received, ReceiveFailed, TransferError, TransferState)
from tandem.kvtransfer.backends.fake import FakeFabric

COMPAT = CompatInfo(model="m", dtype="bf16", page_size=16, kv_layout="NHD", tp_size=1, tp_rank=0,
                    draft_model="d", draft_hidden_size=64, topk=1, feature_layers=(3,))
CFG = EndpointConfig(timeout_s=30.0, drain_timeout_s=35.0, lease_margin_s=45.0,
                     poll_sleep_s=0.0002)
WRITE_S = 0.15  # a write lands this long after it was posted
PROMPT_S = 1.0  # "promptly": well under the transfer deadline (30 s) and the lease (75 s)
GROUPS = (("target", 4, 128), ("draft", 1, 64))
NUM_PAGES = 32
SRC, DST = (10, 11, 12), (3, 4, 5)


class Mem:
    def __init__(self, seed: int | None = None):
        self.bufs, regions = [], []
        for name, layers, pb in GROUPS:
            buf = ctypes.create_string_buffer(layers * NUM_PAGES * pb)
            if seed is not None:
                ctypes.memmove(buf, random.Random(f"{seed}{name}").randbytes(len(buf)), len(buf))
            self.bufs.append(buf)
            regions.append(KVRegion(name=name, base_ptr=ctypes.addressof(buf), num_layers=layers,
                                    num_pages=NUM_PAGES, page_bytes=pb))
        self.aux = ctypes.create_string_buffer(4 * 128)
        self.layout = KVLayout(regions=tuple(regions), aux=AuxRegion(
            base_ptr=ctypes.addressof(self.aux), num_slots=4, slot_bytes=128))

    def digest(self) -> bytes:
        return b"".join(b.raw for b in self.bufs)


class Ends:
    """A connected sender/receiver pair; `released[room]` = (Release, digest of decode's memory
    when it was released, monotonic time)."""

    def __init__(self, cancellable: bool):
        opts = BackendOptions(fabric=FakeFabric(write_latency_s=WRITE_S))
        self.smem, self.rmem = Mem(seed=1), Mem()
        self.released: dict[int, tuple] = {}
        self.events: list = []
        self.rx = DecodeReceiver("fake", self.rmem.layout, COMPAT, release=self._on_release,
                                 config=CFG, options=opts)
        self.tx = PrefillSender("fake", self.smem.layout, COMPAT, config=CFG, options=opts)
        t = threading.Thread(target=self.tx.connect, args=(self.rx.info(),))
        t.start()
        while t.is_alive():
            self.rx.poll()
            time.sleep(0.0005)
        if not cancellable:  # posted writes always complete (their bytes land)
            self.tx.backend.cancel_write = lambda handle: False

    def _on_release(self, rel) -> None:
        assert rel.room not in self.released, "released twice"
        self.released[rel.room] = (rel, self.rmem.digest(), time.monotonic())

    def pump(self, until=lambda: False, timeout_s: float = PROMPT_S) -> None:
        end = time.monotonic() + timeout_s
        while not until() and time.monotonic() < end:
            self.events.extend(self.rx.poll())
            self.tx.poll()
            time.sleep(0.0005)

    def close(self) -> None:
        self.tx.close()
        self.rx.close()


@pytest.fixture(params=[True, False], ids=["cancellable", "uncancellable"])
def ends(request):
    e = Ends(cancellable=request.param)
    yield e
    e.close()


# Where the room is when the aborts come (each step runs on top of the previous ones).
POINTS = ["reserved", "begun", "granted", "go_seen", "mid_write", "final_posted", "done"]
# Who aborts, in which order ("decode" alone: decode's own abort or deadline; "prefill" alone:
# the prefill side ended the room and decode was never told).
ORDERS = ["prefill", "decode", "prefill_then_decode", "decode_then_prefill"]


def _reach(e: Ends, room: int, point: str):
    dest = e.rx.expect(room, DST, 1)
    if point == "reserved":  # prefill knows the destination, nothing began
        return dest
    e.tx.start(dest, SRC)  # BEGIN sent; decode has not answered
    if point == "begun":
        return dest
    e.rx.poll()  # GO sent; the sender has not seen it
    if point == "granted":
        return dest
    e.pump(lambda: e.tx.state(room) is TransferState.TRANSFERRING)
    if point == "go_seen":  # granted, no write posted
        return dest
    for name, layers, _ in GROUPS:
        e.tx.push_layers(room, name, range(layers))  # page writes in flight (WRITE_S)
    if point == "mid_write":
        return dest
    e.tx.finish(room, b"seed")  # the aux write carrying FINAL(done) is posted too
    if point == "final_posted":
        return dest
    e.pump(lambda: room in e.released and e.tx.state(room).terminal)
    assert e.released[room][0].outcome is TransferState.DONE
    return dest


def _abort(e: Ends, side: str, dest, begun: bool) -> None:
    if side == "decode":
        e.rx.abort(dest.room)
    elif begun:  # what the prefill worker calls: abort a room it began, else decline it
        e.tx.abort(dest.room)
    else:
        e.tx.decline([dest])


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("point", POINTS)
def test_aborted_room_comes_back_promptly_and_never_early(ends, point, order):
    e, room = ends, 7
    dest = _reach(e, room, point)
    done_before = room in e.released
    sides = order.split("_then_")
    _abort(e, sides[0], dest, point != "reserved")
    e.pump(timeout_s=0.02)  # the first abort travels before the second one
    if len(sides) > 1:
        _abort(e, sides[1], dest, point != "reserved")
    t_abort = time.monotonic()
    e.pump(lambda: room in e.released)
    assert room in e.released, f"{point}/{order}: decode still holds the room " \
                               f"({e.rx.state(room)}): it would wait for the deadline or lease"
    rel, digest, t_rel = e.released[room]
    if done_before:  # the KV had landed: the aborts change nothing (no second release)
        assert rel.outcome is TransferState.DONE
        return
    assert t_rel - t_abort < PROMPT_S
    if rel.outcome is TransferState.DONE:  # everything was posted and could not be cancelled:
        assert [ev.room for ev in e.events if isinstance(ev, Received)] == [room]  # it landed
    else:
        assert rel.outcome is TransferState.ABORTED and rel.reason in ("never_granted",
                                                                        "writer_final")
    # Never early: nothing lands in decode's memory after the release (a write still in
    # flight would, once its latency passed).
    e.pump(timeout_s=2 * WRITE_S)
    assert e.rmem.digest() == digest
    if point != "reserved":  # (a room never begun is unknown to the sender)
        e.pump(lambda: e.tx.state(room).terminal)
        assert e.tx.state(room) in (TransferState.ABORTED, TransferState.FAILED)


def test_prefill_decline_releases_a_claim_nobody_began_at_once(ends):
    """A room the prefill side ends before starting its transfer (aborted while its forward
    was queued or running): decode's claim goes back at once, reported as aborted, instead of
    at the transfer deadline (30 s)."""
    e = ends
    dest = e.rx.expect(8, DST, 2)
    e.tx.decline([dest], "aborted by prefill")
    e.pump(lambda: 8 in e.released)
    assert e.released[8][0].reason == "never_granted"
    (failed,) = [ev for ev in e.events if isinstance(ev, ReceiveFailed)]
    assert failed.room == 8 and failed.error.kind is ErrorKind.ABORTED
    digest = e.rmem.digest()
    e.tx.send(dest, SRC, b"seed")  # a late writer is refused and writes nothing
    e.pump(lambda: e.tx.state(8).terminal)
    with pytest.raises(TransferError, match="unknown room"):
        e.tx.wait(8)
    e.pump(timeout_s=2 * WRITE_S)
    assert e.rmem.digest() == digest


def test_a_decline_for_another_session_or_a_granted_room_is_ignored(ends):
    """Only this decode session's rooms that nobody was granted: a decline naming an old
    session, or coming for a room another writer holds, changes nothing."""
    from dataclasses import replace

    e = ends
    dest = e.rx.expect(9, DST, 0)
    e.tx.decline([replace(dest, receiver_session=dest.receiver_session ^ 1)])  # not ours
    e.pump(timeout_s=0.1)
    assert 9 not in e.released and e.rx.state(9) is TransferState.RESERVED
    e.tx.send(dest, SRC, b"seed")
    e.pump(lambda: 9 in e.released)
    assert e.released[9][0].outcome is TransferState.DONE


def test_completion_that_overtakes_its_page_writes_after_an_abort_waits_for_them():
    """Where the aux write's notification (FINAL(done)) can arrive before the page writes' DATA
    (separate transfers: NIXL), an abort by decode must not take that FINAL(done) for the
    writer's final word while page writes are still in flight: the pages would go back and
    then be written."""
    e = Ends(cancellable=False)
    try:
        post_write = e.tx.backend.post_write

        def aux_lands_first(peer_id, batch, notify):
            handle = post_write(peer_id, batch, notify)
            if notify is not None and '"t":"final"' in notify:
                handle.due = 0.0  # the completion overtakes the page writes
            return handle

        e.tx.backend.post_write = aux_lands_first
        dest = e.rx.expect(11, DST, 3)
        e.tx.start(dest, SRC)
        e.pump(lambda: e.tx.state(11) is TransferState.TRANSFERRING)
        for name, layers, _ in GROUPS:
            e.tx.push_layers(11, name, range(layers))
        e.tx.finish(11, b"seed")  # page writes land in WRITE_S, the aux write at once
        e.rx.abort(11)
        e.pump(lambda: 11 in e.released, timeout_s=2.0)
        rel, digest, _ = e.released[11]
        assert rel.outcome is TransferState.ABORTED
        e.pump(timeout_s=2 * WRITE_S)
        assert e.rmem.digest() == digest, "a page write landed after decode released the room"
        assert not [ev for ev in e.events if isinstance(ev, Received)]
    finally:
        e.close()


def test_a_denied_writer_s_final_word_fails_the_room_at_once(ends):
    """Decode denies a BEGIN it cannot serve (here: more pages than it reserved); the writer's
    FINAL(refused) then ends the room -- no writer was ever granted -- instead of decode
    holding the pages to the transfer deadline for a writer that will not come back."""
    from dataclasses import replace

    e = ends
    dest = e.rx.expect(12, DST[:2], 0)
    e.tx.send(replace(dest, page_ids=DST), SRC, b"seed")  # announces 3 pages, 2 reserved
    e.pump(lambda: 12 in e.released)
    rel = e.released[12][0]
    assert (rel.outcome, rel.reason) == (TransferState.FAILED, "never_granted")
    (failed,) = [ev for ev in e.events if isinstance(ev, ReceiveFailed)]
    assert failed.error.kind is ErrorKind.REFUSED
