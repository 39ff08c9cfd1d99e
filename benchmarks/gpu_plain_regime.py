"""Why the adaptive engine's plain regime decodes slower than the plain engine on a GPU (issue
22): the same model, `LLMEngine.step` next to `SpecEngine.step` held in the plain regime, whole
steps back to back at batch 1 / 4 / 16, with and without a profiler; then the adaptive cost
table profiled three times in a row (how much its entries move from run to run).
`--kernels 50`: also the GPU kernel time per step of each at batch 50 (torch.profiler): served
at c=50 (session 18) the plain regime's steps took 1.38 ms against plain's 1.22.

On the device machine (one GPU), from the repository root:

    source benchmarks/gpu_env.sh; PYTHONUNBUFFERED=1 python3 benchmarks/gpu_plain_regime.py \
        --out $OUT [--model /tmp/gc/smollm2]      # default: SmolLM2's shape, dummy bf16

    python3 benchmarks/gpu_plain_regime.py --device cpu --out /tmp/pr   # CPU: the logic only
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

import torch  # noqa: E402

from tandem.engine import EngineConfig, LLMEngine, SamplingParams  # noqa: E402
from tandem.spec import SpecConfig, SpecEngine  # noqa: E402
from tandem.spec.shipped import SHIPPED_HEADS  # noqa: E402


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def engine_config(model: str, device: str, kv_gib: int) -> EngineConfig:
    """SmolLM2 (a directory: its weights; else a preset's shape, dummy weights) for 64
    requests: bf16, FlashInfer and graphs on the GPU, float32 torch attention on the CPU."""
    gpu = device == "cuda"
    return EngineConfig(model=model, load_format="auto" if Path(model).is_dir() else "dummy",
                        device=device, dtype="bfloat16" if gpu else "float32",
                        attention_backend="flashinfer" if gpu else "torch", cuda_graphs=gpu,
                        max_num_seqs=64, max_model_len=2048,
                        kv_cache_bytes=(kv_gib << 30) if gpu else (kv_gib << 26))


def cpu_probe_ms() -> float:
    """A fixed piece of pure Python (best of 5): whether the host itself runs slower now."""
    data = [list(range(i % 7)) for i in range(20000)]
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        sum(len(x) for x in data)
        best = min(best, (time.perf_counter() - t0) * 1e3)
    return best


def timed(eng, batch: int, steps: int, profile: bool) -> dict:
    """Median ms of `steps` whole steps back to back over `batch` fresh requests (3 runs)."""
    params = SamplingParams(max_new_tokens=1 << 20, ignore_eos=True)
    ids = [eng.add_request(list(range(10, 40)), params) for _ in range(batch)]
    for _ in range(10):
        eng.step()
    runs, text = [], ""
    for i in range(3):
        prof = cProfile.Profile() if profile and i == 2 else None
        sync(eng.device)
        t0 = time.perf_counter()
        if prof:
            prof.enable()
        for _ in range(steps):
            eng.step()
        sync(eng.device)
        if prof:
            prof.disable()
            s = io.StringIO()
            pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(14)
            text = s.getvalue()
        else:
            runs.append((time.perf_counter() - t0) * 1e3 / steps)
    for i in ids:
        eng.abort(i)
    while eng.has_unfinished():
        eng.step()
    return {"ms": statistics.median(runs), "runs": runs, "overlap": eng.overlap,
            "profile": text, "cpu_probe_ms": cpu_probe_ms()}


def kernel_table(eng, batch: int, steps: int) -> tuple[float, str]:
    """GPU kernel time per step (us, torch.profiler) over `steps` steps at `batch`, and the
    top kernels: whether the two engines' plain steps differ on the device, not the host."""
    from torch.profiler import ProfilerActivity, profile

    params = SamplingParams(max_new_tokens=1 << 20, ignore_eos=True)
    ids = [eng.add_request(list(range(10, 70)), params) for _ in range(batch)]
    for _ in range(10):
        eng.step()
    sync(eng.device)
    act = ProfilerActivity.CUDA if eng.device.type == "cuda" else ProfilerActivity.CPU
    with profile(activities=[act]) as prof:
        for _ in range(steps):
            eng.step()
        sync(eng.device)
    for i in ids:
        eng.abort(i)
    while eng.has_unfinished():
        eng.step()
    avg = prof.key_averages()
    total = sum(e.self_device_time_total for e in avg) / steps
    return total, avg.table(sort_by="self_device_time_total", row_limit=18)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", type=Path, default=Path("results"))
    ap.add_argument("--batches", default="1,4,16")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--kernels", type=int, default=0,
                    help="also: GPU kernel time per step at this batch (torch.profiler)")
    ap.add_argument("--skip-tables", action="store_true", help="no cost-table reprofiling")
    ap.add_argument("--abab", action="store_true",
                    help="time each engine twice, alternating (a drift of the host over time "
                         "would show as the later run's cost)")
    ap.add_argument("--pairs", type=int, default=0,
                    help="then this many more timings of each engine, alternating which goes "
                         "first; prints the regime's step over plain's per pair")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    gpu = args.device == "cuda"
    cfg = engine_config(args.model, args.device, kv_gib=4)
    import tandem.spec.adaptive as adaptive
    from tandem.spec import cost_profile

    res: dict = {"env": {"device": torch.cuda.get_device_name() if gpu else "cpu",
                         "model": args.model, "date": time.strftime("%Y-%m-%d")}}
    with torch.inference_mode():
        spec = SpecEngine.from_config(cfg, SpecConfig(draft_model=str(SHIPPED_HEADS["default"]),
                                                      num_steps=4, adaptive=True))
        plain = LLMEngine(cfg, spec.model, spec.tokenizer)
        tables = [json.loads(spec.spec_scheduler.policy.table.to_json())]
        for _ in range(0 if args.skip_tables else 2):
            tables.append(json.loads(cost_profile.profile(spec, repeats=5 if gpu else 2)
                                     .to_json()))
        res["tables"] = tables
        held = adaptive.AdaptivePolicy.plain_wins
        adaptive.AdaptivePolicy.plain_wins = lambda self, *a, **k: True  # hold the plain regime
        try:
            for b in [int(x) for x in args.batches.split(",")]:
                row = {}
                order = [("plain", plain), ("spec_plain_regime", spec)]
                if args.abab:
                    order += [("plain_again", plain), ("spec_plain_regime_again", spec)]
                for name, eng in order:
                    row[name] = timed(eng, b, args.steps, profile=False)
                    row[name + "_profiled"] = timed(eng, b, args.steps // 2, profile=True)
                if args.pairs:  # unprofiled pairs, the order alternating: paired ratios
                    ratios = []
                    for i in range(args.pairs):
                        ms = {}
                        for name, eng in order[:2] if i % 2 == 0 else order[1::-1]:
                            ms[name] = timed(eng, b, args.steps, profile=False)["ms"]
                        ratios.append(ms["spec_plain_regime"] / ms["plain"])
                    pairs = ratios
                    print(f"batch {b}: the regime's step over plain's, {args.pairs} pairs: median "
                          f"{statistics.median(ratios):.3f} (" + " ".join(
                              f"{x:.3f}" for x in ratios) + ")", flush=True)
                print(f"batch {b}: CPU probe after each timing (ms): " + ", ".join(
                    f"{n} {r['cpu_probe_ms']:.2f}" for n, r in row.items()), flush=True)
                if args.abab:
                    print(f"batch {b} again: plain {row['plain_again']['ms']:.3f}, spec in the "
                          f"plain regime {row['spec_plain_regime_again']['ms']:.3f} ms/step",
                          flush=True)
                res[f"b{b}"] = row
                if args.pairs:
                    res[f"b{b}_pairs"] = pairs
                print(f"batch {b}: plain {row['plain']['ms']:.3f} ms/step (overlap "
                      f"{row['plain']['overlap']}), spec in the plain regime "
                      f"{row['spec_plain_regime']['ms']:.3f} ms/step (overlap "
                      f"{row['spec_plain_regime']['overlap']})", flush=True)
            if args.kernels:
                for name, eng in (("plain", plain), ("spec_plain_regime", spec)):
                    us, table = kernel_table(eng, args.kernels, 40)
                    res[f"kernels_b{args.kernels}_{name}"] = {"us_per_step": us, "table": table}
                    print(f"--- GPU kernels, batch {args.kernels}, {name}: {us:.1f} us/step\n"
                          f"{table}", flush=True)
        finally:
            adaptive.AdaptivePolicy.plain_wins = held
    (args.out / "gpu_plain_regime.json").write_text(json.dumps(res, indent=1))
    for t in tables:
        print("table (ms): " + "; ".join(
            f"b{b}: " + " ".join(f"{x * 1e3:.2f}" for x in row) + f" | {p * 1e3:.2f}"
            for b, row, p in zip(t["batch_sizes"], t["seconds"], t["plain"])))
    for b in args.batches.split(","):
        for name in ("plain", "spec_plain_regime"):
            text = res['b' + b][name + '_profiled']['profile']
            print(f"--- batch {b}, {name}, profiled:\n{text}")


if __name__ == "__main__":
    main()
