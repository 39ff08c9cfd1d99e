"""PrefillSender / DecodeReceiver over the in-process fake backend: API misuse errors, the
completion gate (no FINAL before every layer), grants, deadline faults, layer-wise helper."""

from __future__ import annotations

import ctypes
import random
import threading
import time

import pytest

from tandem.kvtransfer import (AuxRegion, BackendOptions, CompatInfo, DecodeReceiver,
                               EndpointConfig, ErrorKind, FailureInjection, FaultKind, KVLayout,
                               KVRegion, PrefillSender, Received, ReceiveFailed, TransferError,
                               TransferState, compare_push_modes)
from tandem.kvtransfer.backends.fake import FakeFabric

COMPAT = CompatInfo(model="m", dtype="bf16", page_size=16, kv_layout="NHD", tp_size=1, tp_rank=0,
                    draft_model="d", draft_hidden_size=64, topk=1, feature_layers=(3,))
CFG = EndpointConfig(handshake_timeout_s=5, timeout_s=1.0, drain_timeout_s=0.3,
                     lease_margin_s=0.5, poll_sleep_s=0.0002)


class Mem:
    def __init__(self, groups=(("target", 4, 128), ("draft", 1, 64)), num_pages=32, seed=None):
        self.bufs, regions = [], []
        for name, layers, pb in groups:
            buf = ctypes.create_string_buffer(layers * num_pages * pb)
            if seed is not None:
                ctypes.memmove(buf, random.Random(f"{seed}{name}").randbytes(len(buf)), len(buf))
            self.bufs.append(buf)
            regions.append(KVRegion(name=name, base_ptr=ctypes.addressof(buf), num_layers=layers,
                                    num_pages=num_pages, page_bytes=pb))
        self.aux = ctypes.create_string_buffer(4 * 128)
        self.layout = KVLayout(regions=tuple(regions), aux=AuxRegion(
            base_ptr=ctypes.addressof(self.aux), num_slots=4, slot_bytes=128))


def _assert_landed(smem: Mem, rmem: Mem, src_pages, dst_pages) -> None:
    """Every layer of both groups: source page src_pages[i] equals decode page dst_pages[i]."""
    for buf_s, buf_r, pb, layers in ((smem.bufs[0], rmem.bufs[0], 128, 4),
                                     (smem.bufs[1], rmem.bufs[1], 64, 1)):
        for layer in range(layers):
            for s, d in zip(src_pages, dst_pages):
                so, do = (layer * 32 + s) * pb, (layer * 32 + d) * pb
                assert buf_s.raw[so : so + pb] == buf_r.raw[do : do + pb], (pb, layer, s, d)


@pytest.fixture
def ends():
    """(sender, receiver, released list, pump); connected over a private fabric."""
    opts = BackendOptions(fabric=FakeFabric())
    released = []
    smem, rmem = Mem(seed=1), Mem()
    rx = DecodeReceiver("fake", rmem.layout, COMPAT, release=released.append, config=CFG,
                        options=opts)
    tx = PrefillSender("fake", smem.layout, COMPAT, config=CFG, options=opts)
    events = []

    def pump(until, timeout=5.0):
        end = time.monotonic() + timeout
        while not until():
            events.extend(rx.poll())
            tx.poll()
            assert time.monotonic() < end, "condition not reached"
            time.sleep(0.0005)

    _connect(tx, rx)
    yield tx, rx, released, pump, events, (smem, rmem)
    tx.close()
    rx.close()


def _connect(tx, rx):
    t = threading.Thread(target=tx.connect, args=(rx.info(),))
    t.start()
    while t.is_alive():
        rx.poll()
        time.sleep(0.0005)


def test_round_trip_and_metrics(ends):
    tx, rx, released, pump, events, (smem, rmem) = ends
    dest = rx.expect(1, [3, 4, 5], 2)
    tx.send(dest, [10, 11, 12], b"seed")
    pump(lambda: events)
    assert events == [Received(room=1, page_ids=(3, 4, 5), aux_payload=b"seed")]
    assert tx.state(1) is TransferState.DONE
    tx.wait(1)
    assert [r.outcome for r in released] == [TransferState.DONE]
    _assert_landed(smem, rmem, (10, 11, 12), (3, 4, 5))
    assert rx.metrics().num_done == 1 and tx.metrics().bytes_moved == rx.metrics().bytes_moved


def test_completion_waits_for_every_layer(ends):
    tx, rx, released, pump, events, _ = ends
    dest = rx.expect(2, [1, 2], 0)
    tx.start(dest, [1, 2])
    tx.push_layers(2, "target", range(0, 2))
    tx.finish(2, b"s")  # seed staged early: FINAL must still wait for the missing layers
    pump(lambda: rx.state(2) is TransferState.TRANSFERRING)
    for _ in range(50):
        events.extend(rx.poll())
        tx.poll()
    assert events == [] and tx.state(2) is TransferState.TRANSFERRING
    tx.push_layers(2, "target", range(2, 4))
    tx.push_layers(2, "draft", range(1))
    pump(lambda: events)
    assert isinstance(events[0], Received)


def test_api_misuse_is_invalid(ends):
    tx, rx, _, pump, _, _ = ends
    dest = rx.expect(3, [1, 2], 1)
    tx.start(dest, [5])
    tx.push_layers(3, "target", range(2))
    for call, needle in [(lambda: tx.push_layers(3, "target", range(1, 3)), "pushed twice"),
                         (lambda: tx.push_layers(3, "lm_head", range(1)), "unknown layer group"),
                         (lambda: tx.push_layers(3, "target", range(3, 9)), "outside"),
                         (lambda: tx.finish(3, b"x" * 200), "does not fit"),
                         (lambda: tx.start(dest, [5]), "already being sent"),
                         (lambda: tx.push_layers(99, "target", range(1)), "unknown room")]:
        with pytest.raises(TransferError, match=needle) as e:
            call()
        assert e.value.kind is ErrorKind.INVALID
    with pytest.raises(TransferError, match="still held") as e:
        rx.expect(4, [2, 9], 3)  # page 2 belongs to room 3 until released
    with pytest.raises(TransferError, match="out of range"):
        rx.expect(5, [1000], 0)


def test_start_needs_a_connected_session():
    opts = BackendOptions(fabric=FakeFabric())
    tx = PrefillSender("fake", Mem().layout, COMPAT, config=CFG, options=opts)
    from tandem.kvtransfer import Destination

    dest = Destination(receiver_session=123, room=1, page_ids=(1,), aux_slot=0, timeout_s=1)
    with pytest.raises(TransferError, match="connect\\(\\) first") as e:
        tx.start(dest, [1])
    assert e.value.kind is ErrorKind.HANDSHAKE


def test_more_pages_than_reserved_is_refused(ends):
    tx, rx, _, _, _, _ = ends
    dest = rx.expect(6, [1, 2], 0)
    with pytest.raises(TransferError, match="reserved only 2"):
        tx.start(dest, [1, 2, 3])


def test_delay_fault_ends_in_timeout_on_both_sides():
    opts = BackendOptions(fabric=FakeFabric())
    released, events = [], []
    rx = DecodeReceiver("fake", Mem().layout, COMPAT, release=released.append, config=CFG,
                        options=opts)
    tx = PrefillSender("fake", Mem(seed=2).layout, COMPAT, config=CFG, options=opts,
                       faults=FailureInjection(probability=1.0, kind=FaultKind.DELAY, delay_s=5.0))
    _connect(tx, rx)
    t0 = time.monotonic()
    tx.send(rx.expect(7, [1], 0), [1], b"s")
    with pytest.raises(TransferError) as e:
        while True:
            events.extend(rx.poll())
            tx.wait(7, timeout_s=0.01) if tx.state(7).terminal else tx.poll()
    assert e.value.kind in (ErrorKind.TIMEOUT, ErrorKind.ABORTED)
    assert time.monotonic() - t0 < CFG.timeout_s + 0.5
    end = time.monotonic() + 3
    while not released and time.monotonic() < end:
        events.extend(rx.poll())
        tx.poll()
    assert [type(e) for e in events] == [ReceiveFailed] and len(released) == 1
    assert released[0].reason == "writer_final"  # delayed writer never wrote: it said so


def test_layerwise_helper_reports_both_modes(ends):
    tx, rx, _, pump, events, (smem, _) = ends
    rooms = iter(range(2))
    after, layered = compare_push_modes(  # distinct pages/slot per room: decode may lag behind
        tx, smem.layout, lambda: (lambda i: rx.expect(100 + i, range(8 * i, 8 * i + 8), i))(
            next(rooms)), list(range(8)),
        b"seed", compute_s_per_layer=0.01, pump=lambda: events.extend(rx.poll()))
    assert (after.mode, layered.mode) == ("after_compute", "layerwise")
    for t in (after, layered):
        assert t.compute_s == pytest.approx(0.05) and t.total_s >= t.compute_s
    pump(lambda: sum(isinstance(e, Received) for e in events) == 2)


def test_final_does_not_wait_for_page_writes_and_decode_waits_for_their_data(ends):
    """notify_per_write (fake, NIXL): every page write carries DATA, the aux write with
    FINAL(done, count) is posted while page writes are still in flight, and decode completes
    the room only once every counted DATA arrived -- here FINAL lands first and the page
    writes are held back: nothing is Received until they land, then the bytes are exact."""
    tx, rx, released, pump, events, (smem, rmem) = ends
    assert tx.backend.notify_per_write
    posted, hold = [], {"pages": True}
    post, poll = tx.backend.post_write, tx.backend.poll_write

    def post_write(peer, batch, notify):
        h = post(peer, batch, notify)
        posted.append((h, notify))
        return h

    def poll_write(h):
        kind = next(n for x, n in posted if x is h)
        if hold["pages"] and kind and '"t":"data"' in kind:
            return _pending()
        return poll(h)

    tx.backend.post_write, tx.backend.poll_write = post_write, poll_write
    dest = rx.expect(5, [6, 7], 1)
    tx.send(dest, [1, 2], b"seed5")
    pump(lambda: any(n and '"t":"final"' in n for _, n in posted))
    finals = [n for _, n in posted if n and '"t":"final"' in n]
    data = [n for _, n in posted if n and '"t":"data"' in n]
    assert len(finals) == 1 and len(data) >= 1 and f'"count":{len(data)}' in finals[0]
    for _ in range(100):  # FINAL has landed, the page writes have not: no completion
        events.extend(rx.poll())
        tx.poll()
    assert events == [] and rx.state(5) is TransferState.TRANSFERRING
    assert tx.state(5) is TransferState.TRANSFERRING  # DONE needs every write completed
    hold["pages"] = False
    pump(lambda: events)
    assert events == [Received(room=5, page_ids=(6, 7), aux_payload=b"seed5")]
    pump(lambda: tx.state(5) is TransferState.DONE)
    _assert_landed(smem, rmem, (1, 2), (6, 7))


def _pending():
    from tandem.kvtransfer.backend import WritePoll, WriteStatus

    return WritePoll(WriteStatus.PENDING)


def test_data_bytes_that_do_not_add_up_fail_the_room(ends):
    tx, rx, released, pump, events, _ = ends
    post = tx.backend.post_write

    def post_write(peer, batch, notify):  # one page write misreports its bytes
        if notify and '"t":"data"' in notify and not getattr(post_write, "done", False):
            post_write.done = True
            notify = notify.replace('"nbytes":', '"nbytes":1')
        return post(peer, batch, notify)

    tx.backend.post_write = post_write
    dest = rx.expect(8, [2, 3], 0)
    tx.send(dest, [4, 5], b"s")
    pump(lambda: events)
    assert isinstance(events[0], ReceiveFailed) and events[0].error.kind is ErrorKind.CORRUPT
    assert "notifications" in str(events[0].error)


def test_writes_built_before_go_are_posted_once_or_dropped(ends):
    """start() builds a room's writes ahead on backends with prepare_write: a push of whole
    groups posts them (and the aux write carrying FINAL); a push of part of a group, an abort
    before GO, or a room that runs out of staging slots falls back without losing any, and
    every staging slot comes back."""
    tx, rx, released, pump, events, (smem, rmem) = ends
    be = tx.backend
    # whole pushes: one built write per group, plus the aux write; all posted, none dropped
    tx.send(rx.expect(1, [3, 4, 5], 0), [10, 11, 12], b"seed")
    pump(lambda: events)
    assert events == [Received(room=1, page_ids=(3, 4, 5), aux_payload=b"seed")]
    assert (be.num_prepared, be.num_prepared_posts, be.num_prepared_dropped) == (3, 3, 0)
    # target layer by layer: its built write and the built aux write are dropped at its first
    # partial push (the draft's still fits its whole push), the data still lands exactly and
    # FINAL counts what was really posted
    events.clear()
    tx.start(rx.expect(2, [6, 7], 1), [20, 21])
    tx.push_layers(2, "target", range(0, 2))
    assert (be.num_prepared, be.num_prepared_dropped) == (6, 2)
    tx.push_layers(2, "target", range(2, 4))
    tx.push_layers(2, "draft", range(1))
    tx.finish(2, b"s2")
    pump(lambda: events)
    assert events == [Received(room=2, page_ids=(6, 7), aux_payload=b"s2")]
    _assert_landed(smem, rmem, (20, 21), (6, 7))
    # an abort before GO releases what was built, staging slot included
    tx.start(rx.expect(3, [8], 2), [1])
    tx.abort(3)
    pump(lambda: tx.state(3).terminal and 3 not in tx._rooms
         and any(r.room == 3 for r in released))  # decode's aux slot 2 is free again
    assert (be.num_prepared, be.num_prepared_dropped) == (9, 5)
    assert sorted(tx._free_staging) == [0, 1, 2, 3]
    # four rooms, four staging slots: the last room finds one slot free and builds no aux
    # write (the plain path keeps that one); all four complete
    events.clear()
    rooms = {10 + i: [12 + i] for i in range(4)}
    for room, pages in rooms.items():
        tx.start(rx.expect(room, pages, room % 4), [room])
    assert [s.ready_final is not None
            for r in rooms for s in tx._rooms[r].legs] == [True, True, True, False]
    for room in rooms:
        for region in smem.layout.regions:
            tx.push_layers(room, region.name, range(region.num_layers))
        tx.finish(room, b"r%d" % room)
    pump(lambda: len(events) == 4)
    assert sorted(e.room for e in events if isinstance(e, Received)) == sorted(rooms)
    assert be.num_prepared == 9 + 4 * 2 + 3 and be.num_prepared_dropped == 5
    assert be.num_prepared_posts == be.num_prepared - be.num_prepared_dropped
    pump(lambda: not tx._rooms)
    assert sorted(tx._free_staging) == [0, 1, 2, 3]


def test_layer_by_layer_start_builds_nothing_ahead(ends):
    """start(whole_groups=False) (layer-wise push) builds no write ahead: each partial push
    would only drop them again."""
    tx, rx, _, pump, events, _ = ends
    tx.start(rx.expect(1, [3, 4], 0), [5, 6], whole_groups=False)
    assert tx.backend.num_prepared == 0
    for layer in range(4):
        tx.push_layers(1, "target", range(layer, layer + 1))
    tx.push_layers(1, "draft", range(1))
    tx.finish(1, b"lw")
    pump(lambda: events)
    assert events == [Received(room=1, page_ids=(3, 4), aux_payload=b"lw")]
    assert tx.backend.num_prepared == tx.backend.num_prepared_dropped == 0


def test_a_partial_push_keeps_the_built_writes_already_queued(ends):
    """One group pushed whole before GO (its built writes queued), then another layer by layer:
    the partial push gives up only what no longer fits (that group's built writes, the built
    aux write); the writes already queued still go, so every page of both groups lands."""
    tx, rx, _, pump, events, (smem, rmem) = ends
    tx.start(rx.expect(1, [3, 4], 0), [5, 6])
    tx.push_layers(1, "draft", range(1))  # before GO: queued
    tx.push_layers(1, "target", range(0, 2))
    tx.push_layers(1, "target", range(2, 4))
    tx.finish(1, b"mix")
    pump(lambda: events)
    assert events == [Received(room=1, page_ids=(3, 4), aux_payload=b"mix")]
    _assert_landed(smem, rmem, (5, 6), (3, 4))
    be = tx.backend
    assert be.num_prepared_posts == 1  # the draft's built write
    assert be.num_prepared_dropped == be.num_prepared - 1
    pump(lambda: not tx._rooms)
    assert sorted(tx._free_staging) == [0, 1, 2, 3]
