"""Host time of what a speculative round launches, with the GPU idle and with it busy.

A round's wall time exceeds its GPU time where the host cannot queue the next work in time:
either the host calls are slow, or some call waits for the GPU (a pageable copy, a hidden
sync). This times each call with time.perf_counter around it (no profiler: CUPTI itself makes
graph launches cost per node), first with the stream drained, then behind ~20 ms of queued
GPU work (`torch.cuda._sleep`): a call that waits for the GPU takes ~20 ms there.

    source benchmarks/gpu_env.sh; python3 benchmarks/gpu_host_cost.py --out $OUT   # 1 GPU
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parent)]
import gpu_spec  # noqa: E402  (its engine builders)

from tandem.spec import SpecConfig, SpecEngine  # noqa: E402
from tandem.spec.slices import verify_layout  # noqa: E402


def host_us(fn, busy: bool, n: int = 20) -> float:
    """Median host time (us) of fn() with the stream drained first, or behind queued work."""
    out = []
    for _ in range(n):
        torch.cuda.synchronize()
        if busy:
            torch.cuda._sleep(40_000_000)  # ~20 ms of GPU time queued ahead
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1e6)
    torch.cuda.synchronize()
    return statistics.median(out)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=Path("results"))
    ap.add_argument("--models", default="smollm2-135m,llama-3.1-8b")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    res: dict = {}
    for name in args.models.split(","):
        cfg = gpu_spec.engine_cfg(name, "bfloat16", "flashinfer", True, 1024, 4 << 30)
        model, _ = gpu_spec.build_target_and_head(cfg)
        vocab = 8192 if model.cfg.vocab_size < 100_000 else 32768
        from tandem.engine.loader import DTYPES
        from tandem.spec import DraftHeadConfig, dummy_head

        head = dummy_head(DraftHeadConfig.like_target(model.cfg, "eagle", draft_vocab_size=vocab),
                          model, DTYPES[cfg.dtype], gpu_spec.DEV, cfg.max_model_len)
        eng = SpecEngine(cfg, SpecConfig(num_steps=4), model, head)
        ids = gpu_spec._fill(eng, 1, 500, seed=1)
        g = eng.spec_graphs
        rows = g.bucket(1)
        req = eng.scheduler.requests[ids[0]]
        eng.step()  # latest verify / extend plans are of this bucket
        inp = eng.spec_scheduler.round_input([req]).draft
        verify = g.propose(inp)
        layout = verify_layout(verify, eng.cfg.page_size, gpu_spec.DEV, rows=rows)
        calls = {
            "step (whole round)": eng.step,
            "draft graph replay": lambda: g.replay_phase_only("propose", rows),
            "verify graph replay": lambda: g.replay_phase_only("verify", rows),
            "extend graph replay": lambda: g.replay_phase_only("extend", rows),
            "verify_layout": lambda: verify_layout(verify, eng.cfg.page_size, gpu_spec.DEV,
                                                   rows=rows),
            "verify plan": lambda: g._verify_planner.plan(layout.attn),
            "plain decode graph replay": lambda: eng.graphs.replay_only(rows),
            "round_input": lambda: eng.spec_scheduler.round_input([req]),
            "propose (copies + draft replay)": lambda: g.propose(inp),
        }
        row = {}
        for label, fn in calls.items():
            try:
                idle, busy = host_us(fn, False), host_us(fn, True)
                row[label] = {"idle_us": idle, "busy_us": busy}
                print(f"{name:14s} {label:34s} idle {idle:9.1f} us   busy {busy:9.1f} us",
                      flush=True)
            except Exception as exc:  # noqa: BLE001 -- one call's failure is a row
                row[label] = repr(exc)
                print(f"{name:14s} {label:34s} {exc!r}", flush=True)
            if label == "verify plan":
                g.verify(verify)  # the verify graph's bucket planned again
        res[name] = row
        for i in ids:
            eng.abort(i)
        (args.out / "gpu_host_cost.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
