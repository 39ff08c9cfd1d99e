"""KV transfer between two GPUs of one host, through the real contract: a `PrefillSender` in one
process (cuda:0) writes into a `DecodeReceiver` in another (cuda:1), over NIXL (UCX picks the
transports: NVLink via cuda_ipc) and Mooncake (protocol tcp). For each backend, in a fresh pair of
spawned processes, every case is first checked bit-exact (the first transfer of each case lands
in sentinel-filled memory and is compared on the GPU), then timed.

Cases: "bulk" = contiguous 1 MiB pages (the planner makes one entry per transfer), timed per size;
"prompt" = a 4k-token prompt of a Llama-3.1-8B-shaped model (32 layers, 8 KV heads, head_dim 128,
bf16, page_size 16: 256 pages of 64 KiB per layer = 512 MiB), laid out as the engine's KVPool
([L, num_pages, 2, page_size, Hkv, D]), page ids scattered over a 4x larger pool on both sides,
the same bytes with contiguous page ids (one run a side), and the pages tandem's PageAllocator
hands out in a churned, half-full pool (runs). The link floor is the prompt's bytes at the best
rate measured in the run. Before the tandem cases, NIXL alone (benchmarks/transfer_raw.py):
16/64/256 MiB as one descriptor and as scattered 64 KiB descriptors, initialize_xfer vs prepared
lists, and send_notif round trips with and without NIXL's progress thread.

Modes: "send" = wall time from `send()` to the sender seeing DONE (grant round trip included);
"pregrant" = `start()` first, the clock starts once GO arrived (as when the grant overlaps
prefill compute), then push every layer + finish, until DONE; "stream" (bulk sizes, NIXL) = up
to 8 transfers of the size granted first, then posted back to back into disjoint decode pages,
timed from the first post to the last DONE and reported per transfer: the sustained rate when
transfers follow each other (one's posting overlaps the previous one's data), as under load.
Every timed transfer also reports a timeline (ms after GO / send()): the page writes posted and
completed, the aux write (FINAL) posted and completed, and when the decode side learned of the
landing (its endpoint polls during the transfer; CLOCK_MONOTONIC is one clock per host).

Both workers poll their endpoint on `PollBackoff` (spin, then sleeps of 1/16 of the idle time,
capped at --poll-us) and check their pipe without a timeout: `Connection.poll(t)` rounds any
0 < t < 1 ms up to 1 ms (poll(2)), which once put a 1 ms quantum on every grant and completion.
NIXL's progress thread is per role by default (on for decode, off for prefill; see
BackendOptions.nixl_progress_thread); --nixl-progress-thread on|off forces it on both sides.

    source .devbundle/activate.sh; export PYTHONPATH=.:$PYTHONPATH
    python3 benchmarks/gpu_transfer.py --out $OUT                   # 2 GPUs, ~1-2 min
    PYTHONPATH=. .venv/bin/python benchmarks/gpu_transfer.py --device cpu --sizes-mib 8 \
        --raw-sizes-mib 8 --backends nixl --quick              # CPU smoke test
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import random
import socket
import statistics
import sys
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # spawned workers inherit sys.path
from transfer_raw import RawNixl, print_raw, raw_best_gbps, run_raw

ROOT = Path(__file__).resolve().parents[1]
DEVSITE = "/tmp/devsite"  # where .devbundle/activate.sh unpacks nixl, mooncake, ...
SENTINEL = 0xEE  # decode memory is filled with this byte before a checked transfer
PAYLOAD_BYTES = 8200  # EAGLE seed of the 8B shape: hidden 4096 bf16 + a token id
AUX_SLOTS = 8
MIB = 1 << 20


# ---------------------------------------------------------------------------------------------
# What the two processes agree on (plain values: they cross the pipe)


@dataclass(frozen=True, slots=True, kw_only=True)
class LayoutSpec:
    """One layer group [num_layers, num_pages, *page_shape] of `dtype`, plus the aux slots."""

    name: str  # "bulk" | "prompt"
    num_layers: int
    num_pages: int
    page_shape: tuple[int, ...]  # one (layer, page) block, in elements of `dtype`
    dtype: str  # "uint8" | "bfloat16"
    seed: int  # source pattern: word i of the region holds i + (seed << 40)

    @property
    def page_bytes(self) -> int:
        n = 1 if self.dtype == "uint8" else 2
        for d in self.page_shape:
            n *= d
        return n


@dataclass(frozen=True, slots=True, kw_only=True)
class Case:
    label: str
    layout: LayoutSpec
    src_pages: tuple[int, ...]  # prefill page ids
    dst_pages: tuple[int, ...]  # decode page ids (same length)
    modes: tuple[str, ...]  # "send" | "pregrant" | "stream"
    streams: int = 1  # mode "stream": transfers at once (decode pages shifted per transfer)
    warmup: int  # untimed transfers first (the first one is checked bit-exact)
    repeats: int

    @property
    def nbytes(self) -> int:  # KV bytes moved (the aux seed is not counted)
        return len(self.src_pages) * self.layout.num_layers * self.layout.page_bytes


def compat_wire() -> dict:
    return {"model": "llama-3.1-8b-shape", "dtype": "bfloat16", "page_size": 16,
            "kv_layout": "NHD", "tp_size": 1, "tp_rank": 0, "draft_model": "", "draft_hidden_size": 0,
            "topk": 1, "feature_layers": []}


def payload_for(room: int) -> bytes:
    return random.Random(room).randbytes(PAYLOAD_BYTES)


# ---------------------------------------------------------------------------------------------
# Worker side: one endpoint + the memory behind it, in a spawned process


def _words(t):
    """[L, P, page_bytes / 8] int64 view of a contiguous [L, P, ...] tensor."""
    import torch

    return t.view(t.shape[0], t.shape[1], -1).view(torch.int64)


def _pattern(layer: int, pages, num_pages: int, num_words: int, seed: int):
    """[n, num_words] int64: the source words of `pages` [n] int64 in `layer` (unique per word,
    so a misplaced, partial or stale page cannot compare equal)."""
    import torch

    base = (layer * num_pages + pages) * num_words + (seed << 40)
    return base[:, None] + torch.arange(num_words, device=pages.device)[None, :]


class BenchWorker(RawNixl):
    """Owns one endpoint (sender or receiver) and its tensors. Tensors of earlier layouts stay
    alive until the process ends, so no registration can ever point at reused memory."""

    def __init__(self, role: str, device: str, poll_s: float):
        self.role, self.device, self.poll_s = role, device, poll_s
        self.backend = ""  # set by init()
        self.progress_thread: bool | None = None  # NIXL: BackendOptions (None = by role)
        self.ep = None
        self.spec: LayoutSpec | None = None
        self.kv = None  # [L, P, *page_shape] this endpoint's KV region
        self.keep: list = []  # every tensor ever registered
        self.events: list = []  # receiver: events not yet claimed by wait_received
        self.writes: list[dict] = []  # sender: this transfer's writes (_watch_writes)
        # TANDEM_BENCH_PROFILE=1: cProfile of the sender from GO (or send()) to DONE, printed
        # per layout when its endpoint closes (where the fixed cost per transfer goes)
        self.prof = None
        if role == "prefill" and os.environ.get("TANDEM_BENCH_PROFILE"):
            import cProfile

            self.prof = cProfile.Profile()
        self.step_errors = 0
        self.tag = f"[{'A' if role == 'prefill' else 'B'} {device}]"

    def log(self, msg: str) -> None:
        print(f"{self.tag} {msg}", flush=True)

    def init(self, backend: str, progress_thread: bool | None = None) -> dict:
        self.progress_thread = progress_thread
        t0 = time.perf_counter()
        import torch

        info = {"pid": os.getpid(), "torch": torch.__version__}
        if self.device.startswith("cuda"):
            n = torch.cuda.device_count()
            if torch.device(self.device).index >= n:  # a 1-GPU machine: both sides share it
                self.log(f"only {n} GPU(s) visible: using cuda:0 instead of {self.device}")
                self.device = "cuda:0"
            torch.cuda.set_device(self.device)  # before any CUDA op: the context lives there
            torch.empty(1, device=self.device)
            info["gpus"] = [torch.cuda.get_device_name(i) for i in range(n)]
            info["peer_access"] = {f"{i}->{j}": torch.cuda.can_device_access_peer(i, j)
                                   for i in range(n) for j in range(n) if i != j}
        info["device"] = self.device
        info["torch_init_s"] = time.perf_counter() - t0
        t1 = time.perf_counter()
        import importlib

        importlib.import_module(f"tandem.kvtransfer.backends.{backend}")
        info["backend_import_s"] = time.perf_counter() - t1
        self.backend = backend
        self.log(f"init (pid {os.getpid()}): torch+device {info['torch_init_s']:.1f}s, "
                 f"import {backend} {info['backend_import_s']:.1f}s")
        return info

    def setup(self, spec: LayoutSpec, cfg: dict) -> bytes:
        """Allocate + fill the region, build the endpoint; returns its EndpointInfo bytes."""
        import torch

        from tandem.kvtransfer import (
            AuxRegion,
            BackendOptions,
            CompatInfo,
            DecodeReceiver,
            EndpointConfig,
            KVLayout,
            KVRegion,
            PrefillSender,
        )
        from tandem.kvtransfer.aux_slot import HEADER_BYTES

        self.close_endpoint()
        t0 = time.perf_counter()
        dtype = torch.uint8 if spec.dtype == "uint8" else torch.bfloat16
        self.kv = torch.empty((spec.num_layers, spec.num_pages, *spec.page_shape), dtype=dtype,
                              device=self.device)
        slot_bytes = -(-(HEADER_BYTES + PAYLOAD_BYTES) // 64) * 64
        aux = torch.zeros(AUX_SLOTS, slot_bytes, dtype=torch.uint8)  # host memory, as the engine
        self.keep += [self.kv, aux]
        self.spec = spec
        if self.role == "prefill":
            self._fill_pattern()
        else:
            self.fill_sentinel()
        layout = KVLayout(regions=(KVRegion.from_tensor("target", self.kv),),
                          aux=AuxRegion.from_tensor(aux))
        compat = CompatInfo.from_wire(compat_wire())
        opts = BackendOptions(host="127.0.0.1", protocol="tcp", name_hint=f"bench-{self.role}",
                              nixl_progress_thread=self.progress_thread)
        config = EndpointConfig(**cfg)
        if self.role == "prefill":
            self.ep = PrefillSender(self.backend, layout, compat, config=config, options=opts)
        else:
            self.ep = DecodeReceiver(self.backend, layout, compat, release=lambda r: None,
                                     config=config, options=opts)
        if self.role == "prefill":
            self._watch_writes()
        region = layout.regions[0]
        self.log(f"setup {spec.name}: {region.nbytes / MIB:.0f} MiB on {region.device} "
                 f"(page {region.page_bytes} B x {spec.num_pages} pages x {spec.num_layers} "
                 f"layers) in {time.perf_counter() - t0:.2f}s")
        return self.ep.info().encode()

    def _watch_writes(self) -> None:
        """Record when each write of the sender is posted and first seen complete (the
        timeline `transfer` reports); the aux write (FINAL) is the one from the staging slots."""
        from tandem.kvtransfer.backend import WriteStatus

        be, aux = self.ep.backend, self.ep.layout.aux
        post, poll = be.post_write, be.poll_write
        self.writes: list[dict] = []

        def post_write(peer_id, batch, notify):
            h = post(peer_id, batch, notify)
            staged = aux.base_ptr <= batch.src_addrs[0] < aux.base_ptr + aux.nbytes
            self.writes.append({"aux": staged, "h": h,
                                "posted": time.perf_counter(), "done": None})
            return h

        def poll_write(handle):
            r = poll(handle)
            if r.status is WriteStatus.DONE:
                for w in self.writes:
                    if w["h"] is handle and w["done"] is None:
                        w["done"] = time.perf_counter()
            return r

        be.post_write, be.poll_write = post_write, poll_write
        if hasattr(be, "prepare_write"):  # writes built ahead (at start) and posted later
            prepare, post_prepared, built = be.prepare_write, be.post_prepared, {}

            def prepare_write(peer_id, batch, notify):
                p = prepare(peer_id, batch, notify)
                built[id(p)] = aux.base_ptr <= batch.src_addrs[0] < aux.base_ptr + aux.nbytes
                return p

            def post_prepared_(p):
                h = post_prepared(p)
                self.writes.append({"aux": built.pop(id(p), False), "h": h,
                                    "posted": time.perf_counter(), "done": None})
                return h

            be.prepare_write, be.post_prepared = prepare_write, post_prepared_

    def _timeline(self, t_ref: float, t_finished: float) -> dict:
        """ms after `t_ref` (GO, or send()): the page writes posted, completed; the aux write
        posted, completed; the sender's calls returned (`finished`)."""
        def ms(t):
            return None if t is None else (t - t_ref) * 1e3

        pages = [w for w in self.writes if not w["aux"]]
        aux = [w for w in self.writes if w["aux"]]
        out = {"finished_ms": ms(t_finished), "num_page_writes": len(pages)}
        if pages:
            out["pages_posted_ms"] = ms(max(w["posted"] for w in pages))
            if all(w["done"] is not None for w in pages):
                out["pages_done_ms"] = ms(max(w["done"] for w in pages))
        if aux:
            out["aux_posted_ms"] = ms(aux[-1]["posted"])
            out["aux_done_ms"] = ms(aux[-1]["done"])
        self.writes.clear()
        return out

    def _sync(self) -> None:
        import torch

        if self.device.startswith("cuda"):
            torch.cuda.synchronize(self.device)  # fills must land before a peer reads/writes

    def _fill_pattern(self) -> None:
        import torch

        w, s = _words(self.kv), self.spec
        chunk = max(1, (64 * MIB // 8) // w.shape[2])  # pages per step: ~64 MiB of int64
        for layer in range(s.num_layers):
            for p0 in range(0, s.num_pages, chunk):
                pages = torch.arange(p0, min(p0 + chunk, s.num_pages), device=self.kv.device)
                w[layer, p0 : p0 + len(pages)] = _pattern(layer, pages, s.num_pages, w.shape[2],
                                                          s.seed)
        self._sync()

    def fill_sentinel(self) -> None:
        import torch

        self.kv.view(-1).view(torch.uint8).fill_(SENTINEL)
        self._sync()

    def backoff(self):
        """The idle loop's polling schedule (the endpoint's own, capped at --poll-us)."""
        from tandem.kvtransfer import EndpointConfig, PollBackoff

        return PollBackoff(self.ep.config if self.ep is not None else EndpointConfig(
            poll_sleep_s=self.poll_s, poll_min_sleep_s=min(20e-6, self.poll_s)))

    def step(self) -> bool:
        """Progress the endpoint (and raw agents); True if an event or outcome came."""
        self.raw_progress()
        if self.ep is None:
            return False
        out = self.ep.poll()
        if self.role == "decode":
            self.events.extend(out)
        return bool(out)

    # -- sender ---------------------------------------------------------------------------------
    def connect(self, info: bytes, timeout_s: float) -> float:
        from tandem.kvtransfer import EndpointInfo

        t0 = time.perf_counter()
        self.ep.connect(EndpointInfo.decode(info), timeout_s=timeout_s)
        return time.perf_counter() - t0

    def plan(self, src_pages: tuple, dst_pages: tuple) -> dict:
        """Entries/batches the planner makes for a case, and its Python cost (in `send`)."""
        from tandem.kvtransfer import page_runs, plan_layers

        region = self.ep.layout.regions[0]
        t0 = time.perf_counter()
        batches = plan_layers(region, region, page_runs(src_pages, dst_pages),
                              range(region.num_layers))
        return {"plan_ms": (time.perf_counter() - t0) * 1e3, "batches": len(batches),
                "entries": sum(len(b.lengths) for b in batches)}

    def transfer(self, dest: bytes, src_pages: tuple, mode: str, timeout_s: float) -> dict:
        from tandem.kvtransfer import (
            Destination,
            ErrorKind,
            TransferError,
            TransferState,
        )

        d = Destination.decode(dest)
        payload = payload_for(d.room)
        t_go = None
        self.writes.clear()
        try:
            t0 = time.perf_counter()
            end = t0 + timeout_s  # one deadline for the whole transfer
            if mode == "send":
                self.ep.send(d, src_pages, payload)
            else:  # pregrant: the clock that counts starts at GO
                self.ep.start(d, src_pages)
                backoff = self.backoff()
                while self.ep.state(d.room) is TransferState.RESERVED:
                    if time.perf_counter() > end:
                        raise TransferError(ErrorKind.TIMEOUT, "no GO within the deadline",
                                            room=d.room)
                    self.ep.poll()
                    backoff.pause()
                t_go = time.perf_counter()
                if self.prof is not None:
                    self.prof.enable()
                for region in self.ep.layout.regions:
                    self.ep.push_layers(d.room, region.name, range(region.num_layers))
                self.ep.finish(d.room, payload)
            t_finished = time.perf_counter()
            self.ep.wait(d.room, timeout_s=max(0.1, end - time.perf_counter()))
            t1 = time.perf_counter()
            if self.prof is not None:
                self.prof.disable()
        except TransferError as e:
            return {"ok": False, "kind": e.kind.value, "error": str(e)}
        # Clock origin of the data: GO (pregrant) or send(); perf_counter is CLOCK_MONOTONIC,
        # one clock for every process of the host, so the receiver's landing time compares.
        t_ref = t_go if t_go is not None else t0
        return {"ok": True, "total_s": t1 - t0, "data_s": (t1 - t_go) if t_go else None,
                "t_ref": t_ref, "timeline": self._timeline(t_ref, t_finished)}

    def transfer_stream(self, dests: list, src_pages: tuple, timeout_s: float) -> dict:
        """Several transfers of the same pages back to back (mode "stream"): each granted
        first, then all posted in a row; the clock runs from the first post to the last DONE,
        so one transfer's posting overlaps the previous one's data (sustained throughput)."""
        from tandem.kvtransfer import Destination, ErrorKind, TransferError, TransferState

        ds = [Destination.decode(b) for b in dests]
        self.writes.clear()
        try:
            end = time.perf_counter() + timeout_s
            for d in ds:
                self.ep.start(d, src_pages)
            backoff = self.backoff()
            while any(self.ep.state(d.room) is TransferState.RESERVED for d in ds):
                if time.perf_counter() > end:
                    raise TransferError(ErrorKind.TIMEOUT, "no GO within the deadline")
                self.ep.poll()
                backoff.pause()
            t0 = time.perf_counter()
            for d in ds:
                for region in self.ep.layout.regions:
                    self.ep.push_layers(d.room, region.name, range(region.num_layers))
                self.ep.finish(d.room, payload_for(d.room))
            t_finished = time.perf_counter()
            for d in ds:
                self.ep.wait(d.room, timeout_s=max(0.1, end - time.perf_counter()))
            t1 = time.perf_counter()
        except TransferError as e:
            return {"ok": False, "kind": e.kind.value, "error": str(e)}
        return {"ok": True, "total_s": t1 - t0, "data_s": t1 - t0, "t_ref": t0,
                "timeline": self._timeline(t0, t_finished)}

    def p2p_reference(self, other: str, nbytes: int, repeats: int) -> dict:
        """torch copy from this GPU to `other` in this process: what a plain memcpy gets."""
        import torch

        here, there = torch.device(self.device), torch.device(other)
        src = torch.empty(nbytes, dtype=torch.uint8, device=here)
        dst = torch.empty(nbytes, dtype=torch.uint8, device=there)
        times = []
        for i in range(repeats + 1):
            torch.cuda.synchronize(here)
            torch.cuda.synchronize(there)
            t0 = time.perf_counter()
            dst.copy_(src, non_blocking=True)
            torch.cuda.synchronize(here)
            torch.cuda.synchronize(there)
            if i:  # the first copy sets up peer access
                times.append(time.perf_counter() - t0)
        med = statistics.median(times)
        del src, dst
        torch.cuda.empty_cache()
        return {"nbytes": nbytes, "median_s": med, "gbps": nbytes / med / 1e9,
                "best_gbps": nbytes / min(times) / 1e9, "direction": f"{here} -> {there}"}

    # -- receiver -------------------------------------------------------------------------------
    def expect(self, room: int, dst_pages: tuple, timeout_s: float) -> bytes:
        return self.ep.expect(room, dst_pages, room % AUX_SLOTS, timeout_s=timeout_s).encode()

    def wait_received(self, room: int, timeout_s: float) -> dict:
        from tandem.kvtransfer import Received

        end = time.perf_counter() + timeout_s
        backoff = self.backoff()
        while True:
            self.step()
            t_seen = time.perf_counter()
            for ev in self.events:
                if ev.room == room:
                    self.events.remove(ev)
                    if isinstance(ev, Received):  # t_landed: when decode learned it
                        return {"ok": True, "payload_ok": ev.aux_payload == payload_for(room),
                                "t_landed": t_seen}
                    return {"ok": False, "kind": ev.error.kind.value, "error": str(ev.error)}
            if time.perf_counter() > end:
                return {"ok": False, "kind": "timeout", "error": f"no event in {timeout_s}s"}
            backoff.pause()

    def wait_received_all(self, rooms: list, timeout_s: float) -> dict:
        """wait_received for each of `rooms`; t_landed: when the last one was learned of."""
        out = {"ok": True, "payload_ok": True, "t_landed": None}
        for room in rooms:
            got = self.wait_received(room, timeout_s)
            if not got["ok"]:
                return got
            out["payload_ok"] &= got["payload_ok"]
            out["t_landed"] = got["t_landed"]
        return out

    def verify(self, src_pages: tuple, dst_pages: tuple) -> dict:
        """Compare the written pages with the source pattern, and the others with SENTINEL."""
        import torch

        s, w = self.spec, _words(self.kv)
        dev = self.kv.device
        src = torch.tensor(src_pages, dtype=torch.int64, device=dev)
        dst = torch.tensor(dst_pages, dtype=torch.int64, device=dev)
        untouched = torch.ones(s.num_pages, dtype=torch.bool, device=dev)
        untouched[dst] = False
        raw = self.kv.view(s.num_layers, s.num_pages, -1).view(torch.uint8)
        chunk = max(1, (64 * MIB // 8) // w.shape[2])
        bad = stray = 0
        for layer in range(s.num_layers):
            for i in range(0, len(src_pages), chunk):
                want = _pattern(layer, src[i : i + chunk], s.num_pages, w.shape[2], s.seed)
                got = w[layer].index_select(0, dst[i : i + chunk])
                bad += int((got != want).any(dim=1).sum())  # SYNC: a check, not a hot path
            stray += int((raw[layer][untouched] != SENTINEL).any(dim=1).sum())
        return {"bad_blocks": bad, "stray_blocks": stray,
                "blocks": len(src_pages) * s.num_layers, "exact": bad == 0 and stray == 0}

    def close_endpoint(self) -> None:
        if self.prof is not None and self.spec is not None:
            import io
            import pstats

            out = io.StringIO()
            pstats.Stats(self.prof, stream=out).sort_stats("tottime").print_stats(25)
            self.log(f"profile of the pregrant transfers ({self.spec.name}, GO -> DONE):\n"
                     + out.getvalue()[-6000:])
            import cProfile

            self.prof = cProfile.Profile()
        if self.ep is not None:
            ep, self.ep = self.ep, None
            ep.close()
        self.events.clear()


def worker_main(conn, role: str, device: str, poll_s: float) -> None:
    """Serve (method, args) calls from the parent; step the endpoint whenever idle, on the
    endpoint's spin-then-backoff schedule (reset by a call or an event)."""
    w = BenchWorker(role, device, poll_s)
    conn.send(("ready", os.getpid()))
    backoff = w.backoff()
    while True:
        # Never conn.poll(t) with 0 < t < 1 ms: poll(2) rounds it up to a whole millisecond.
        if conn.poll(0):
            method, args = conn.recv()
            if method == "exit":
                try:
                    w.close_endpoint()
                finally:
                    conn.send(("ok", None))
                return
            try:
                reply = ("ok", getattr(w, method)(*args))
            except BaseException:
                reply = ("err", traceback.format_exc())
            conn.send(reply)
            backoff = w.backoff()  # a call may have made a new endpoint (its config)
        try:
            progressed = w.step()
        except Exception:
            progressed = False
            w.step_errors += 1
            if w.step_errors <= 3:
                w.log(f"poll() raised:\n{traceback.format_exc()}")
        if progressed:
            backoff.reset()
        else:
            backoff.pause()


# ---------------------------------------------------------------------------------------------
# Parent side: orchestration, deadlines, results


class WorkerDead(Exception):
    """The worker did not answer in time or died: the backend's run stops here."""


class Worker:
    def __init__(self, role: str, device: str, poll_s: float, start_timeout: float):
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=worker_main, args=(child, role, device, poll_s),
                                daemon=True)
        self.proc.start()
        self.role = role
        self._wait(start_timeout, "start")

    def _wait(self, timeout: float, what: str):
        try:
            if not self.conn.poll(timeout):
                raise WorkerDead(f"{self.role}: {what} gave no answer in {timeout:g}s")
            status, value = self.conn.recv()
        except (EOFError, OSError) as e:
            raise WorkerDead(f"{self.role}: died during {what} "
                             f"(exit code {self.proc.exitcode})") from e
        if status == "err":
            raise RuntimeError(f"{self.role}.{what} failed:\n{value}")
        return value

    def submit(self, method: str, *args) -> None:
        try:
            self.conn.send((method, args))
        except (BrokenPipeError, OSError) as e:
            raise WorkerDead(f"{self.role}: gone before {method}") from e

    def result(self, method: str, timeout: float):
        return self._wait(timeout, method)

    def call(self, method: str, *args, timeout: float = 60.0):
        self.submit(method, *args)
        return self.result(method, timeout)

    def close(self, graceful: bool = True) -> None:
        if graceful and self.proc.is_alive():
            try:
                self.call("exit", timeout=15)
            except Exception as e:
                print(f"[{self.role}] no clean exit: {e}", flush=True)
            self.proc.join(5)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)


class Bench:
    def __init__(self, args):
        self.args = args
        self.t_start = time.perf_counter()
        self.room = 0
        self.cfg = {"handshake_timeout_s": 30.0, "timeout_s": args.timeout_s,
                    "drain_timeout_s": 35.0, "lease_margin_s": 45.0,
                    "poll_sleep_s": args.poll_us * 1e-6,
                    "poll_min_sleep_s": min(20e-6, args.poll_us * 1e-6)}

    def elapsed(self) -> float:
        return time.perf_counter() - self.t_start

    def say(self, msg: str) -> None:
        print(f"[{self.elapsed():6.1f}s] {msg}", flush=True)

    def one(self, a: Worker, b: Worker, case: Case, mode: str, check: bool) -> dict:
        """One transfer; with `check`, decode memory is reset first and compared after."""
        self.room += 1
        t = self.args.timeout_s
        if check:
            b.call("fill_sentinel", timeout=60)
        dest = b.call("expect", self.room, case.dst_pages, t, timeout=30)
        # decode polls while the transfer runs (as the decode worker's loop does), so the time
        # it learns of the landing is measured, not when this driver asked
        b.submit("wait_received", self.room, t + 5)
        r = a.call("transfer", dest, case.src_pages, mode, t, timeout=t + 20)
        got = b.result("wait_received", timeout=t + 30)
        r["received"] = got
        if r["ok"] and got.get("t_landed") is not None:
            r["timeline"]["landed_ms"] = (got["t_landed"] - r["t_ref"]) * 1e3
        if r["ok"] and not got["ok"]:  # sender DONE but decode refused it: a failure
            r.update(ok=False, kind=got["kind"], error=f"decode: {got['error']}")
        if r["ok"] and not got["payload_ok"]:
            r.update(ok=False, kind="corrupt", error="aux payload differs")
        if check and r["ok"]:
            r["verify"] = b.call("verify", case.src_pages, case.dst_pages, timeout=120)
        return r

    def stream(self, a: Worker, b: Worker, case: Case) -> dict:
        """Mode "stream": `case.streams` transfers of the case at once, into disjoint decode
        pages (the case's pages shifted by one case length each); its time is per transfer,
        its timeline the whole stream's (ms after the first post)."""
        t, n, k = self.args.timeout_s, len(case.dst_pages), case.streams
        rooms, dests = [], []
        for j in range(k):
            self.room += 1
            rooms.append(self.room)
            dests.append(b.call("expect", self.room, tuple(p + j * n for p in case.dst_pages),
                                t, timeout=30))
        b.submit("wait_received_all", rooms, t + 5)
        r = a.call("transfer_stream", dests, case.src_pages, t, timeout=t + 20)
        got = b.result("wait_received_all", timeout=t + 30)
        if r["ok"] and not (got["ok"] and got["payload_ok"]):
            r.update(ok=False, kind=got.get("kind", "corrupt"), error=got.get("error", "payload"))
        if r["ok"]:
            r["total_s"] /= k  # per transfer: rates are the stream's sustained rate
            r["data_s"] = r["total_s"]
            r["timeline"]["landed_ms"] = (got["t_landed"] - r["t_ref"]) * 1e3  # the last one
        return r

    def run_case(self, a: Worker, b: Worker, case: Case, plan: dict, rows: list[dict]) -> None:
        """Check, warm up and time `case` in each mode; rows go into `rows` as they are made (a
        hung backend raises WorkerDead midway and keeps what was measured)."""
        checked = False
        for mode in case.modes:
            row = {"case": case.label, "layout": case.layout.name, "mode": mode,
                   "nbytes": case.nbytes, "mib": case.nbytes / MIB, **plan, "times_s": []}
            rows.append(row)
            if self.elapsed() > self.args.budget_s:
                row["skipped"] = f"time budget {self.args.budget_s:g}s spent"
                self.say(f"  {case.label} {mode}: skipped (budget)")
                continue
            try:
                if mode == "stream":
                    row["streams"] = case.streams
                for i in range(case.warmup + case.repeats):
                    r = (self.stream(a, b, case) if mode == "stream"
                         else self.one(a, b, case, mode, check=not checked))
                    if "verify" in r:
                        checked = True
                        row["verify"] = v = r["verify"]
                        self.say(f"  {case.label}: bit-exact={v['exact']} (bad "
                                 f"{v['bad_blocks']}, stray {v['stray_blocks']} of "
                                 f"{v['blocks']} blocks)")
                    if not r["ok"]:
                        row["error"] = f"{r['kind']}: {r['error']}"
                        self.say(f"  {case.label} {mode}: transfer FAILED: {row['error']}")
                        if r["kind"] == "timeout":
                            raise WorkerDead(row["error"])  # hung link: stop this backend
                        break
                    if i >= case.warmup:
                        row["times_s"].append(r["total_s"] if mode == "send" else r["data_s"])
                        row.setdefault("timelines", []).append(r["timeline"])
                        if mode == "pregrant" and "total_s" in r:  # start() -> GO: the grant
                            row.setdefault("grant_s", []).append(r["total_s"] - r["data_s"])
            finally:
                self._stats(row, case)

    def _stats(self, row: dict, case: Case) -> None:
        ts = row["times_s"]
        if not ts:
            return
        row["median_ms"] = statistics.median(ts) * 1e3
        row["best_ms"] = min(ts) * 1e3
        row["gbps"] = case.nbytes / statistics.median(ts) / 1e9
        row["best_gbps"] = case.nbytes / min(ts) / 1e9
        tls = row.get("timelines", [])
        for key in ("finished_ms", "pages_posted_ms", "pages_done_ms", "aux_posted_ms",
                    "aux_done_ms", "landed_ms"):
            vals = [t[key] for t in tls if t.get(key) is not None]
            if vals:
                row[f"median_{key}"] = statistics.median(vals)
        if "median_landed_ms" in row:  # the data is decode's when it learned of it
            row["landed_gbps"] = (case.nbytes * row.get("streams", 1)
                                  / (row["median_landed_ms"] * 1e-3) / 1e9)
        grant = ""
        if "grant_s" in row:
            row["grant_median_ms"] = statistics.median(row["grant_s"]) * 1e3
            grant = f", grant {row['grant_median_ms']:.2f} ms"
        self.say(f"  {case.label} {row['mode']}: median {row['median_ms']:.2f} ms = "
                 f"{row['gbps']:.1f} GB/s (best {row['best_gbps']:.1f}, {len(ts)} runs, "
                 f"{row['entries']} entries{grant})")
        if tls:
            parts = [f"{k[7:-3]} {row[k]:.3f}" for k in
                     ("median_finished_ms", "median_pages_posted_ms", "median_pages_done_ms",
                      "median_aux_posted_ms", "median_aux_done_ms", "median_landed_ms")
                     if k in row]
            landed = (f"; landed at decode = {row['landed_gbps']:.1f} GB/s"
                      if "landed_gbps" in row else "")
            self.say(f"    timeline ms: {', '.join(parts)}{landed}")

    def run_backend(self, backend: str, groups: list[tuple[LayoutSpec, list[Case]]]) -> dict:
        args = self.args
        out: dict = {"rows": [], "errors": []}
        workers: list[Worker] = []
        graceful = True  # False once a worker hung or died: kill, don't wait for it
        self.say(f"== {backend}: starting prefill on {args.dev_a}, decode on {args.dev_b}")
        try:
            a = Worker("prefill", args.dev_a, args.poll_us * 1e-6, start_timeout=120)
            workers.append(a)
            b = Worker("decode", args.dev_b, args.poll_us * 1e-6, start_timeout=120)
            workers.append(b)
            a.submit("init", backend, args.nixl_progress_thread)
            b.submit("init", backend, args.nixl_progress_thread)
            out["init"] = {"prefill": a.result("init", 180), "decode": b.result("init", 180)}
            if backend == "nixl" and args.raw_sizes_mib:
                self.say("raw NIXL (no tandem code):")
                try:
                    out["raw"] = run_raw(self, a, b, args.raw_sizes_mib, args.quick)
                    a.call("raw_close", timeout=30)
                    b.call("raw_close", timeout=30)
                except RuntimeError as e:  # a raw call raised in a worker: go on with tandem's
                    out["errors"].append(f"raw NIXL: {e}")
                    self.say(f"raw NIXL: ERROR\n{e}")
            for spec, cases in groups:
                try:
                    info = b.call("setup", spec, self.cfg, timeout=120)
                    a.call("setup", spec, self.cfg, timeout=120)
                    out[f"connect_{spec.name}_s"] = a.call("connect", info, 30.0, timeout=60)
                    self.say(f"{backend} {spec.name}: connected")
                    for case in cases:
                        plan = a.call("plan", case.src_pages, case.dst_pages, timeout=60)
                        self.run_case(a, b, case, plan, out["rows"])
                except RuntimeError as e:  # a call raised in the worker: go on with the next
                    out["errors"].append(str(e))
                    self.say(f"{backend} {spec.name}: ERROR\n{e}")
                for w in (a, b):  # sender first: its BYE reaches a still-listening receiver
                    try:
                        w.call("close_endpoint", timeout=30)
                    except RuntimeError as e:
                        out["errors"].append(str(e))
            dev_a, dev_b = (out["init"][r].get("device") for r in ("prefill", "decode"))
            if backend == "nixl" and dev_a != dev_b and dev_a.startswith("cuda"):
                out["p2p_reference"] = a.call("p2p_reference", dev_b, 1 << 30, 5, timeout=60)
        except Exception as e:
            graceful = not isinstance(e, WorkerDead)
            out["errors"].append(f"{type(e).__name__}: {e}")
            self.say(f"{backend}: ABORTED: {type(e).__name__}: {e}")
        finally:
            for w in workers:
                w.close(graceful)
        self.say(f"== {backend}: done")
        return out


# ---------------------------------------------------------------------------------------------
# Cases, environment, report


def build_groups(args, backend: str) -> list[tuple[LayoutSpec, list[Case]]]:
    quick, nixl = args.quick, backend == "nixl"
    sizes = args.sizes_mib if nixl else args.mooncake_sizes_mib
    modes = ("send", "pregrant") if nixl else ("send",)
    warmup, repeats = (1, 3) if quick else ((2, 10) if nixl else (1, 3))
    warmup, repeats = args.warmup or warmup, args.repeats or repeats
    bulk = LayoutSpec(name="bulk", num_layers=1, num_pages=max(sizes), page_shape=(MIB,),
                      dtype="uint8", seed=1)
    # "stream": up to 8 transfers of a size at once where the region holds them side by side
    bulk_cases = [Case(label=f"bulk {n} MiB", layout=bulk, src_pages=tuple(range(n)),
                       dst_pages=tuple(range(n)), warmup=warmup, repeats=repeats,
                       modes=modes + (("stream",) if nixl and max(sizes) // n >= 2 else ()),
                       streams=min(8, max(sizes) // n))
                  for n in sizes]
    # 4k-token prompt of the 8B shape: 256 pages of [2, 16, 8, 128] bf16 per layer.
    layers, tokens = (4, 1024) if quick else (32, args.prompt_tokens)
    pages = -(-tokens // 16)
    prompt = LayoutSpec(name="prompt", num_layers=layers, num_pages=4 * pages,
                        page_shape=(2, 16, 8, 128), dtype="bfloat16", seed=2)
    rng = random.Random(0)  # scattered: a random draw from each side's pool
    scattered = Case(label=f"prompt {tokens} tok scattered", layout=prompt,
                     src_pages=tuple(rng.sample(range(prompt.num_pages), pages)),
                     dst_pages=tuple(rng.sample(range(prompt.num_pages), pages)),
                     modes=modes, warmup=warmup, repeats=repeats if nixl else max(2, repeats - 1))
    prompt_cases = [scattered]
    if nixl:
        prompt_cases.append(Case(label=f"prompt {tokens} tok contiguous", layout=prompt,
                                 src_pages=tuple(range(pages)), dst_pages=tuple(range(pages)),
                                 modes=modes, warmup=warmup, repeats=repeats))
        try:  # what the engine's allocator hands out in a churned, half-full pool
            src, dst = (allocator_pages(prompt.num_pages, pages, seed) for seed in (1, 2))
            prompt_cases.append(Case(label=f"prompt {tokens} tok allocator", layout=prompt,
                                     src_pages=src, dst_pages=dst, modes=modes, warmup=warmup,
                                     repeats=repeats))
        except Exception:
            print(f"allocator case skipped:\n{traceback.format_exc()}", flush=True)
    return [(bulk, bulk_cases), (prompt, prompt_cases)]


def allocator_pages(num_pages: int, n: int, seed: int) -> tuple[int, ...]:
    """`n` pages from tandem's PageAllocator after churn: requests of 1-300 pages come and go
    until the pool is fragmented and about half full, then one prompt of `n` pages."""
    from tandem.engine.kv_cache import PageAllocator

    alloc = PageAllocator(num_pages + 1)  # page 0 is the allocator's scratch page
    rng = random.Random(seed)
    held: list[list[int]] = []
    for _ in range(400):
        k = rng.choice((rng.randint(1, 4), rng.randint(8, 300)))
        if alloc.num_free - k < n or (held and rng.random() < 0.45):
            if held:
                alloc.free(held.pop(rng.randrange(len(held))))
            continue
        held.append(alloc.alloc(k))
    while held and alloc.num_free < num_pages // 2 + n // 2:  # about half full, room for n
        alloc.free(held.pop(rng.randrange(len(held))))
    return tuple(p - 1 for p in alloc.alloc(n))  # bench pools have no scratch page


def ensure_paths() -> list[str]:
    """The repo root and the unpacked bundle on sys.path and PYTHONPATH (spawned workers inherit
    both): `PYTHONPATH=. python3 ...` after `source .devbundle/activate.sh` replaces the bundle's
    PYTHONPATH entry instead of extending it."""
    paths = [str(ROOT)] + ([DEVSITE] if Path(DEVSITE).is_dir() else [])
    for p in reversed(paths):
        if p not in sys.path:
            sys.path.insert(0, p)
    old = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    os.environ["PYTHONPATH"] = os.pathsep.join(paths + [p for p in old if p not in paths])
    return paths


def set_env(device: str) -> dict:
    """Quiet logs; on GPU let UCX choose its transports (cuda_ipc over NVLink)."""
    os.environ["MC_LOG_LEVEL"] = "WARNING"
    os.environ["NIXL_LOG_LEVEL"] = "WARN"
    removed = {}
    if device != "cpu":
        for k in ("UCX_TLS", "UCX_NET_DEVICES"):  # a forced tcp/lo list would bypass NVLink
            if k in os.environ:
                removed[k] = os.environ.pop(k)
        conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
        if "expandable_segments" in conf:  # VMM memory: legacy CUDA IPC (cuda_ipc) can't map it
            removed["PYTORCH_CUDA_ALLOC_CONF"] = os.environ.pop("PYTORCH_CUDA_ALLOC_CONF")
    keys = ("MC_LOG_LEVEL", "NIXL_LOG_LEVEL", "UCX_TLS", "UCX_NET_DEVICES", "MC_TRANSFER_TIMEOUT",
            "NCCL_NVLS_ENABLE", "CUDA_VISIBLE_DEVICES", "PYTHONPATH", "LD_LIBRARY_PATH")
    return {"set": {k: os.environ[k] for k in keys if k in os.environ}, "removed": removed}


def versions() -> dict:
    from importlib import metadata

    out = {"python": sys.version.split()[0]}
    for dist in ("torch", "nixl", "nixl-cu13", "nixl-cu12", "mooncake-transfer-engine-cuda13",
                 "mooncake-transfer-engine", "mooncake-transfer-engine-non-cuda"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            pass
    return out


def summarize(results: dict) -> dict:
    """Headline numbers: NIXL's best contiguous rate, the 300 GB/s goal per size and mode, the
    prompt's time per backend, and its link floor (prompt bytes at the best rate measured, raw
    NIXL or through tandem)."""
    s: dict = {}
    nixl = results["backends"].get("nixl", {})
    bulk = [r for r in nixl.get("rows", []) if r["layout"] == "bulk" and "gbps" in r]
    best = max(bulk, key=lambda r: r["gbps"]) if bulk else None
    raw = nixl.get("raw", {})
    link_gbps = max([raw_best_gbps(raw)] + ([best["gbps"]] if best else []))
    if raw:
        s["raw_best_gbps"] = raw_best_gbps(raw)
        s["raw_gbps"] = {f"{r['case']} {r['method']}{' thread' if r['progress_thread'] else ''}":
                         round(r["gbps"], 1) for r in raw.get("rows", []) if "gbps" in r}
        s["raw_notif_rtt_us"] = {k: round(v["median_us"], 1) for k, v in raw["pings"].items()}
    if best:
        s["nixl_best_bulk"] = {k: best[k] for k in ("case", "mode", "gbps", "median_ms")}
        for mode in ("send", "pregrant", "stream"):
            ge64 = [r for r in bulk if r["mib"] >= 64 and r["mode"] == mode]
            s[f"nixl_{mode}_gbps_by_mib"] = {int(r["mib"]): round(r["gbps"], 1) for r in ge64}
            s[f"nixl_{mode}_300_gbps_at_mib"] = [int(r["mib"]) for r in ge64 if r["gbps"] >= 300]
            s[f"nixl_{mode}_landed_gbps_by_mib"] = {int(r["mib"]): round(r["landed_gbps"], 1)
                                                    for r in ge64 if "landed_gbps" in r}
    for backend, res in results["backends"].items():
        for r in res.get("rows", []):
            if r["layout"] != "prompt" or "gbps" not in r:
                continue
            kind = r["case"].split()[-1]  # scattered | contiguous | allocator
            s[f"{backend}_prompt_{kind}_{r['mode']}"] = {
                "ms": r["median_ms"], "gbps": r["gbps"], "entries": r["entries"],
                "plan_ms": r.get("plan_ms")}
            if link_gbps > 0:
                s["prompt_nbytes"] = r["nbytes"]
                s["link_gbps"] = link_gbps
                s["link_floor_ms"] = r["nbytes"] / (link_gbps * 1e9) * 1e3
                s[f"{backend}_prompt_{kind}_{r['mode']}"]["x_floor"] = round(
                    r["median_ms"] / s["link_floor_ms"], 2)
    return s


def print_table(results: dict) -> None:
    print("\n=== KV transfer results ===", flush=True)
    meta = results["meta"]
    print(f"GPUs: {meta.get('gpus')}  peer access: {meta.get('peer_access')}")
    hdr = (f"{'backend':9} {'case':32} {'mode':9} {'MiB':>7} {'entries':>7} {'median ms':>10} "
           f"{'GB/s':>8} {'best GB/s':>9} {'grant ms':>8}  exact")
    print(hdr)
    print("-" * len(hdr))
    for backend, res in results["backends"].items():
        for r in res.get("rows", []):
            exact = r.get("verify", {}).get("exact", "-")
            if "gbps" in r:
                grant = f"{r['grant_median_ms']:8.3f}" if "grant_median_ms" in r else f"{'-':>8}"
                nums = f"{r['median_ms']:10.3f} {r['gbps']:8.1f} {r['best_gbps']:9.1f} {grant}"
            else:
                nums = f"{(r.get('error') or r.get('skipped') or 'no data')[:38]:>38}"
            print(f"{backend:9} {r['case']:32} {r['mode']:9} {r['mib']:7.0f} "
                  f"{r.get('entries', 0):7d} {nums}  {exact}")
        for e in res.get("errors", []):
            print(f"{backend:9} ERROR: {e.strip().splitlines()[-1][:150]}")
    print_raw(results["backends"].get("nixl", {}).get("raw", {}))
    ref = results["backends"].get("nixl", {}).get("p2p_reference")
    if ref:
        print(f"torch copy {ref['direction']} 1 GiB: {ref['gbps']:.1f} GB/s (best "
              f"{ref['best_gbps']:.1f})")
    s = results["summary"]
    if "nixl_best_bulk" in s:
        b = s["nixl_best_bulk"]
        print(f"NIXL best contiguous: {b['gbps']:.1f} GB/s ({b['case']}, {b['mode']}); "
              f">= 300 GB/s at MiB: send {s['nixl_send_300_gbps_at_mib']}, "
              f"pregrant {s['nixl_pregrant_300_gbps_at_mib']}, "
              f"stream {s['nixl_stream_300_gbps_at_mib']}")
        print(f"landed at decode (GB/s by MiB): send {s['nixl_send_landed_gbps_by_mib']}, "
              f"pregrant {s['nixl_pregrant_landed_gbps_by_mib']}, "
              f"stream {s['nixl_stream_landed_gbps_by_mib']}")
    for key, v in s.items():
        if "_prompt_" in key:
            print(f"{key}: {v['ms']:.2f} ms = {v['gbps']:.1f} GB/s ({v['entries']} entries, "
                  f"plan {v['plan_ms']:.2f} ms, {v.get('x_floor', float('nan')):.2f}x floor)")
    if "link_floor_ms" in s:
        print(f"prompt link floor ({s['prompt_nbytes'] / MIB:.0f} MiB at the best measured "
              f"{s['link_gbps']:.1f} GB/s): {s['link_floor_ms']:.2f} ms")
    print(f"total {results['meta']['total_s']:.1f}s", flush=True)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "results/gpu_transfer"))
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--devices", default="0,1", help="prefill,decode CUDA device indices")
    ap.add_argument("--backends", default="nixl,mooncake")
    ap.add_argument("--sizes-mib", default="16,64,256,1024",
                    help="bulk sizes for NIXL through tandem (contiguous 1 MiB pages)")
    ap.add_argument("--raw-sizes-mib", default="16,64,256",
                    help="raw NIXL sizes (no tandem code); '' skips the raw section")
    ap.add_argument("--nixl-progress-thread", nargs="?", const="on", default="role",
                    choices=("role", "on", "off"),
                    help="NIXL's UCX progress thread in the tandem endpoints: by role (default: "
                         "decode on, prefill off), or on/off for both")
    ap.add_argument("--mooncake-sizes-mib", default=None,
                    help="bulk sizes for Mooncake (default 64; --quick: the smallest NIXL size)")
    ap.add_argument("--prompt-tokens", type=int, default=4096)
    ap.add_argument("--quick", action="store_true", help="few repeats, a small prompt shape")
    ap.add_argument("--warmup", type=int, default=0, help="override: untimed runs per case")
    ap.add_argument("--repeats", type=int, default=0, help="override: timed runs per case")
    ap.add_argument("--timeout-s", type=float, default=60.0, help="per-transfer deadline")
    ap.add_argument("--budget-s", type=float, default=360.0,
                    help="start no new case after this many seconds")
    ap.add_argument("--poll-us", type=float, default=None,
                    help="poll sleep of both endpoints (default 20 on GPU, 500 on CPU)")
    args = ap.parse_args(argv)
    args.sizes_mib = [int(x) for x in args.sizes_mib.split(",")]
    args.raw_sizes_mib = [int(x) for x in args.raw_sizes_mib.split(",") if x]
    mc = args.mooncake_sizes_mib or (str(min(args.sizes_mib)) if args.quick else "64")
    args.mooncake_sizes_mib = [int(x) for x in mc.split(",")]
    args.backends = [b for b in args.backends.split(",") if b]
    args.nixl_progress_thread = {"role": None, "on": True, "off": False}[args.nixl_progress_thread]
    if args.poll_us is None:
        args.poll_us = 500.0 if args.device == "cpu" else 20.0
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    ensure_paths()
    env = set_env(args.device)
    if args.device == "cpu":
        args.dev_a = args.dev_b = "cpu"
    else:
        i, j = (int(x) for x in args.devices.split(","))
        args.dev_a, args.dev_b = f"cuda:{i}", f"cuda:{j}"
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    bench = Bench(args)
    bench.say(f"gpu_transfer: {args.dev_a} -> {args.dev_b}, backends {args.backends}, "
              f"env {env}")
    results: dict = {"meta": {"date": time.strftime("%Y-%m-%d %H:%M:%S"),
                              "host": socket.gethostname(), "argv": sys.argv[1:],
                              "prefill_device": args.dev_a, "decode_device": args.dev_b,
                              "env": env, "versions": versions(),
                              "endpoint_config": bench.cfg},
                     "backends": {}}
    for backend in args.backends:
        groups = build_groups(args, backend)
        res = bench.run_backend(backend, groups)
        res["cases"] = [{"label": c.label, "layout": asdict(c.layout), "nbytes": c.nbytes,
                         "num_pages": len(c.src_pages), "modes": c.modes}
                        for _, cases in groups for c in cases]
        results["backends"][backend] = res
        init = res.get("init", {}).get("prefill", {})
        for k in ("gpus", "peer_access"):
            if k in init:
                results["meta"][k] = init[k]
        (out_dir / "transfer.json").write_text(json.dumps(results, indent=1, default=str))
    results["meta"]["total_s"] = bench.elapsed()
    results["summary"] = summarize(results)
    (out_dir / "transfer.json").write_text(json.dumps(results, indent=1, default=str))
    print_table(results)
    print(f"wrote {out_dir / 'transfer.json'}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
