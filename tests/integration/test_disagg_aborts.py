"""Aborted requests between an in-process PrefillWorker and DecodeWorker (fake backend, stepped
by hand, as their loops do): wherever the request is when it is aborted -- queued, mid-forward,
waiting for its route, handed off, granted, mid-write, landed, finished by its first token --
and whichever side hears of it first (or alone), decode's pages are all free within a second,
and none is released while a write of the request can still land.

The router aborts both workers on a cancel or a deadline, in no fixed order, and one of the two
calls may never arrive; the transfer deadline (10 s here, 30 s in production) and the lease
(18 s, 75 s) are the fallbacks these tests must not rely on."""

from __future__ import annotations

import hashlib
import time
from dataclasses import replace

import pytest

from disagg_helpers import tiny_model_and_head, worker_config
from tandem.decode_node.worker import DecodeWorker
from tandem.engine import SamplingParams
from tandem.kvtransfer.backends.fake import default_fabric
from tandem.prefill_node.worker import PrefillWorker
from tandem.worker import WorkerLoop

pytestmark = pytest.mark.timeout(300)

WRITE_S = 0.2  # a KV write lands this long after it was posted ("mid_write" finds some)
PROMPT_S = 1.5  # "within a second", with room for a loaded 2-core machine
CHUNK = 16  # prefill token budget per forward: a 40-token prompt takes three forwards


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    fabric = default_fabric()  # the workers' fake backends meet on it
    latency, fabric.write_latency_s = fabric.write_latency_s, WRITE_S
    model_dir, head_dir = tiny_model_and_head(tmp_path_factory.mktemp("m"))
    pcfg = worker_config("prefill-0", model_dir, head_dir, "fake")
    pcfg = replace(pcfg, engine=replace(pcfg.engine, max_num_batched_tokens=CHUNK))
    prefill = PrefillWorker(pcfg)
    decode = DecodeWorker(worker_config("decode-0", model_dir, head_dir, "fake"))
    dloop = WorkerLoop(decode, lambda outs: None)  # decode answers the handshake from a thread
    try:
        prefill.connect(dloop.call(decode.endpoint))
    finally:
        dloop.close()
    yield prefill, decode
    prefill.close()
    decode.close()
    fabric.write_latency_s = latency


def _kv_digest(decode: DecodeWorker) -> str:
    pool = decode.engine.kv_pool
    h = hashlib.sha256()
    for name in pool.specs:
        h.update(pool.group_tensor(name).numpy().tobytes())
    return h.hexdigest()


class Run:
    """Steps both workers; notes when decode released `room` (it left the receiver's table)
    and what decode's KV memory held right then, before the prefill side stepped again (a fake
    write lands when its sender polls it)."""

    def __init__(self, prefill: PrefillWorker, decode: DecodeWorker, room: int):
        self.prefill, self.decode, self.room = prefill, decode, room
        self.results: list = []
        self.outputs: list = []
        self.released_digest: str | None = None

    def step(self) -> None:
        self.results += self.prefill.step()
        self.outputs += self.decode.step()
        if self.released_digest is None and self.room not in self.decode.receiver.table:
            self.released_digest = _kv_digest(self.decode)

    def until(self, cond, timeout_s: float) -> bool:
        end = time.monotonic() + timeout_s
        while not cond():
            if time.monotonic() > end:
                return False
            self.step()
            time.sleep(0.001)
        return True

    def decode_free(self) -> bool:
        d = self.decode
        # No leaks (DESIGN §3): every KV page and every seed (aux) slot is back in its pool.
        load = d.pool_load()
        # ... and the receiver keeps nothing of a released room (its per-room write counts).
        return (d.num_free_pages() == d.num_pages() and len(d.receiver.table) == 0
                and load.num_free_slots == load.num_slots and not d.receiver._incoming)

    def prefill_free(self) -> bool:
        return self.prefill.num_free_pages() == self.prefill.num_pages()


POINTS = ["queued", "prefilling", "parked", "begun", "granted", "mid_write", "landed",
          "finished_on_prefill"]
ORDERS = ["prefill_first", "decode_first", "prefill_only", "decode_only"]


def _reach(run: Run, point: str) -> tuple[bytes, bool]:
    """Bring the room to `point`; (its destination, whether prefill already has its route)."""
    p, d, room = run.prefill, run.decode, run.room
    prompt = list(range(3, 43)) if point == "prefilling" else list(range(3, 9))
    sp = SamplingParams(max_new_tokens=1 if point == "finished_on_prefill" else 24,
                        ignore_eos=True)
    if point == "parked":  # concurrent dispatch: the forward runs before decode's answer
        p.submit(room, prompt, sp, None)
        dest = d.reserve(room, prompt, sp)
        for _ in range(3):
            run.results += p.step()  # its hand-off now waits for `route`
        return dest, False
    dest = d.reserve(room, prompt, sp)
    p.submit(room, prompt, sp, dest)
    if point == "queued":
        return dest, True
    run.results += p.step()  # first forward: the whole prompt, or its first chunk; BEGIN
    if point in ("prefilling", "begun"):
        return dest, True
    run.outputs += d.step()  # decode grants (GO); prefill has not seen it
    if point == "granted":
        return dest, True
    run.results += p.step()  # GO seen: the page writes go out, landing WRITE_S later
    if point == "mid_write":
        return dest, True
    if point == "finished_on_prefill":
        assert any(r.room == room and r.finished for r in run.results)
        return dest, True
    assert run.until(lambda: any(o.room == room and o.token_ids for o in run.outputs), 5.0)
    return dest, True  # landed and admitted: decode is generating it


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("point", POINTS)
def test_aborted_request_gives_every_decode_page_back_promptly(pair, point, order):
    prefill, decode = pair
    if point == "finished_on_prefill" and order in ("prefill_first", "prefill_only"):
        pytest.skip("a request its first token finished is not aborted on prefill (nothing "
                    "runs there); the router releases decode's reservation")
    if point == "landed" and order == "prefill_only":
        pytest.skip("decode, never told, keeps generating the request it holds (pages in use, "
                    "not leaked); prefill has nothing left of it")
    room = 100 + POINTS.index(point) * len(ORDERS) + ORDERS.index(order)
    run = Run(prefill, decode, room)
    try:
        dest, routed = _reach(run, point)
        if order.startswith("prefill"):
            prefill.abort(room)
            if not routed:  # the router's route had crossed the abort: it comes after it
                prefill.route(room, dest)
        else:
            decode.abort(room)
        if order in ("prefill_first", "decode_first"):
            for _ in range(2):  # the other side hears of it a little later
                run.step()
            (decode.abort if order == "prefill_first" else prefill.abort)(room)
        t0 = time.monotonic()
        assert run.until(run.decode_free, PROMPT_S), (
            f"{point}/{order}: decode still holds {decode.num_pages() - decode.num_free_pages()}"
            f" pages, claims {len(decode.receiver.table)} (state "
            f"{decode.receiver.state(room)}): they would wait for the deadline or the lease")
        assert time.monotonic() - t0 < PROMPT_S
        if order != "decode_only":  # the prefill side was told too: its pages are back
            assert run.until(run.prefill_free, PROMPT_S), f"{point}/{order}: prefill pages"
        # Never early: no write of the room lands in decode's memory after its release.
        if run.released_digest is not None and point != "landed":
            end = time.monotonic() + 2 * WRITE_S
            run.until(lambda: time.monotonic() > end, 5.0)
            assert _kv_digest(decode) == run.released_digest, "a write landed after release"
    finally:  # whatever happened, leave both workers clean for the next case
        prefill.abort(room)
        decode.abort(room)
        run.until(lambda: run.decode_free() and run.prefill_free(), 30.0)
