"""Contract: an aborted room's pages come back promptly on every backend, whichever side aborts
first or alone, and never while a write of it can still land. Decode runs in the worker
process, prefill here.

Deadlines are long here (transfer 20 s, lease 40 s): a release that waited for either would
miss PROMPT_S by far."""

from __future__ import annotations

import time

import pytest
from kvt_harness import LayoutSpec, config_wire
from kvt_runners import make_link

pytestmark = pytest.mark.timeout(120)

CFG = config_wire(timeout_s=20.0, drain_timeout_s=10.0, lease_margin_s=20.0)
PROMPT_S = 2.0  # "promptly", with slack for a loaded 2-core machine and process hops
SPEC = LayoutSpec(groups=(("target", 8, 4096), ("draft", 1, 4096)), num_pages=64)
SRC, DST = tuple(range(0, 24)), tuple(range(30, 54))

# reserved: decode reserved, prefill never began; granted: GO, no write yet (its first layer is
# 30 s away); mid_write: layers leaving every 0.1 s; done: landed before the aborts.
POINTS = ["reserved", "granted", "mid_write", "done"]
ORDERS = ["prefill", "decode", "prefill_then_decode", "decode_then_prefill"]


def _released(link, room):
    return [e for e in link.events(link.r) if e[0] == "released" and e[1] == room]


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("point", POINTS)
def test_aborted_room_is_released_promptly_never_early(pair, point, order):
    sender, receiver = pair.local(), pair.worker
    link, res = make_link(sender, receiver, SPEC, seed=3, config=CFG)
    assert res == ("ok",)
    room = 40 + POINTS.index(point) * len(ORDERS) + ORDERS.index(order)
    dest = receiver.call("expect", room, DST, 2, CFG["timeout_s"])
    if point != "reserved":
        per_layer = {"granted": 30.0, "mid_write": 0.1, "done": 0.0}[point]
        sender.call("send", dest, SRC, b"seed", per_layer)
    if point in ("granted", "mid_write"):
        link.wait_state(receiver, room, ("transferring",), 15)
    if point == "mid_write":
        time.sleep(0.35)  # a few layers landed, more are on their way
        link.pump()
    if point == "done":
        link.wait_for(receiver, lambda e: e[0] == "received" and e[1] == room, 15)

    def abort(side: str) -> None:
        if side == "decode":
            receiver.call("abort", room)
        elif point == "reserved":
            sender.call("decline", dest)
        else:
            sender.call("abort", room)

    sides = order.split("_then_")
    abort(sides[0])
    link.pump()
    if len(sides) > 1:
        time.sleep(0.02)
        link.pump()
        abort(sides[1])
    t0 = time.monotonic()
    (rel,) = link.wait_for(receiver, lambda e: e[0] == "released" and e[1] == room, PROMPT_S)
    assert rel[2] == DST
    if point == "done":
        assert rel[4:6] == ("done", "done")
        return
    assert rel[6] - t0 < PROMPT_S
    if rel[4] == "done":  # the last writes were posted already: the room landed whole
        assert any(e[0] == "received" and e[1] == room for e in link.events(receiver))
    else:
        assert rel[4:6] in (("aborted", "never_granted"), ("aborted", "writer_final")), rel
    before = receiver.call("digest", DST)
    end = time.monotonic() + 0.5
    while time.monotonic() < end:
        link.pump()
        time.sleep(0.005)
    assert receiver.call("digest", DST) == before  # nothing lands after the release
    assert len(_released(link, room)) == 1
