"""Harness for the kvtransfer contract tests: a `Driver` owns one endpoint (PrefillSender or
DecodeReceiver) plus the host memory behind its layout, and is driven by method calls.

kvt_runners.py runs the same Driver in a spawned OS process, a thread, or this process. Only
plain values cross the pipe: bytes, ints, strings, tuples.
"""

from __future__ import annotations

import ctypes
import os
import random
import time
from collections import deque
from dataclasses import dataclass

SENTINEL = 0xEE  # receiver memory starts as this byte: untouched pages must keep it

# Quiet logs; UCX on loopback over TCP (a SIGSTOPped peer then stalls writes as across nodes).
TEST_ENV = {
    "MC_LOG_LEVEL": "WARNING",
    "MC_TRANSFER_TIMEOUT": "5",
    "NIXL_LOG_LEVEL": "WARN",
    "UCX_NET_DEVICES": "lo",
    "UCX_TLS": "tcp",
    "GLOG_minloglevel": "2",
}


@dataclass(frozen=True, slots=True)
class LayoutSpec:
    groups: tuple[tuple[str, int, int], ...]  # (name, num_layers, page_bytes)
    num_pages: int
    aux_slots: int = 8
    aux_slot_bytes: int = 256


def compat_wire(**overrides) -> dict:
    d = {"model": "smollm2-135m", "dtype": "bfloat16", "page_size": 16, "kv_layout": "NHD",
         "tp_size": 1, "tp_rank": 0, "draft_model": "eagle-smollm2", "draft_hidden_size": 576,
         "topk": 1, "feature_layers": [29]}
    d.update(overrides)
    return d


def config_wire(**overrides) -> dict:
    d = {"handshake_timeout_s": 30.0, "timeout_s": 3.0, "drain_timeout_s": 1.5,
         "lease_margin_s": 2.0, "poll_sleep_s": 0.0005}
    d.update(overrides)
    return d


class Memory:
    """Host buffers for a LayoutSpec (one per group + the aux slots)."""

    def __init__(self, spec: LayoutSpec):
        from tandem.kvtransfer import AuxRegion, KVLayout, KVRegion

        self.spec = spec
        self.bufs = {}
        regions = []
        for name, layers, page_bytes in spec.groups:
            buf = ctypes.create_string_buffer(layers * spec.num_pages * page_bytes)
            self.bufs[name] = buf
            regions.append(KVRegion(name=name, base_ptr=ctypes.addressof(buf), num_layers=layers,
                                    num_pages=spec.num_pages, page_bytes=page_bytes))
        self.aux_buf = ctypes.create_string_buffer(spec.aux_slots * spec.aux_slot_bytes)
        self.layout = KVLayout(regions=tuple(regions), aux=AuxRegion(
            base_ptr=ctypes.addressof(self.aux_buf), num_slots=spec.aux_slots,
            slot_bytes=spec.aux_slot_bytes))

    def fill_random(self, seed: int) -> None:
        for name, buf in self.bufs.items():
            data = random.Random(f"{seed}:{name}").randbytes(len(buf))
            ctypes.memmove(buf, data, len(buf))

    def fill_sentinel(self) -> None:
        for buf in self.bufs.values():
            ctypes.memset(buf, SENTINEL, len(buf))

    def page(self, name: str, layer: int, page: int) -> bytes:
        region = self.layout.region(name)
        return ctypes.string_at(region.page_addr(layer, page), region.page_bytes)


class Driver:
    def __init__(self, backend: str, fabric=None):
        self.backend_name = backend
        self.fabric = fabric
        self.ep = None
        self.mem: Memory | None = None
        self.events: list[tuple] = []
        self.scripts: deque = deque()  # scripted layer-wise sends: [room, plan deque, payload]

    # -- construction -------------------------------------------------------------------------
    def _common(self, spec: LayoutSpec, compat: dict, config: dict):
        from tandem.kvtransfer import BackendOptions, CompatInfo, EndpointConfig

        self.close()  # a worker serves one endpoint at a time
        self.mem = Memory(spec)
        opts = BackendOptions(fabric=self.fabric, name_hint="test")
        return CompatInfo.from_wire(compat), EndpointConfig(**config), opts

    def make_receiver(self, spec: LayoutSpec, compat: dict, config: dict) -> bytes:
        from tandem.kvtransfer import DecodeReceiver

        c, cfg, opts = self._common(spec, compat, config)
        self.mem.fill_sentinel()
        self.ep = DecodeReceiver(self.backend_name, self.mem.layout, c, release=self._on_release,
                                 config=cfg, options=opts)
        return self.ep.info().encode()

    def make_sender(self, spec: LayoutSpec, compat: dict, config: dict, seed: int,
                    faults: tuple | None = None) -> bytes:
        from tandem.kvtransfer import FailureInjection, FaultKind, PrefillSender

        c, cfg, opts = self._common(spec, compat, config)
        self.mem.fill_random(seed)
        inj = None
        if faults is not None:  # (probability, kind value, seed, delay_s)
            inj = FailureInjection(probability=faults[0], kind=FaultKind(faults[1]), seed=faults[2],
                                   delay_s=faults[3])
        self.ep = PrefillSender(self.backend_name, self.mem.layout, c, config=cfg, options=opts,
                                faults=inj)
        return self.ep.info().encode()

    def _on_release(self, r) -> None:
        self.events.append(("released", r.room, r.page_ids, r.aux_slot, r.outcome.value, r.reason,
                            time.monotonic()))

    # -- receiver role --------------------------------------------------------------------------
    def expect(self, room: int, pages: tuple, slot: int, timeout_s: float | None = None) -> bytes:
        return self.ep.expect(room, pages, slot, timeout_s=timeout_s).encode()

    def state(self, room: int) -> str | None:
        try:
            st = self.ep.state(room)
        except Exception:
            return None
        return st.value if st is not None else None

    def abort(self, room: int) -> None:
        self.ep.abort(room)

    # -- sender role ----------------------------------------------------------------------------
    def decline(self, dest: bytes) -> None:
        """The room of `dest` ends here before it was sent (PrefillSender.decline)."""
        from tandem.kvtransfer import Destination

        self.ep.decline([Destination.decode(dest)])

    def connect(self, info: bytes, timeout_s: float = 30.0) -> tuple:
        from tandem.kvtransfer import EndpointInfo, TransferError

        try:
            self.ep.connect(EndpointInfo.decode(info), timeout_s=timeout_s)
        except TransferError as e:
            return ("error", e.kind.value, e.message)
        except NotImplementedError as e:
            return ("not_implemented", str(e))
        return ("ok",)

    def send(self, dest: bytes, src_pages: tuple, payload: bytes, compute_s_per_layer: float = 0.0,
             ) -> None:
        """Start a send; layers go out one by one, `compute_s_per_layer` apart (simulated
        prefill), then the seed. Progresses in step(); outcome arrives as a ("sent", ...) event."""
        from tandem.kvtransfer import Destination

        d = Destination.decode(dest)
        self.ep.start(d, src_pages)
        t, plan = time.monotonic(), deque()
        for name, layers, _ in self.mem.spec.groups:
            for layer in range(layers):
                t += compute_s_per_layer
                plan.append((t, name, layer))
        self.scripts.append([d.room, plan, payload])
        self._run_scripts()

    def _run_scripts(self) -> None:
        from tandem.kvtransfer import TransferError

        for script in list(self.scripts):
            room, plan, payload = script
            try:
                if self.ep.state(room).terminal:
                    self.scripts.remove(script)
                    continue
                while plan and plan[0][0] <= time.monotonic():
                    _, name, layer = plan.popleft()
                    self.ep.push_layers(room, name, range(layer, layer + 1))
                if not plan:
                    self.ep.finish(room, payload)
                    self.scripts.remove(script)
            except TransferError:
                self.scripts.remove(script)  # the outcome event reports it

    # -- both -----------------------------------------------------------------------------------
    def step(self) -> None:
        if self.ep is None:
            return
        self._run_scripts()
        for ev in self.ep.poll():
            self.events.append(_event_tuple(ev))

    def take_events(self) -> list[tuple]:
        out, self.events = self.events, []
        return out

    def verify(self, seed: int, src_pages: tuple, dst_pages: tuple) -> tuple[int, int]:
        """(mismatching (group, layer, page) blocks, touched pages outside dst_pages[:n])."""
        bad = stray = 0
        written = set(dst_pages[: len(src_pages)])
        for name, layers, page_bytes in self.mem.spec.groups:
            nbytes = layers * self.mem.spec.num_pages * page_bytes
            src = random.Random(f"{seed}:{name}").randbytes(nbytes)
            blank = bytes([SENTINEL]) * page_bytes
            for layer in range(layers):
                for s, d in zip(src_pages, dst_pages):
                    off = (layer * self.mem.spec.num_pages + s) * page_bytes
                    bad += self.mem.page(name, layer, d) != src[off : off + page_bytes]
                for p in range(self.mem.spec.num_pages):
                    if p not in written:
                        stray += self.mem.page(name, layer, p) != blank
        return bad, stray

    def digest(self, pages: tuple) -> int:
        """Hash of these pages' bytes in every layer of every group (detects late writes)."""
        h = 0
        for name, layers, _ in self.mem.spec.groups:
            for layer in range(layers):
                for p in pages:
                    h = hash((h, self.mem.page(name, layer, p)))
        return h

    def metrics(self) -> dict:
        m = self.ep.metrics()
        return {"num_done": m.num_done, "bytes": m.bytes_moved, "gbps": m.gbps,
                "p50": m.latency_p50_s, "p99": m.latency_p99_s, "failures": dict(m.failures)}

    def pid(self) -> int:
        return os.getpid()

    def close(self) -> None:
        if self.ep is not None:
            self.ep.close()
            self.ep = None


def _event_tuple(ev) -> tuple:
    from tandem.kvtransfer import Received, ReceiveFailed, SendOutcome

    if isinstance(ev, Received):
        return ("received", ev.room, ev.page_ids, ev.aux_payload)
    if isinstance(ev, ReceiveFailed):
        return ("failed", ev.room, ev.error.kind.value, ev.error.message)
    assert isinstance(ev, SendOutcome)
    return ("sent", ev.room, ev.state.value, ev.error.kind.value if ev.error else None,
            ev.error.message if ev.error else "")
