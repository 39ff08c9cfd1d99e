"""Raw NIXL between the two bench processes, no tandem code: what the library and the link give,
so the tandem rows of benchmarks/gpu_transfer.py can be read against it.

Per size (16/64/256 MiB by default) one transfer of ONE descriptor and of MANY (64 KiB blocks,
scattered: independent random block orders on both sides, so nothing merges), each built two
ways: `initialize_xfer` with numpy descriptor arrays (built per transfer) and `make_prepped_xfer`
on lists prepared once. Time = build + post + poll until DONE (the sender spins on
check_xfer_state); "build" is reported apart. Plus a send_notif ping-pong and one 64 MiB write
with NIXL's UCX progress thread on and off (the thread only wakes on its >= 1 ms poll timeout).

`RawNixl` is mixed into the bench's worker (methods called over the pipe); `run_raw` is the
parent side.

Descriptors name the device of the memory they describe: local ones this process's GPU, remote
ones the PEER's (its registration, `raw_setup`'s answer). With one id for both, every GPU case
failed with NIXL_ERR_NOT_FOUND (remote cuda:1 memory looked up as device 0) while the CPU run
(both sides device 0) passed - as tandem's NIXL backend does, via KVRegion.device.
"""

from __future__ import annotations

import os
import statistics
import time
import traceback

MIB = 1 << 20
BLOCK = 64 << 10  # one (layer, page) block of the Llama-3.1-8B shape at page_size 16


class RawNixl:
    """Worker side. Expects `self.device`, `self.role`, `self.keep`, `self.log` (BenchWorker)."""

    raw: dict

    def _dev(self) -> tuple[str, int]:
        if self.device.startswith("cuda"):
            return "VRAM", int(self.device.split(":")[1]) if ":" in self.device else 0
        return "DRAM", 0

    def raw_setup(self, tag: str, nbytes: int, prog_thread: bool) -> tuple[bytes, int, str, int]:
        """An agent + a registered buffer; returns (agent metadata, buffer address, memory type,
        device id): what the peer's descriptors of this buffer must say."""
        import torch
        from nixl._api import nixl_agent, nixl_agent_config

        if not hasattr(self, "raw"):
            self.raw = {}
        name = f"raw-{self.role}-{tag}-{os.getpid()}"
        agent = nixl_agent(name, nixl_agent_config(enable_prog_thread=prog_thread,
                                                   backends=["UCX"]))
        buf = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        self.keep.append(buf)
        mem, dev = self._dev()
        agent.register_memory([(buf.data_ptr(), nbytes, dev, "")], mem)
        self.raw[tag] = {"agent": agent, "base": buf.data_ptr(), "nbytes": nbytes, "peer": None,
                         "remote_base": 0, "remote_mem": mem, "remote_dev": dev, "lists": {},
                         "inbox": []}
        return agent.get_agent_metadata(), buf.data_ptr(), mem, dev

    def raw_connect(self, tag: str, metadata: bytes, remote_base: int, remote_mem: str,
                    remote_dev: int) -> None:
        r = self.raw[tag]
        peer = r["agent"].add_remote_agent(metadata)
        r["peer"] = peer.decode() if isinstance(peer, bytes) else str(peer)
        r["remote_base"], r["remote_mem"], r["remote_dev"] = remote_base, remote_mem, remote_dev

    @staticmethod
    def _descs(base: int, blocks, block: int, dev: int):
        """[n, 3] uint64 (addr, len, device id) of `blocks` of `block` bytes at `base`."""
        import numpy as np

        blocks = np.asarray(blocks, dtype=np.uint64)
        out = np.empty((blocks.shape[0], 3), dtype=np.uint64)
        out[:, 0] = np.uint64(base) + blocks * np.uint64(block)
        out[:, 1], out[:, 2] = block, dev
        return out

    def raw_write(self, tag: str, nbytes: int, block: int, method: str, warmup: int,
                  repeats: int, timeout_s: float) -> dict:
        """`_raw_write`, with the NIXL error (type and text) leading the message on failure."""
        try:
            return self._raw_write(tag, nbytes, block, method, warmup, repeats, timeout_s)
        except Exception as e:
            r = self.raw[tag]
            raise RuntimeError(
                f"{type(e).__name__}: {e} (local {self._dev()} base {r['base']:#x}, remote "
                f"{r['remote_mem']} dev {r['remote_dev']} base {r['remote_base']:#x}, "
                f"{nbytes} B in {block} B blocks, {method})") from e

    def _raw_write(self, tag: str, nbytes: int, block: int, method: str, warmup: int,
                   repeats: int, timeout_s: float) -> dict:
        """`nbytes` in descriptors of `block` bytes (scattered when more than one)."""
        import numpy as np

        r = self.raw[tag]
        agent, peer = r["agent"], r["peer"]
        mem, dev = self._dev()
        rmem, rdev = r["remote_mem"], r["remote_dev"]
        n = nbytes // block
        rng = np.random.default_rng(n)
        src_blocks = rng.permutation(n) if n > 1 else np.zeros(1, dtype=np.int64)
        dst_blocks = rng.permutation(n) if n > 1 else np.zeros(1, dtype=np.int64)
        if method == "prepped":
            key = (nbytes, block)
            if key not in r["lists"]:  # prepared once: one descriptor per block of the region
                r["lists"][key] = (
                    agent.prep_xfer_dlist("NIXL_INIT_AGENT",
                                          self._descs(r["base"], np.arange(n), block, dev), mem),
                    agent.prep_xfer_dlist(peer, self._descs(r["remote_base"], np.arange(n),
                                                            block, rdev), rmem))
            local, remote = r["lists"][key]
            src_idx, dst_idx = src_blocks.astype(np.int32), dst_blocks.astype(np.int32)
        build, total = [], []
        for i in range(warmup + repeats):
            t0 = time.perf_counter()
            if method == "prepped":
                h = agent.make_prepped_xfer("WRITE", local, src_idx, remote, dst_idx, b"")
            else:  # descriptors built for every transfer, as a plain client would
                h = agent.initialize_xfer(
                    "WRITE",
                    agent.get_xfer_descs(self._descs(r["base"], src_blocks, block, dev), mem),
                    agent.get_xfer_descs(self._descs(r["remote_base"], dst_blocks, block, rdev),
                                         rmem),
                    peer, b"")
            t1 = time.perf_counter()
            state = agent.transfer(h)
            end = t1 + timeout_s
            while state == "PROC":
                state = agent.check_xfer_state(h)
                if time.perf_counter() > end:
                    h.release()
                    raise TimeoutError(f"raw write {nbytes} B / {block} B: not DONE in "
                                       f"{timeout_s}s")
            t2 = time.perf_counter()
            h.release()
            if state != "DONE":
                raise RuntimeError(f"raw write {nbytes} B / {block} B: state {state}")
            if i >= warmup:
                build.append(t1 - t0)
                total.append(t2 - t0)
        med = statistics.median(total)
        return {"descs": n, "median_ms": med * 1e3, "best_ms": min(total) * 1e3,
                "build_ms": statistics.median(build) * 1e3, "gbps": nbytes / med / 1e9,
                "best_gbps": nbytes / min(total) / 1e9, "runs": len(total)}

    def raw_ping(self, tag: str, n: int, timeout_s: float) -> dict:
        """Round trips of send_notif ping -> pong (the peer runs raw_echo meanwhile)."""
        r = self.raw[tag]
        agent, peer = r["agent"], r["peer"]
        rtts = []
        end = time.perf_counter() + timeout_s
        for i in range(n):
            t0 = time.perf_counter()
            agent.send_notif(peer, b"ping")
            while not any(m == b"pong" for ms in agent.get_new_notifs().values() for m in ms):
                if time.perf_counter() > end:
                    raise TimeoutError(f"no pong after {i} of {n} pings")
            rtts.append(time.perf_counter() - t0)
        rtts.sort()
        return {"n": n, "median_us": rtts[len(rtts) // 2] * 1e6, "best_us": rtts[0] * 1e6}

    def raw_progress(self) -> None:
        """Called whenever the worker idles: without a progress thread, a write INTO this
        process (over TCP/shared memory; not cuda_ipc) moves only while it calls into NIXL."""
        for r in getattr(self, "raw", {}).values():
            for ms in r["agent"].get_new_notifs().values():
                r["inbox"].extend(ms)

    def raw_echo(self, tag: str, n: int, timeout_s: float) -> int:
        r = self.raw[tag]
        agent, peer = r["agent"], r["peer"]
        answered = 0
        end = time.perf_counter() + timeout_s
        while answered < n and time.perf_counter() < end:
            msgs, r["inbox"] = r["inbox"], []  # pings that came while idle first
            for ms in agent.get_new_notifs().values():
                msgs.extend(ms)
            for m in msgs:
                if m == b"ping":
                    agent.send_notif(peer, b"pong")
                    answered += 1
        return answered

    def raw_close(self) -> None:
        for r in getattr(self, "raw", {}).values():
            for lists in r["lists"].values():
                for h in lists:
                    try:
                        h.release()
                    except Exception:  # best effort at the end
                        pass
        self.raw = {}


def run_raw(bench, a, b, sizes_mib: list[int], quick: bool) -> dict:
    """Parent side: rows of raw writes and pings; each case fails alone (traceback kept)."""
    out: dict = {"rows": [], "pings": {}, "errors": []}
    warmup, repeats = (1, 3) if quick else (2, 8)
    cap = max(sizes_mib) * MIB
    tags = {"np": False, "pt": True}  # no progress thread (tandem's default) / with it
    for tag, thread in tags.items():
        try:
            setup_b = b.call("raw_setup", tag, cap if tag == "np" else 64 * MIB, thread,
                             timeout=60)
            setup_a = a.call("raw_setup", tag, cap if tag == "np" else 64 * MIB, thread,
                             timeout=60)
            a.call("raw_connect", tag, *setup_b, timeout=30)
            b.call("raw_connect", tag, *setup_a, timeout=30)
        except Exception:
            out["errors"].append(f"raw setup {tag}:\n{traceback.format_exc()}")
            bench.say(f"raw NIXL setup ({tag}) FAILED:\n{traceback.format_exc()}")
            continue
        n_ping = 10 if thread else 200
        try:
            b.submit("raw_echo", tag, n_ping, 20.0)
            ping = a.call("raw_ping", tag, n_ping, 15.0, timeout=30)
            b.result("raw_echo", 30)
            out["pings"][tag] = ping
            bench.say(f"  raw notif round trip, progress thread {'on' if thread else 'off'}: "
                      f"median {ping['median_us']:.1f} us")
        except Exception:
            out["errors"].append(f"raw ping {tag}:\n{traceback.format_exc()}")
            bench.say(f"  raw ping ({tag}) FAILED")
        cases = ([(s, s * MIB, m) for s in sizes_mib for m in ("init", "prepped")]
                 + [(s, BLOCK, m) for s in sizes_mib for m in ("init", "prepped")]
                 if tag == "np" else [(64, 64 * MIB, "init"), (64, BLOCK, "prepped")])
        for size_mib, block, method in cases:
            label = (f"raw {size_mib} MiB x1" if block == size_mib * MIB
                     else f"raw {size_mib} MiB x{size_mib * MIB // block} scattered")
            row = {"case": label, "method": method, "progress_thread": thread,
                   "nbytes": size_mib * MIB, "mib": size_mib, "block": block}
            out["rows"].append(row)
            if bench.elapsed() > bench.args.budget_s:
                row["skipped"] = "time budget spent"
                continue
            try:
                row.update(a.call("raw_write", tag, size_mib * MIB, block, method, warmup,
                                  repeats, 20.0, timeout=120))
                bench.say(f"  {label} {method} (thread {'on' if thread else 'off'}): "
                          f"{row['median_ms']:.3f} ms = {row['gbps']:.1f} GB/s (build "
                          f"{row['build_ms']:.3f} ms)")
            except Exception as e:  # this case only
                row["error"] = error_line(e)
                out["errors"].append(f"{label} {method}:\n{traceback.format_exc()}")
                bench.say(f"  {label} {method}: FAILED {row['error'][:300]}")
                if "WorkerDead" in type(e).__name__:
                    raise
    return out


def error_line(e: BaseException) -> str:
    """The line that says what went wrong: a worker's error arrives as "<role>.<method> failed:"
    + its whole traceback, whose LAST line is the exception (NIXL's error type and text)."""
    lines = [ln.strip() for ln in str(e).strip().splitlines() if ln.strip()]
    return lines[-1] if lines else type(e).__name__


def raw_best_gbps(raw: dict) -> float:
    """The best measured raw rate (median of a row) with the progress thread off: the link."""
    rates = [r["gbps"] for r in raw.get("rows", []) if "gbps" in r and not r["progress_thread"]]
    return max(rates, default=0.0)


def print_raw(raw: dict) -> None:
    if not raw:
        return
    print(f"{'raw NIXL case':34} {'method':8} {'thread':6} {'descs':>6} {'median ms':>10} "
          f"{'GB/s':>8} {'best GB/s':>9} {'build ms':>9}")
    for r in raw.get("rows", []):
        if "gbps" in r:
            nums = (f"{r['median_ms']:10.3f} {r['gbps']:8.1f} {r['best_gbps']:9.1f} "
                    f"{r['build_ms']:9.3f}")
        else:
            nums = f"{(r.get('error') or r.get('skipped') or 'no data')[:120]}"
        print(f"{r['case']:34} {r['method']:8} {'on' if r['progress_thread'] else 'off':6} "
              f"{r.get('descs', r['nbytes'] // r['block']):6d} {nums}")
    for tag, p in raw.get("pings", {}).items():
        print(f"send_notif round trip, progress thread {'on' if tag == 'pt' else 'off'}: "
              f"median {p['median_us']:.1f} us (best {p['best_us']:.1f})")
