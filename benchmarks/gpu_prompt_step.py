"""What a step that prefills arriving prompts costs, host and GPU, plain and speculative.

The real-weights sweep (benchmarks/gpu_chat_sweep.sh) found each step right after a prompt
arrived costing ~15-20 ms on SmolLM2 (a decode step: ~0.7 ms), and the speculative engines
taking twice as many such steps as the plain one at c=4 and c=16 (their requests finish at
staggered steps, so arrivals bunch less). This times those steps directly, on dummy bf16
SmolLM2 weights: the plain engine and the speculative one, 1 and 8 prompts of 60 tokens
arriving next to 0 or 15 decoding requests; wall ms per step (median), the same step's eager
forward alone, and a cProfile of one case's steps for each engine (host time by function;
`--cprofile`, default the 1-prompt step alone).

    source benchmarks/gpu_env.sh; python3 benchmarks/gpu_prompt_step.py --out $OUT   # 1 GPU
"""

from __future__ import annotations

import argparse
import cProfile
import gzip
import io
import json
import pstats
import statistics
import sys
import time
import traceback
import warnings
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parent)]
import gpu_spec  # noqa: E402  (its engine builders)

from tandem.engine import LLMEngine, SamplingParams  # noqa: E402
from tandem.engine.loader import DTYPES  # noqa: E402
from tandem.spec import DraftHeadConfig, SpecConfig, SpecEngine, dummy_head  # noqa: E402


def sync() -> None:
    if gpu_spec.DEV.type == "cuda":
        torch.cuda.synchronize()


def arrival_ms(eng, arriving: int, decoding: int, reps: int, prof: cProfile.Profile | None,
               prompt_len: int = 60, trace: Path | None = None,
               syncs: list | None = None) -> float:
    """Median wall ms of the step that takes `arriving` new `prompt_len`-token prompts while
    `decoding` requests decode (the decoding ones started earlier and are past their prompts).
    `trace`: the last such step under torch.profiler (CPU + CUDA), its op tables written to
    `trace`.txt and its timeline to `trace`.json.gz (chrome://tracing, Perfetto). `syncs`: the
    last step runs again untimed under `torch.cuda.set_sync_debug_mode`, each host-device
    synchronisation appended as (message, innermost tandem frames).
    (arriving = 0: a decode step of the `decoding` requests.)"""
    g = torch.Generator().manual_seed(0)
    params = SamplingParams(max_new_tokens=4096, ignore_eos=True)
    times = []
    for rep in range(reps + 2):
        for rid in list(eng.scheduler.requests):
            eng.abort(rid)
        eng.step()
        for _ in range(decoding):
            eng.add_request(torch.randint(3, 4000, (60,), generator=g).tolist(), params)
        for _ in range(4):  # past their prompts, decoding
            eng.step()
        for _ in range(arriving):
            eng.add_request(torch.randint(3, 4000, (prompt_len,), generator=g).tolist(), params)
        sync()
        if prof is not None and rep >= 2:
            prof.enable()
        tprof = None
        if trace is not None and rep == reps + 1:
            acts = [torch.profiler.ProfilerActivity.CPU]
            if gpu_spec.DEV.type == "cuda":
                acts.append(torch.profiler.ProfilerActivity.CUDA)
            tprof = torch.profiler.profile(activities=acts)
            tprof.start()
        t0 = time.perf_counter()
        eng.step()
        sync()
        times.append((time.perf_counter() - t0) * 1e3)
        if prof is not None:
            prof.disable()
        if tprof is not None:
            tprof.stop()
            write_trace(tprof, trace, times[-1])
    if syncs is not None and gpu_spec.DEV.type == "cuda":
        for _ in range(arriving):
            eng.add_request(torch.randint(3, 4000, (prompt_len,), generator=g).tolist(), params)
        sync()
        syncs.extend(synced_in(eng.step))
    for rid in list(eng.scheduler.requests):
        eng.abort(rid)
    eng.step()
    return statistics.median(times[2:])


def synced_in(fn) -> list[tuple[str, tuple[str, ...]]]:
    """Every host-device synchronisation `fn()` makes (torch's sync debug mode): its warning's
    first line and the innermost tandem frames of the Python stack that made it."""
    found = []

    def record(message, category, filename, lineno, file=None, line=None) -> None:
        frames = [f for f in traceback.extract_stack()[:-1] if "/tandem/" in f.filename]
        found.append((str(message).splitlines()[0][:80], tuple(
            f"{'/'.join(Path(f.filename).parts[-2:])}:{f.lineno} {f.name}" for f in frames[-5:])))

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    return found


def write_trace(tprof, trace: Path, wall_ms: float) -> None:
    """The profiled step's ops by device time and by host time (self), and its timeline."""
    avg = tprof.key_averages()
    dev = "self_cuda_time_total" if gpu_spec.DEV.type == "cuda" else "self_cpu_time_total"
    text = (f"step wall {wall_ms:.3f} ms\n\n== by self device time\n"
            + avg.table(sort_by=dev, row_limit=40)
            + "\n== by self host time\n" + avg.table(sort_by="self_cpu_time_total", row_limit=40))
    trace.with_suffix(".txt").write_text(text)
    raw = trace.with_suffix(".json")
    tprof.export_chrome_trace(str(raw))
    with open(raw, "rb") as src, gzip.open(str(raw) + ".gz", "wb") as dst:
        dst.write(src.read())
    raw.unlink()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=Path("results"))
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--device", default="cuda", help="cpu: a dry run of the script's logic")
    ap.add_argument("--model", default="smollm2-135m", help="a preset (dummy bf16 weights)")
    ap.add_argument("--prompt-len", type=int, default=60)
    ap.add_argument("--cases", default="1,0;8,0;1,15;8,8",
                    help="arriving,decoding pairs, ';'-separated")
    ap.add_argument("--trace", default="",
                    help="arriving,decoding: that case's last timed step under torch.profiler "
                         "(OUT/trace_<engine>_<a>_<d>.txt and .json.gz)")
    ap.add_argument("--cprofile", default="1,0",
                    help="arriving,decoding: that case's steps under cProfile, every engine "
                         "(OUT/prompt_step_profiles.txt)")
    ap.add_argument("--syncs", action="store_true",
                    help="each case's step once more under torch's sync debug mode: where it "
                         "waits for the GPU (OUT/syncs.txt)")
    ap.add_argument("--engines", default="plain,spec",
                    help="plain, spec, spec_m (spec with prompts merged into the round's "
                         "verify forward, TANDEM_MERGED_ARRIVALS), adaptive (k per step; "
                         "with the dummy head it settles in the plain regime)")
    args = ap.parse_args()
    gpu_spec.DEV = torch.device(args.device)
    args.out.mkdir(parents=True, exist_ok=True)
    kv = (8 << 30) if "8b" in args.model else (2 << 30)
    cfg = gpu_spec.engine_cfg(args.model, "bfloat16", "flashinfer", True, 1024, kv)
    model, _ = gpu_spec.build_target_and_head(cfg)
    head = dummy_head(DraftHeadConfig.like_target(model.cfg, "eagle", draft_vocab_size=8192),
                      model, DTYPES[cfg.dtype], gpu_spec.DEV, cfg.max_model_len)
    def merged() -> SpecEngine:  # prompts merged into the round's verify forward
        eng = SpecEngine(cfg, SpecConfig(num_steps=4), model, head)
        eng.merge_arrivals = True
        return eng

    makers = {"plain": lambda: LLMEngine(cfg, model),
              "spec": lambda: SpecEngine(cfg, SpecConfig(num_steps=4), model, head),
              "spec_m": merged,
              "adaptive": lambda: SpecEngine(cfg, SpecConfig(num_steps=4, adaptive=True),
                                             model, head)}
    engines = {name: makers[name]() for name in args.engines.split(",")}
    cases = [tuple(int(x) for x in c.split(",")) for c in args.cases.split(";")]
    res: dict = {"device": torch.cuda.get_device_name() if gpu_spec.DEV.type == "cuda" else "cpu",
                 "torch": torch.__version__}
    profiles, sync_text = io.StringIO(), io.StringIO()
    for name, eng in engines.items():
        for arriving, decoding in cases:
            prof = (cProfile.Profile() if args.cprofile == f"{arriving},{decoding}"
                     else None)
            trace = (args.out / f"trace_{name}_{arriving}_{decoding}"
                     if args.trace == f"{arriving},{decoding}" else None)
            syncs: list | None = [] if args.syncs else None
            ms = arrival_ms(eng, arriving, decoding, args.reps, prof, args.prompt_len, trace,
                            syncs)
            if syncs is not None:
                sync_text.write(f"\n== {name}, {arriving} arriving next to {decoding} "
                                f"decoding: {len(syncs)} syncs\n")
                for msg, frames in syncs:
                    sync_text.write(f"- {msg}\n    " + "\n    ".join(frames) + "\n")
            res[f"{name} arrive={arriving} decoding={decoding}"] = ms
            print(f"{name:6s} {arriving} arriving next to {decoding:2d} decoding: {ms:7.2f} ms",
                  flush=True)
            if prof is not None:
                stats = pstats.Stats(prof, stream=profiles)
                profiles.write(f"\n== {name}, {arriving} arriving next to {decoding} decoding, "
                               f"{args.reps} steps\n")
                stats.sort_stats("tottime").print_stats(35)
                stats.sort_stats("cumulative").print_stats(50)
    (args.out / "gpu_prompt_step.json").write_text(json.dumps(res, indent=1))
    (args.out / "prompt_step_profiles.txt").write_text(profiles.getvalue())
    if args.syncs:
        (args.out / "syncs.txt").write_text(sync_text.getvalue())
        print(sync_text.getvalue())


if __name__ == "__main__":
    with torch.inference_mode():
        main()
