"""Whether the adaptive engine's plain regime steps slower than the plain engine (issue 22),
measured so that the host's drift cancels: every engine holds the same batch at once, and
they take turns in short blocks of whole steps (20 by default, ~25-100 ms), so a block of
one is compared with the next block of the others, not with a run seconds away. On the GPU
hosts lent so far the host's own speed moves by up to 2x within a minute (session 26: a
pure-Python probe 0.6-1.2 ms on one pinned core), far more than the gap sought (~5%).

Engines, all over one model unless named otherwise (SmolLM2's shape, dummy bf16 by default):
- plain, plain2: `LLMEngine` twice -- the control: their ratio must come out 1.00;
- capture: `LLMEngine` with what the speculative engine adds to its plain steps (the draft
  head's KV group in the pool, decode graphs that keep the feature layers' streams);
- regime: `SpecEngine` (adaptive) held in its plain regime, over the same model;
- regime_own: the same over its own copy of the weights (`SpecEngine.from_config`, as
  `gpu_spec_chat.py` builds its adaptive engine).

    source benchmarks/gpu_env.sh; PYTHONUNBUFFERED=1 python3 benchmarks/gpu_step_blocks.py \
        --out $OUT [--model /tmp/gc/smollm2] [--batches 16,48] [--rotations 40]

    python3 benchmarks/gpu_step_blocks.py --device cpu --out /tmp/sb   # CPU: the logic only
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

import torch  # noqa: E402

from tandem.engine import LLMEngine, SamplingParams  # noqa: E402
from tandem.spec import SpecConfig, SpecEngine  # noqa: E402
from tandem.spec.draft_runner import draft_kv_group  # noqa: E402
from tandem.spec.shipped import SHIPPED_HEADS  # noqa: E402
from gpu_plain_regime import engine_config, sync  # noqa: E402  (benchmarks/ on sys.path)


def block_ms(eng: LLMEngine, steps: int) -> float:
    """ms per step of `steps` whole steps back to back (the block ends on a sync, as it
    starts: each engine's overlap pipeline refills in its own block alike)."""
    sync(eng.device)
    t0 = time.perf_counter()
    for _ in range(steps):
        eng.step()
    sync(eng.device)
    return (time.perf_counter() - t0) * 1e3 / steps


def measure(engines: dict[str, LLMEngine], batch: int, steps: int, rotations: int) -> dict:
    """Every engine holds `batch` requests; `rotations` rounds of one block each, the order
    rotated each round. -> per engine: median ms/step, and its ratio to plain's block of the
    same round (median, min, max)."""
    params = SamplingParams(max_new_tokens=1 << 20, ignore_eos=True)
    ids = {n: [e.add_request(list(range(10, 70)), params) for _ in range(batch)]
           for n, e in engines.items()}
    for e in engines.values():  # prompts in, graphs warm
        for _ in range(10):
            e.step()
    names = list(engines)
    blocks: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rotations):
        k = r % len(names)
        for n in names[k:] + names[:k]:
            blocks[n].append(block_ms(engines[n], steps))
    for n, e in engines.items():
        for i in ids[n]:
            e.abort(i)
        while e.has_unfinished():
            e.step()
    out = {}
    for n in names:
        ratios = [a / b for a, b in zip(blocks[n], blocks["plain"])]
        out[n] = {"ms": statistics.median(blocks[n]), "ratio_median": statistics.median(ratios),
                  "ratio_mean": statistics.fmean(ratios), "ratio_min": min(ratios),
                  "ratio_max": max(ratios), "blocks_ms": blocks[n]}
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", type=Path, default=Path("results"))
    ap.add_argument("--batches", default="16,48")
    ap.add_argument("--steps", type=int, default=20, help="steps per block")
    ap.add_argument("--rotations", type=int, default=40)
    ap.add_argument("--engines", default="plain,plain2,capture,regime,regime_own")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    gpu = args.device == "cuda"
    cfg = engine_config(args.model, args.device, kv_gib=2)
    import tandem.spec.adaptive as adaptive

    wanted = args.engines.split(",")
    spec_cfg = SpecConfig(draft_model=str(SHIPPED_HEADS["default"]), num_steps=4,
                          adaptive=True)
    res: dict = {"env": {"device": torch.cuda.get_device_name() if gpu else "cpu",
                         "model": args.model, "date": time.strftime("%Y-%m-%d"),
                         "steps_per_block": args.steps, "rotations": args.rotations}}
    held = adaptive.AdaptivePolicy.plain_wins
    with torch.inference_mode():
        base = SpecEngine.from_config(cfg, spec_cfg)  # the model and head everybody shares
        model, head = base.model, base.head
        engines: dict[str, LLMEngine] = {"plain": LLMEngine(cfg, model, base.tokenizer)}
        for name in wanted:
            if name == "plain2":
                engines[name] = LLMEngine(cfg, model, base.tokenizer)
            elif name == "capture":
                engines[name] = LLMEngine(cfg, model, base.tokenizer,
                                          extra_kv_groups=[draft_kv_group(head)],
                                          graph_capture_layers=head.cfg.feature_layers)
            elif name == "regime":
                engines[name] = SpecEngine(cfg, spec_cfg, model, head, base.tokenizer)
            elif name == "regime_own":
                engines[name] = base
        del base
        adaptive.AdaptivePolicy.plain_wins = lambda self, *a, **k: True  # the plain regime
        try:
            for b in (int(x) for x in args.batches.split(",")):
                res[f"b{b}"] = row = measure(engines, b, args.steps, args.rotations)
                print(f"batch {b}, {args.rotations} rotations of {args.steps}-step blocks: "
                      + "; ".join(f"{n} {v['ms']:.3f} ms, x{v['ratio_median']:.3f} "
                                  f"(mean {v['ratio_mean']:.3f}, {v['ratio_min']:.2f}-"
                                  f"{v['ratio_max']:.2f})" for n, v in row.items()),
                      flush=True)
        finally:
            adaptive.AdaptivePolicy.plain_wins = held
    (args.out / "gpu_step_blocks.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
