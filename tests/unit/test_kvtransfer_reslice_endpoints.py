"""PrefillSender / DecodeReceiver between different TP sizes over the in-process fake backend:
P=1 -> D=2 and P=2 -> D=1, byte-exact against the full-head KV, one seed per decode rank, a room
received only when every expected sender completed, every page and slot released afterwards."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from tandem.kvtransfer import (AuxRegion, BackendOptions, CompatInfo, DecodeReceiver,
                               EndpointConfig, KVLayout, KVRegion, PrefillSender, Received,
                               TransferState)
from tandem.kvtransfer.backends.fake import FakeFabric
from tandem.kvtransfer.reslice import kv_head_range

pytestmark = pytest.mark.timeout(60)

HKV, L, T, DH, NPAGES = 4, 2, 4, 2, 16
CFG = EndpointConfig(handshake_timeout_s=5, timeout_s=5.0, drain_timeout_s=0.5,
                     lease_margin_s=1.0, poll_sleep_s=0.0002)


def _compat(tp: int, rank: int) -> CompatInfo:
    return CompatInfo(model="m", dtype="float32", page_size=T, kv_layout="NHD", tp_size=tp,
                      tp_rank=rank, draft_model="d", draft_hidden_size=8, topk=1,
                      feature_layers=(), num_kv_heads=HKV)


class Rank:
    """One rank's memory: target [L, pages, 2, T, H_local, DH], draft [1, pages, 2, T, 2, DH]."""

    def __init__(self, tp: int, rank: int, rng: np.random.Generator):
        self.h0, self.hn = kv_head_range(rank, tp, HKV)
        self.target = rng.standard_normal((L, NPAGES, 2, T, self.hn, DH)).astype(np.float32)
        self.draft = rng.standard_normal((1, NPAGES, 2, T, 2, DH)).astype(np.float32)
        self.aux = np.zeros((4, 128), dtype=np.uint8)
        regions = (
            KVRegion(name="target", base_ptr=self.target.ctypes.data, num_layers=L,
                     num_pages=NPAGES, page_bytes=self.target[0, 0].nbytes,
                     head_start=self.h0, num_heads=self.hn),
            KVRegion(name="draft", base_ptr=self.draft.ctypes.data, num_layers=1,
                     num_pages=NPAGES, page_bytes=self.draft[0, 0].nbytes))
        self.layout = KVLayout(regions=regions, aux=AuxRegion(
            base_ptr=self.aux.ctypes.data, num_slots=4, slot_bytes=128))
        self.compat = _compat(tp, rank)


def _connect(tx: PrefillSender, rxs: list[DecodeReceiver]) -> None:
    for rx in rxs:
        t = threading.Thread(target=tx.connect, args=(rx.info(),))
        t.start()
        while t.is_alive():
            for r in rxs:
                r.poll()
            time.sleep(0.0005)


@pytest.mark.parametrize("P,D", [(1, 2), (2, 1), (2, 4), (4, 2)])
def test_reslice_roundtrip_byte_exact(P: int, D: int) -> None:
    rng = np.random.default_rng(10 * P + D)
    opts = BackendOptions(fabric=FakeFabric())
    n_req = 3
    full = rng.standard_normal((L, n_req, 2, T, HKV, DH)).astype(np.float32)
    draft_full = rng.standard_normal((1, n_req, 2, T, 2, DH)).astype(np.float32)
    src_pages, dst_pages = [5, 6, 2], [1, 2, 3, 9]
    pre = [Rank(P, p, rng) for p in range(P)]
    for r in pre:
        r.target[:, src_pages] = full[..., r.h0:r.h0 + r.hn, :]
        r.draft[:, src_pages] = draft_full
    dec = [Rank(D, d, rng) for d in range(D)]
    before = [(r.target.copy(), r.draft.copy()) for r in dec]
    released = []
    rxs = [DecodeReceiver("fake", r.layout, r.compat, release=released.append, config=CFG,
                          options=opts) for r in dec]
    txs = [PrefillSender("fake", r.layout, r.compat, config=CFG, options=opts) for r in pre]
    try:
        # Each prefill rank connects to the decode ranks it holds heads for.
        from tandem.kvtransfer.reslice import slices_from_prefill
        targets = {p: [s.decode_rank for s in slices_from_prefill(p, P, D, HKV)]
                   for p in range(P)}
        for p, tx in enumerate(txs):
            _connect(tx, [rxs[d] for d in targets[p]])
        room = 77
        dests = [rx.expect(room, dst_pages, aux_slot=d % 4) for d, rx in enumerate(rxs)]
        events: list = []
        got: dict[int, list] = {d: [] for d in range(D)}  # decode rank -> its events

        def poll_rx() -> None:
            for d, rx in enumerate(rxs):
                evs = rx.poll()
                got[d].extend(evs)
                events.extend(evs)

        # Send from every prefill rank but the last first: no decode rank may admit early.
        for p, tx in enumerate(txs):
            tx.send([dests[d] for d in targets[p]], src_pages, b"seed-payload")
            if p < P - 1:
                end = time.monotonic() + 0.2
                while time.monotonic() < end:
                    poll_rx()
                    for t in txs[: p + 1]:
                        t.poll()
                waiting = {d for d in range(D) if any(q > p for q in range(P)
                                                      if d in targets[q])}
                early = [d for d in waiting if got[d]]
                assert not early, f"decode ranks {early} admitted before all senders completed"
        end = time.monotonic() + 10
        while sum(isinstance(e, Received) for e in events) < D:
            assert time.monotonic() < end, f"not received on every rank: {events}"
            poll_rx()
            for tx in txs:
                tx.poll()
        assert all(isinstance(e, Received) and e.aux_payload == b"seed-payload" for e in events)
        for tx in txs:
            assert tx.state(room) is TransferState.DONE
        used, rest = dst_pages[:n_req], [p for p in range(NPAGES) if p not in dst_pages[:n_req]]
        for r, (t0, d0) in zip(dec, before):
            np.testing.assert_array_equal(r.target[:, used], full[..., r.h0:r.h0 + r.hn, :])
            np.testing.assert_array_equal(r.draft[:, used], draft_full)
            np.testing.assert_array_equal(r.target[:, rest], t0[:, rest])
            np.testing.assert_array_equal(r.draft[:, rest], d0[:, rest])
        assert len(released) == D and all(x.outcome is TransferState.DONE for x in released)
        for rx in rxs:
            assert len(rx.table) == 0
    finally:
        for tx in txs:
            tx.close()
        for rx in rxs:
            rx.close()
