"""The KV sender's host cost per transfer, on this machine: a PrefillSender and a DecodeReceiver
in one process (NIXL over loopback, or the in-process fake), one layer of 64 small pages, so the
bytes cost little and what is timed is the sender's own work after GO: `push_layers` (plan +
post the page write), `finish` (post the aux write with FINAL), and the wait until DONE.

    PYTHONPATH=. .venv/bin/python benchmarks/sender_host_cost.py [nixl|fake] [--rounds 200]

`AB=DIR` puts DIR first on sys.path (another checkout's `tandem`, for an A/B of two versions).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time
from pathlib import Path

if os.environ.get("AB"):
    sys.path.insert(0, os.environ["AB"])
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "contract"))

from kvt_harness import LayoutSpec, Memory, compat_wire, config_wire  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("backend", nargs="?", default="nixl", choices=["nixl", "fake"])
    ap.add_argument("--rounds", type=int, default=200)
    args = ap.parse_args()

    import tandem
    from tandem.kvtransfer import (BackendOptions, CompatInfo, DecodeReceiver, EndpointConfig,
                                   PrefillSender, TransferState)

    spec = LayoutSpec(groups=(("target", 1, 4096),), num_pages=64, aux_slot_bytes=8448)
    send_mem, recv_mem = Memory(spec), Memory(spec)
    compat = CompatInfo.from_wire(compat_wire())
    cfg = EndpointConfig(**config_wire(poll_sleep_s=0.00002))
    opts = BackendOptions(name_hint="hostcost")
    rx = DecodeReceiver(args.backend, recv_mem.layout, compat, release=lambda *a: None,
                        config=cfg, options=opts)
    tx = PrefillSender(args.backend, send_mem.layout, compat, config=cfg, options=opts)
    stop = False

    def serve_handshake() -> None:
        while not stop:
            rx.poll()

    t = threading.Thread(target=serve_handshake)
    t.start()
    tx.connect(rx.info(), timeout_s=10)
    stop = True
    t.join()

    pages = list(range(64))
    times: dict[str, list[float]] = {"push": [], "finish": [], "wait": []}
    for room in range(1, args.rounds + 1):
        d = rx.expect(room, pages, room % 8, timeout_s=10)
        tx.start(d, pages)
        while tx.state(room) is TransferState.RESERVED:
            rx.poll()
            tx.poll()
        t0 = time.perf_counter()
        tx.push_layers(room, "target", range(1))
        t1 = time.perf_counter()
        tx.finish(room, bytes(8200))
        t2 = time.perf_counter()
        got = False
        while not got or not tx.state(room).terminal:
            if not tx.state(room).terminal:
                tx.poll()
            got = bool(rx.poll()) or got
        t3 = time.perf_counter()
        if room > args.rounds // 4:  # warm-up excluded
            times["push"].append(t1 - t0)
            times["finish"].append(t2 - t1)
            times["wait"].append(t3 - t2)
    print(f"tandem from {Path(tandem.__file__).parent}, backend {args.backend}: " + ", ".join(
        f"{k} {statistics.median(v) * 1e6:.0f} us" for k, v in times.items()))
    tx.close()
    rx.close()


if __name__ == "__main__":
    main()
