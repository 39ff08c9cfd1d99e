"""What the speculative engine's host work adds to a step, on the CPU (issue 22), with a tiny
one-layer model so that the forward is short and the host's share shows. Two engines over one
model hold the same batch and take turns in blocks of a few steps, the order alternating, so
the machine's drift cancels; printed: the median per-step difference of each pair.

- `regime`: `SpecEngine` with an adaptive policy that prices plain steps far below rounds
  (its plain regime), against `LLMEngine` -- what the plain regime adds to a plain step;
- `rounds`: `SpecEngine` with an adaptive policy that prices rounds far below plain steps,
  against `SpecEngine` drafting a fixed k -- what the policy adds to a round.

    python benchmarks/host_blocks.py [--batches 4,16,48] [--pairs 30]

Session 26 (this VM): the regime +45 / +82 us a step at batch 4 / 48 before `plain_held`,
+10-30 / +14-38 after; adaptive rounds +45-65 / +120 us at batch 4 / 16 over fixed-k rounds
before that session's cuts, +43-78 / +78-123 after. The medians move by up to +-40 us from
run to run; and the adaptive engine tries each unserved k for 16 rounds, so its rounds are
not all of the fixed engine's k.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import torch  # noqa: E402
from spec_helpers import engine_cfg, tiny_head, tiny_target  # noqa: E402

from tandem.engine import LLMEngine, SamplingParams  # noqa: E402
from tandem.spec import SpecConfig, SpecEngine  # noqa: E402
from tandem.spec.adaptive import AdaptivePolicy, StepCostTable  # noqa: E402

MS = 1e-3
K = 3


def table(plain_ms: float) -> StepCostTable:
    """Rounds of every k at 1-2 ms; plain steps at `plain_ms` (0.1: plain wins, 50: rounds)."""
    return StepCostTable(batch_sizes=(1, 64), seconds=((1 * MS,) * (K + 1), (2 * MS,) * (K + 1)),
                         plain=(plain_ms * MS, 2 * plain_ms * MS))


def paired_us(a: LLMEngine, b: LLMEngine, batch: int, pairs: int, steps: int) -> float:
    """Median over `pairs` of (a's ms a step - b's) over blocks of `steps`, in us."""
    params = SamplingParams(max_new_tokens=1 << 20, ignore_eos=True)
    ids = {e: [e.add_request(list(range(1, 20)), params) for _ in range(batch)] for e in (a, b)}
    for e in (a, b):
        for _ in range(5):
            e.step()
    diffs = []
    for i in range(pairs):
        took = {}
        for e in (a, b) if i % 2 else (b, a):
            t0 = time.perf_counter()
            for _ in range(steps):
                e.step()
            took[e] = (time.perf_counter() - t0) / steps
        diffs.append(took[a] - took[b])
    for e, rids in ids.items():
        for r in rids:
            e.abort(r)
        while e.has_unfinished():
            e.step()
    return statistics.median(diffs) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="4,16,48")
    ap.add_argument("--pairs", type=int, default=30)
    ap.add_argument("--steps", type=int, default=5, help="steps per block")
    args = ap.parse_args()
    torch.set_num_threads(1)
    model = tiny_target(num_layers=1, max_position=8192)
    head = tiny_head(model, max_position=8192)
    cfg = engine_cfg(num_pages=8192, max_num_seqs=64, max_num_batched_tokens=4096,
                     page_size=16, max_model_len=8192)
    spec = SpecConfig(num_steps=K)
    plain = LLMEngine(cfg, model)
    regime = SpecEngine(cfg, spec, model, head, policy=AdaptivePolicy(table=table(0.1), max_k=K))
    fixed = SpecEngine(cfg, spec, model, head)
    adaptive = SpecEngine(cfg, spec, model, head,
                          policy=AdaptivePolicy(table=table(50.0), max_k=K))
    with torch.inference_mode():
        for b in (int(x) for x in args.batches.split(",")):
            r = paired_us(regime, plain, b, args.pairs, args.steps)
            a = paired_us(adaptive, fixed, b, args.pairs, args.steps)
            print(f"batch {b}: the plain regime over the plain engine {r:+.1f} us a step; "
                  f"adaptive rounds over fixed-k rounds {a:+.1f} us a step", flush=True)


if __name__ == "__main__":
    main()
