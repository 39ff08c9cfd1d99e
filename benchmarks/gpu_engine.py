"""GPU engine benchmark: correctness against the torch reference first, then decode and
prefill timings next to the hardware floors measured in the same run.

On the device machine, from the repository root:

    source .devbundle/activate.sh; PYTHONPATH=. python3 benchmarks/gpu_engine.py --out $OUT

`--jit-only` builds FlashInfer's kernels (one process per head_dim, in parallel) and exits.
Prints a table last; writes every number to $OUT/gpu_engine.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "gpu")]

import torch  # noqa: E402

from tandem.engine import EngineConfig, LLMEngine, SamplingParams  # noqa: E402
from tandem.engine.attention import SeqSlice, build_metadata  # noqa: E402
from tandem.engine.kernels import kernel_policy  # noqa: E402
from tandem.engine.runner import ForwardBatch  # noqa: E402

DEV = torch.device("cuda")
RESULTS: dict = {}
OUT_DIR = Path("results")


def log(*args: object) -> None:
    print(f"[{time.strftime('%H:%M:%S')}]", *args, flush=True)


def save(out: Path) -> None:
    (out / "gpu_engine.json").write_text(json.dumps(RESULTS, indent=1, default=str))


def cuda_time_ms(fn, iters: int, warmup: int = 3) -> float:
    """Median of per-call device time over `iters` calls (events around each)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


# ---- ceilings -------------------------------------------------------------------------------

def measure_copy_bandwidth() -> float:
    """Bytes read + written per second of a 4 GiB device-to-device copy."""
    n = 4 << 30
    src = torch.randint(0, 255, (n,), dtype=torch.uint8, device=DEV)
    dst = torch.empty_like(src)
    ms = cuda_time_ms(lambda: dst.copy_(src), iters=10)
    del src, dst
    return 2 * n / (ms * 1e-3)


def gpu_state() -> dict[str, float]:
    """SM clock (MHz), temperature (C) and power (W) now: compute-bound numbers fall when the
    card throttles (seen on an H100 here: 86 C and GEMMs 2.4x slower late in a run)."""
    try:
        return {"sm_mhz": torch.cuda.clock_rate(), "temp_c": torch.cuda.temperature(),
                "power_w": torch.cuda.power_draw() / 1000}
    except Exception as exc:  # pynvml missing: the numbers just go unrecorded
        return {"error": repr(exc)}


def measure_matmul_rate() -> dict[str, float]:
    rates = {}
    for m, n, k in ((8192, 8192, 8192), (8192, 14336, 4096), (8192, 4096, 14336)):
        a = torch.randn(m, k, device=DEV).bfloat16()
        b = torch.randn(n, k, device=DEV).bfloat16()
        ms = cuda_time_ms(lambda: a @ b.t(), iters=10)
        rates[f"{m}x{n}x{k}"] = 2 * m * n * k / (ms * 1e-3)
    return rates


# ---- correctness ------------------------------------------------------------------------------

def check_attention() -> list[dict]:
    from cases import CASES, run_case

    rows = []
    for head_dim in (64, 128):
        for page_size in (1, 16):
            for case in CASES:
                r = run_case(case, page_size, head_dim, seed=page_size + head_dim)
                rows.append({**dataclasses.asdict(r), "ok": r.cache_equal and r.rel_err < 1e-2})
    return rows


def check_kernels() -> dict[str, float]:
    from tandem.engine.kernels import torch_ops, triton_ops
    from tandem.engine.layers.rotary import RotaryEmbedding

    g = torch.Generator(DEV).manual_seed(0)

    def rel(a, b):
        return float((a.float() - b.float()).norm() / b.float().norm())

    x = torch.randn(64, 4096, device=DEV, generator=g).bfloat16()
    r = torch.randn(64, 4096, device=DEV, generator=g).bfloat16()
    w = (1 + 0.1 * torch.randn(4096, device=DEV, generator=g)).bfloat16()
    out, s = triton_ops.add_rms_norm(x, r, w, 1e-5)
    ref_out, ref_s = torch_ops.add_rms_norm(x, r, w, 1e-5)
    res = {"add_rms_norm": rel(out, ref_out), "add_rms_norm_sum_exact": float(torch.equal(s, ref_s))}
    qkv = torch.randn(64, 48 * 128, device=DEV, generator=g).bfloat16()
    q, k = qkv[:, :4096].view(64, 32, 128), qkv[:, 4096:5120].view(64, 8, 128)
    rope = RotaryEmbedding(128, 8192, 500000.0, None).to(DEV)
    pos = torch.randint(0, 8192, (64,), device=DEV, generator=g)
    (q1, k1), (q2, k2) = (triton_ops.rotary(pos, q, k, rope.cos, rope.sin),
                          torch_ops.rotary(pos, q, k, rope.cos, rope.sin))
    res["rotary"] = max(rel(q1, q2), rel(k1, k2))
    cache = torch.randn(300, 2, 16, 8, 128, device=DEV, generator=g).bfloat16()
    ref = cache.clone()
    v = qkv[:, 5120:].view(64, 8, 128)
    slots = torch.randperm(299 * 16, device=DEV, generator=g)[:64] + 16
    triton_ops.store_kv(cache, k, v, slots)
    torch_ops.store_kv(ref, k, v, slots)
    res["store_kv_exact"] = float(torch.equal(cache, ref))
    gu = (2 * torch.randn(64, 28672, device=DEV, generator=g)).bfloat16()
    res["silu_and_mul"] = rel(triton_ops.silu_and_mul(gu), torch_ops.silu_and_mul(gu))
    from tandem.engine.kernels import triton_gemv

    wt = (0.02 * torch.randn(6144, 4096, device=DEV, generator=g)).bfloat16()
    xv = torch.randn(1, 4096, device=DEV, generator=g).bfloat16()
    nw = (1 + 0.1 * torch.randn(4096, device=DEV, generator=g)).bfloat16()
    res["gemv_vs_float64"] = rel(triton_gemv.gemv(xv, wt), xv.double() @ wt.double().t())
    res["gemv_norm_vs_float64"] = rel(
        triton_gemv.gemv(xv, wt, norm_weight=nw, eps=1e-5),
        torch_ops.fused_linear(xv.double(), wt.double(), nw.double(), 1e-5))
    res["cublas_vs_float64"] = rel(xv @ wt.t(), xv.double() @ wt.double().t())
    return res


def check_model_paths() -> dict[str, float]:
    """SmolLM2-shaped dummy model: FlashInfer + Triton vs the torch reference backend + torch
    kernels, same weights, same pages: ragged prefill, then one decode step."""
    from tandem.engine.attention.torch_ref import TorchReferenceBackend
    from tandem.engine.runner import ModelRunner

    eng = _engine("smollm2-135m", cuda_graphs=False, kv_bytes=256 << 20, max_len=1024)
    ref_pool = type(eng.kv_pool)(
        [g for g in [eng.kv_pool.specs["target"]]], eng.kv_pool.num_pages,
        eng.kv_pool.page_size, eng.kv_pool.dtype, DEV)
    ref = ModelRunner(eng.model, ref_pool, TorchReferenceBackend(DEV))
    lens = (50, 17, 90)
    pages = [eng.allocator.alloc(-(-(n + 2) // 16)) for n in lens]
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, eng.model_cfg.vocab_size, (n,), generator=g) for n in lens]
    out = {}
    phases = (("prefill", [0] * 3, list(lens), 3), ("decode", list(lens), [1] * 3, 3),
              ("decode_bs1_fused", [lens[0] + 1], [1], 1))
    for phase, cached, new, nseq in phases:
        slices = [SeqSlice(page_ids=p, num_cached=c, num_new=n)
                  for p, c, n in zip(pages[:nseq], cached, new)]
        lay = build_metadata(slices, 16, DEV)
        ids = torch.cat([pr[c : c + n] if phase == "prefill" else pr[-1:]
                         for pr, c, n in zip(prompts[:nseq], cached, new)]).to(DEV)
        ends = torch.tensor(new).cumsum(0) - 1
        batch = ForwardBatch(input_ids=ids, positions=lay.positions, attn=lay.attn,
                             logits_indices=ends.to(DEV))
        got = eng.runner.forward(batch).logits
        with kernel_policy(triton=False, gemv=False):
            want = ref.forward(batch).logits
        out[f"{phase}_rel_err"] = float((got - want).norm() / want.norm())
        out[f"{phase}_top1_agree"] = float((got.argmax(-1) == want.argmax(-1)).float().mean())
    return out


def check_greedy_graphs() -> dict[str, bool]:
    """Greedy generation with and without CUDA graphs, same dummy weights."""
    engines = {flag: _engine("smollm2-135m", cuda_graphs=flag, kv_bytes=512 << 20,
                             max_len=1024, max_seqs=8) for flag in (True, False)}
    res = {}
    for n in (1, 3, 4, 8):  # 3 runs in the graph of 4 (padding): informative, not asserted
        g = torch.Generator().manual_seed(n)
        prompts = [torch.randint(3, 49152, (5 + 11 * i,), generator=g).tolist() for i in range(n)]
        p = SamplingParams(max_new_tokens=64, ignore_eos=True)
        outs = [[c.output_ids for c in engines[f].generate(prompts, p)] for f in (True, False)]
        res[f"batch_{n}"] = outs[0] == outs[1]
    return res


# ---- timing -----------------------------------------------------------------------------------

def _engine(model: str, cuda_graphs: bool, kv_bytes: int, max_len: int, max_seqs: int = 64,
            overlap: bool | None = None) -> LLMEngine:
    return LLMEngine.from_config(EngineConfig(
        model=model, load_format="dummy", device="cuda", dtype="bfloat16",
        cuda_graphs=cuda_graphs, max_num_seqs=max_seqs, max_model_len=max_len,
        kv_cache_bytes=kv_bytes, max_num_batched_tokens=8192, overlap_schedule=overlap))


def weight_bytes_per_step(eng: LLMEngine) -> int:
    """Every parameter is read once per decode step except the embedding table, of which
    only the batch's rows are read (a tied table is read whole by the LM head: counted once)."""
    total = sum(p.numel() * p.element_size() for p in eng.model.parameters())
    if not eng.model_cfg.tie_word_embeddings:
        w = eng.model.embed.weight
        total -= w.numel() * w.element_size()
    return total


def kv_bytes_per_token(eng: LLMEngine) -> int:
    spec = eng.kv_pool.specs["target"]
    return spec.num_layers * 2 * spec.num_kv_heads * spec.head_dim * eng.kv_pool.dtype.itemsize


def bench_decode(model: str, batch_sizes: tuple[int, ...], ctx: int, bw: float,
                 kv_bytes: int, overlap: bool | None = None) -> list[dict]:
    """overlap: the engine's overlap scheduling (None: its default, on for CUDA); the whole
    step's time is the steady-state mean over 30 back-to-back steps either way."""
    eng = _engine(model, cuda_graphs=True, kv_bytes=kv_bytes, max_len=ctx + 512,
                  overlap=overlap)
    w_bytes, per_tok = weight_bytes_per_step(eng), kv_bytes_per_token(eng)
    vocab, rows = eng.model_cfg.vocab_size, []
    g = torch.Generator().manual_seed(0)
    for bs in batch_sizes:
        ids = [eng.add_request(torch.randint(3, vocab, (ctx,), generator=g).tolist(),
                               SamplingParams(max_new_tokens=400, ignore_eos=True))
               for _ in range(bs)]
        reqs = [eng.scheduler.requests[i] for i in ids]
        while any(not r.output_ids for r in reqs):  # prefill (chunked, 8192 tokens a step)
            eng.step()
        for _ in range(5):
            eng.step()
        torch.cuda.synchronize()
        steps, t0 = 30, time.perf_counter()
        for _ in range(steps):
            eng.step()  # ends in the step's one host sync
        engine_ms = (time.perf_counter() - t0) * 1e3 / steps
        kv_len = sum(r.num_tokens for r in reqs) / bs  # mean keys read per sequence
        padded = min(b for b in eng.graphs.batch_sizes if b >= bs)
        graph_ms = cuda_time_ms(lambda: eng.graphs.replay_only(padded), iters=50)
        plan = eng.scheduler.schedule()  # one more decode batch, run eagerly (not committed)
        batch = eng._build_batch(plan, len(plan.chunks))
        eager_ms = cuda_time_ms(lambda: eng.runner.forward(batch), iters=10)
        floor_ms = (w_bytes + bs * kv_len * per_tok) / bw * 1e3
        row = dict(model=model, batch=bs, graph_batch=padded, ctx=round(kv_len),
                   overlap=eng.overlap,
                   graph_ms=graph_ms, engine_step_ms=engine_ms, eager_ms=eager_ms,
                   floor_ms=floor_ms, weight_gb=w_bytes / 1e9,
                   kv_gb=bs * kv_len * per_tok / 1e9, gpu=gpu_state())
        row["profile"] = profile_replays(lambda: eng.graphs.replay_only(padded), OUT_DIR,
                                         f"{model} decode batch {bs} (graph replay)")
        if bs == 1 and overlap is None:
            row["host_profile"] = profile_host(eng, OUT_DIR / f"host_{model}_bs1.txt")
            row.update(_variants_bs1(eng, batch))
        rows.append(row)
        log(row)
        for i in ids:
            eng.abort(i)
    del eng
    gc.collect()
    torch.cuda.empty_cache()
    return rows


def profile_replays(fn, out_dir: Path, title: str, n: int = 5) -> dict:
    """Kernel times inside n graph replays (CUPTI): the top kernels and the busy fraction."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
    wall_us = (time.perf_counter() - t0) * 1e6 / n
    rows = []
    for e in prof.key_averages():
        total = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        if total > 0:
            rows.append((e.key[:90], e.count / n, total / n))
    rows.sort(key=lambda r: -r[2])
    busy = sum(r[2] for r in rows)
    text = [f"{'kernel':<90} {'per step':>9} {'us/step':>9}"]
    text += [f"{k:<90} {c:9.1f} {t:9.1f}" for k, c, t in rows]
    text.append(f"kernel time {busy:.0f} us/step, {sum(r[1] for r in rows):.0f} launches/step; "
                f"profiled wall {wall_us:.0f} us/step")
    with open(out_dir / "profiles.txt", "a") as f:  # one file: the fetch limit is 8 files
        f.write(f"\n== {title}\n" + "\n".join(text) + "\n")
    return {"kernel_us_per_step": busy, "launches_per_step": sum(r[1] for r in rows),
            "top": rows[:12]}


def profile_host(eng: LLMEngine, path: Path, steps: int = 20) -> list:
    """Where a batch-1 engine step spends host time (cProfile over `steps` steps)."""
    import cProfile
    import io
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        eng.step()
    prof.disable()
    buf = io.StringIO()
    stats = pstats.Stats(prof, stream=buf).sort_stats("tottime")
    stats.print_stats(25)
    path.write_text(buf.getvalue())
    top = sorted(stats.stats.items(), key=lambda kv: -kv[1][2])[:10]  # (file, line, fn): tottime
    return [(f"{k[2]} ({Path(k[0]).name}:{k[1]})", v[2] * 1e3 / steps) for k, v in top]


def _variants_bs1(eng: LLMEngine, batch: ForwardBatch) -> dict[str, float]:
    """The same batch-1 step captured under other kernel policies (what each piece buys)."""
    from tandem.engine.cuda_graphs import DecodeGraphRunner

    out = {}
    for name, policy in (("graph_ms_unfused_gemv", dict(fused_decode=False)),
                         ("graph_ms_cublas", dict(gemv=False)),
                         ("graph_ms_torch_kernels", dict(triton=False, gemv=False))):
        with kernel_policy(**policy):
            alt = DecodeGraphRunner(eng.runner, (1,), max_pages_per_seq=-(
                -eng.max_model_len // eng.cfg.page_size))
            alt.capture()
            alt.run(batch)
            out[name] = cuda_time_ms(lambda: alt.replay_only(1), iters=50)
        del alt
    return out


def bench_gemv() -> list[dict]:
    """Batch-1 projections of the 8B shape: cuBLAS vs the Triton GEMV, 20 calls per graph."""
    from tandem.engine.kernels import triton_gemv

    rows = []
    for name, (n, k) in {"qkv": (6144, 4096), "o_proj": (4096, 4096), "gate_up": (28672, 4096),
                         "down": (4096, 14336), "lm_head": (128256, 4096)}.items():
        ws = [(0.02 * torch.randn(n, k, device=DEV)).bfloat16() for _ in range(2)]
        x = torch.randn(1, k, device=DEV).bfloat16()
        triton_gemv.gemv(x, ws[0])  # tune outside the graph
        res = {"name": name, "n": n, "k": k}
        for label, fn in (("cublas", lambda w: x @ w.t()), ("triton", lambda w: triton_gemv.gemv(x, w))):
            fn(ws[0])  # warm-up outside the capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                for i in range(20):
                    fn(ws[i % 2])
            ms = cuda_time_ms(graph.replay, iters=20) / 20
            res[f"{label}_us"] = ms * 1e3
            res[f"{label}_tbs"] = n * k * 2 / (ms * 1e-3) / 1e12
        res["triton_config"] = [c for key, c in triton_gemv.tuned_configs().items()
                                if key[:2] == (n, k)]
        rows.append(res)
        log(res)
        del ws
    return rows


def bench_prefill(lengths: tuple[int, ...]) -> list[dict]:
    eng = _engine("llama-3.1-8b", cuda_graphs=False, kv_bytes=4 << 30, max_len=max(lengths) + 16)
    # The compute ceiling again, right before: the same thermal state as the prefill itself.
    rate = max(measure_matmul_rate().values())
    layer_params = sum(p.numel() for layer in eng.model.layers for p in layer.parameters())
    rows = []
    for n in lengths:
        pages = eng.allocator.alloc(-(-n // eng.cfg.page_size))
        lay = build_metadata([SeqSlice(page_ids=pages, num_cached=0, num_new=n)],
                             eng.cfg.page_size, DEV)
        ids = torch.randint(3, eng.model_cfg.vocab_size, (n,), device=DEV)
        batch = ForwardBatch(input_ids=ids, positions=lay.positions, attn=lay.attn,
                             logits_indices=torch.tensor([n - 1], device=DEV))
        ms = cuda_time_ms(lambda: eng.runner.forward(batch), iters=5, warmup=2)
        profile_replays(lambda: eng.runner.forward(batch), OUT_DIR, f"8B prefill {n}", n=1)
        floor_ms = 2 * layer_params * n / rate * 1e3
        rows.append(dict(tokens=n, ms=ms, params_per_token=layer_params, matmul_flops=rate,
                         gpu=gpu_state(), tokens_per_s=n / ms * 1e3, floor_ms=floor_ms,
                         floor_tokens_per_s=n / floor_ms * 1e3))
        log(rows[-1])
        eng.allocator.free(pages)
    return rows


# ---- driver -----------------------------------------------------------------------------------

def jit_one(head_dim: int) -> None:
    from cases import CASES, run_case

    for case in CASES:
        run_case(case, 16, head_dim)


def jit_all() -> None:
    t0 = time.perf_counter()
    procs = [subprocess.Popen([sys.executable, __file__, "--jit-head-dim", str(d)])
             for d in (64, 128)]
    codes = [p.wait() for p in procs]
    log(f"flashinfer JIT: exit codes {codes}, {time.perf_counter() - t0:.0f} s")
    if any(codes):
        sys.exit(1)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=Path("results"))
    ap.add_argument("--jit-only", action="store_true")
    ap.add_argument("--jit-head-dim", type=int)
    ap.add_argument("--ctx", type=int, default=1024, help="prompt tokens per decode sequence")
    ap.add_argument("--cool-down-s", type=float, default=20.0,
                    help="idle seconds before the compute-bound prefill (throttling cards)")
    ap.add_argument("--only", default="",
                    help="comma-separated section names to run (default: all), e.g. "
                         "decode_8b,decode_8b_no_overlap")
    args = ap.parse_args()
    if args.jit_head_dim:
        return jit_one(args.jit_head_dim)
    if args.jit_only:
        return jit_all()
    args.out.mkdir(parents=True, exist_ok=True)
    global OUT_DIR
    OUT_DIR = args.out
    import flashinfer
    import triton

    RESULTS["env"] = dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                          flashinfer=flashinfer.__version__, triton=triton.__version__,
                          date=time.strftime("%Y-%m-%d"))
    log(RESULTS["env"])
    bw = measure_copy_bandwidth()
    rates = measure_matmul_rate()
    RESULTS["ceilings"] = dict(copy_bytes_per_s=bw, matmul_flops=rates)
    log(RESULTS["ceilings"])
    sections = [
        ("kernels", check_kernels), ("attention", check_attention),
        ("model_paths", check_model_paths), ("greedy_graphs", check_greedy_graphs),
        ("gemv", bench_gemv),
        ("decode_8b", lambda: bench_decode("llama-3.1-8b", (1, 8, 64), args.ctx, bw, 14 << 30)),
        ("decode_smollm2", lambda: bench_decode("smollm2-135m", (1, 8, 64), args.ctx, bw, 4 << 30)),
        # The same steps without overlap scheduling (engine/overlap.py): same-run before/after.
        ("decode_8b_no_overlap", lambda: bench_decode("llama-3.1-8b", (1, 8), args.ctx, bw,
                                                      14 << 30, overlap=False)),
        ("decode_smollm2_no_overlap", lambda: bench_decode("smollm2-135m", (1, 8), args.ctx, bw,
                                                           4 << 30, overlap=False)),
        ("cool_down", lambda: time.sleep(args.cool_down_s) or gpu_state()),
        ("prefill_8b", lambda: bench_prefill((2048, 8192))),
    ]
    only = set(filter(None, args.only.split(",")))
    for name, fn in sections:
        if only and name not in only:
            continue
        RESULTS.setdefault("gpu_state", {})[name] = gpu_state()
        t0 = time.perf_counter()
        try:
            RESULTS[name] = fn()
        except Exception as exc:  # keep going: later sections still report
            import traceback

            traceback.print_exc()
            RESULTS[name] = {"error": repr(exc)}
        log(f"{name}: {time.perf_counter() - t0:.1f} s")
        save(args.out)
    print_table(bw, rates)


def print_table(bw: float, rates: dict[str, float]) -> None:
    env = RESULTS["env"]
    print(f"\n{env['device']} | torch {env['torch']} | flashinfer {env['flashinfer']} | "
          f"copy {bw / 1e12:.2f} TB/s | bf16 matmul {max(rates.values()) / 1e12:.0f} TFLOP/s")
    print("gpu state at section start:", RESULTS.get("gpu_state"))
    att = RESULTS.get("attention")
    if isinstance(att, list):
        bad = [r for r in att if not r["ok"]]
        print(f"attention vs reference: {len(att) - len(bad)}/{len(att)} ok, worst rel err "
              f"{max(r['rel_err'] for r in att):.2e}")
    for key in ("kernels", "model_paths", "greedy_graphs"):
        print(f"{key}: {RESULTS.get(key)}")
    print("\nmodel          overlap batch  ctx  graph ms  step ms  step/graph  eager ms  floor ms"
          "  graph/floor  clock")
    for key in ("decode_smollm2", "decode_smollm2_no_overlap", "decode_8b",
                "decode_8b_no_overlap"):
        for r in RESULTS.get(key) or []:
            if isinstance(r, dict) and "graph_ms" in r:
                print(f"{r['model']:<14} {str(r.get('overlap')):>7} {r['batch']:>5} "
                      f"{r['ctx']:>4} {r['graph_ms']:9.3f} {r['engine_step_ms']:8.3f} "
                      f"{r['engine_step_ms'] / r['graph_ms']:10.2f}x "
                      f"{r['eager_ms']:9.3f} {r['floor_ms']:9.3f} "
                      f"{r['graph_ms'] / r['floor_ms']:10.2f}x  {r.get('gpu', {}).get('sm_mhz')} MHz "
                      f"{r.get('gpu', {}).get('temp_c')} C")
    for r in RESULTS.get("prefill_8b") or []:
        if isinstance(r, dict) and "ms" in r:
            print(f"prefill 8B {r['tokens']:>5} tok: {r['ms']:.1f} ms, {r['tokens_per_s']:.0f} "
                  f"tok/s (floor {r['floor_tokens_per_s']:.0f} tok/s at "
                  f"{r['matmul_flops'] / 1e12:.0f} TFLOP/s, {r['ms'] / r['floor_ms']:.2f}x) "
                  f"{r['gpu']}")


if __name__ == "__main__":
    with torch.inference_mode():  # as serving runs: the kernels' dispatch keeps Triton
        main()
