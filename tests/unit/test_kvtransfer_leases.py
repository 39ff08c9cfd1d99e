"""ReceiveTable: pages/slots come back exactly once, and never while a granted writer may still
write (docs/architecture.md, "No leaks"). Pure bookkeeping with a fake clock."""

from __future__ import annotations

import random

import pytest

from tandem.kvtransfer import ErrorKind, ReceiveTable, TransferError, TransferState

S = TransferState


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


@pytest.fixture
def env():
    clock, released = Clock(), []
    table = ReceiveTable(released.append, clock=clock)
    return table, clock, released


def _err(kind=ErrorKind.TIMEOUT):
    return TransferError(kind, "x")


def _reserve(table, room, pages=(1, 2), slot=0):
    table.reserve(room, pages, slot, timeout_s=3.0, lease_margin_s=2.0)


def test_never_granted_abort_releases_at_once(env):
    table, _, released = env
    _reserve(table, 1)
    assert table.fail(1, _err(ErrorKind.ABORTED)) is None
    assert [(r.room, r.outcome, r.reason) for r in released] == [(1, S.ABORTED, "never_granted")]
    assert 1 not in table and table.held_pages() == frozenset()


def test_abort_mid_transfer_holds_until_the_writer_says_it_stopped(env):
    table, _, released = env
    _reserve(table, 1)
    table.grant(1, "p0", 2)
    assert table.fail(1, _err(ErrorKind.ABORTED)) == "p0"  # tell the writer
    assert released == []  # the writer may still be writing
    assert not table.writer_final(1, "p1", None)  # another peer cannot release our pages
    assert released == []
    table.writer_final(1, "p0", None)
    assert [(r.room, r.page_ids, r.outcome, r.reason) for r in released] == [
        (1, (1, 2), S.ABORTED, "writer_final")]
    table.writer_final(1, "p0", None)  # late duplicate: no second release
    assert len(released) == 1


def test_deadline_then_lease_then_fence(env):
    table, clock, released = env
    _reserve(table, 1)
    table.grant(1, "p0", 2)
    clock.t += 2.9
    assert table.expired() == ([], [])
    clock.t += 0.2
    timed_out, lease = table.expired()
    assert timed_out == [1] and lease == []
    table.fail(1, _err())
    clock.t += 1.5
    assert table.expired() == ([], []) and released == []  # still inside the lease
    clock.t += 0.6
    _, lease = table.expired()
    assert [c.room for c in lease] == [1]
    assert table.fence("p0") == []  # already terminal: only released
    assert [(r.outcome, r.reason) for r in released] == [(S.FAILED, "lease_fenced")]


def test_fence_fails_live_rooms_of_that_writer(env):
    table, _, released = env
    _reserve(table, 1, pages=(1,), slot=0)
    _reserve(table, 2, pages=(2,), slot=1)
    _reserve(table, 3, pages=(3,), slot=2)
    table.grant(1, "p0", 1)
    table.grant(2, "p1", 1)
    table.grant(3, "p0", 1)
    assert table.fence("p0") == [1, 3]
    assert sorted((r.room, r.outcome, r.reason) for r in released) == [
        (1, S.FAILED, "lease_fenced"), (3, S.FAILED, "lease_fenced")]
    assert table.state(2) is S.TRANSFERRING


def test_done_releases_with_outcome_done(env):
    table, _, released = env
    _reserve(table, 1)
    table.grant(1, "p0", 1)
    table.complete(1)
    assert [(r.outcome, r.reason) for r in released] == [(S.DONE, "done")]


def test_writer_final_with_an_error_fails_a_live_room(env):
    table, _, released = env
    _reserve(table, 1)
    table.grant(1, "p0", 2)
    assert table.writer_final(1, "p0", TransferError(ErrorKind.BACKEND, "rc=-1"))
    assert table.state(1) is None and released[0].outcome is S.FAILED


def test_pages_and_slots_cannot_be_double_booked(env):
    table, _, released = env
    _reserve(table, 1, pages=(1, 2), slot=0)
    with pytest.raises(ValueError, match="still held"):
        _reserve(table, 2, pages=(2, 3), slot=1)
    with pytest.raises(ValueError, match="still held"):
        _reserve(table, 3, pages=(7,), slot=0)
    with pytest.raises(ValueError, match="already reserved"):
        _reserve(table, 1, pages=(9,), slot=3)
    table.fail(1, _err(ErrorKind.ABORTED))
    _reserve(table, 2, pages=(2, 3), slot=0)  # free again after the release


def test_illegal_transitions_are_bugs(env):
    table, _, _ = env
    _reserve(table, 1)
    with pytest.raises(Exception, match="reserved -> done"):
        table.complete(1)


def test_close_releases_everything(env):
    table, _, released = env
    _reserve(table, 1, pages=(1,), slot=0)
    _reserve(table, 2, pages=(2,), slot=1)
    table.grant(2, "p0", 1)
    table.close()
    assert sorted(r.room for r in released) == [1, 2] and len(table) == 0


@pytest.mark.parametrize("seed", range(20))
def test_random_histories_release_each_room_once_and_never_early(seed):
    """Random interleavings of reserve/grant/abort/fail/final/complete/deadline/fence: each room
    is released exactly once, and never while its granted writer has not stopped or been fenced."""
    rng = random.Random(seed)
    clock = Clock()
    free, released = list(range(40)), []
    writer_of: dict[int, str] = {}
    stopped: set[int] = set()  # rooms whose writer gave its final word
    fencing: set[str] = set()  # writers being fenced right now

    def on_release(r):
        w = writer_of.get(r.room)
        assert w is None or r.room in stopped or w in fencing or r.reason == "closed", r
        released.append(r.room)
        free.extend(r.page_ids)

    table = ReceiveTable(on_release, clock=clock)
    rooms = 0
    for _ in range(400):
        op, live = rng.random(), [r for r in range(rooms) if r in table]
        if op < 0.25 and len(free) >= 3:
            pages = [free.pop(rng.randrange(len(free))) for _ in range(3)]
            table.reserve(rooms, pages, rooms, timeout_s=rng.uniform(1, 3), lease_margin_s=2)
            rooms += 1
        elif op < 0.4 and live:
            r = rng.choice(live)
            if table.state(r) is S.RESERVED:
                writer_of[r] = rng.choice("abc")
                table.grant(r, writer_of[r], 3)
        elif op < 0.55 and live:
            r = rng.choice(live)
            if not table.state(r).terminal:
                table.fail(r, _err(rng.choice([ErrorKind.ABORTED, ErrorKind.TIMEOUT])))
        elif op < 0.7 and live:
            r = rng.choice(live)
            if r in writer_of:
                stopped.add(r)
                if table.state(r) is S.TRANSFERRING and rng.random() < 0.5:
                    table.complete(r)
                else:
                    table.writer_final(r, writer_of[r], _err(ErrorKind.BACKEND))
        elif op < 0.85:
            clock.t += rng.uniform(0, 1.5)
            timed_out, lease = table.expired()
            for r in timed_out:
                table.fail(r, _err())
            for c in lease:
                if c.room in table and c.writer:
                    fencing.add(c.writer)
                    table.fence(c.writer)
                    fencing.discard(c.writer)
    table.close()
    assert sorted(released) == list(range(rooms))  # every room exactly once
    assert sorted(free) == list(range(40))


def test_time_queued_for_prefill_is_not_transfer_time(env):
    """With reserve_wait_s, a reservation waits that long for its writer to begin (the request
    may sit in the prefill queue), and the transfer's own deadline counts from the grant;
    without it, from the reservation (the old rule, kept for deadline tests)."""
    table, clock, _ = env
    table.reserve(1, (1, 2), 0, timeout_s=3.0, lease_margin_s=2.0, reserve_wait_s=60.0)
    table.reserve(2, (3, 4), 1, timeout_s=3.0, lease_margin_s=2.0)  # no reserve wait
    clock.t += 10.0  # queued in prefill for 10 s
    timed_out, _ = table.expired()
    assert timed_out == [2]  # the old rule times the queued one out
    table.grant(1, "w", 2)
    clock.t += 2.9
    assert table.expired()[0] == [2]  # granted 2.9 s ago: within its 3 s
    clock.t += 0.2
    assert 1 in table.expired()[0]  # 3.1 s after the grant
    table.reserve(3, (5, 6), 2, timeout_s=3.0, lease_margin_s=2.0, reserve_wait_s=60.0)
    clock.t += 60.5
    assert 3 in table.expired()[0]  # nobody began within the reserve wait
