"""Kernel-level measurements behind the engine's choices (run on the device machine):
FlashInfer decode attention (tensor-core vs CUDA-core kernel) and every batch-1 GEMV site of
the Llama-3.1-8B shape, plain and fused, over all Triton configs, next to the small kernels
the fusions remove. Each number: a CUDA graph of repeated calls, median replay / calls.

    source .devbundle/activate.sh; PYTHONPATH=. python3 benchmarks/gpu_micro.py --out $OUT

`--skinny` instead measures the same sites with x of M in {1, 2, 4, 5, 8} rows (speculative
verify, small decode batches): the unfused sequence (cuBLAS + the Triton elementwise kernels,
what M > 1 ran before the multi-row kernel) against every candidate of the GEMV kernels,
each checked against the float64 torch twin first. Torch and Triton only (no FlashInfer):

    PYTHONPATH=. python3 benchmarks/gpu_micro.py --skinny --out $OUT        # ~2 min on an H100
    PYTHONPATH=. python3 benchmarks/gpu_micro.py --skinny --sweep --out $OUT  # + a wide grid
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from tandem.engine.graph_timing import graph_us as engine_graph_us

DEV = torch.device("cuda")

# Llama-3.1-8B projection sites: (N, K, the fusion its layer uses).
SITES_8B = {"qkv": (6144, 4096, "norm"), "o_proj": (4096, 4096, "residual"),
            "gate_up": (28672, 4096, "norm"), "down": (4096, 14336, "silu_residual"),
            "lm_head": (128256, 4096, "f32")}
# SmolLM2-135M (--skinny --model smollm2): 576-wide rows, 9 query + 3 KV heads of 64; its LM
# head is tied to the embedding and the verify's 5 rows take it too (8,192 draft rows aside).
SITES_SMOLLM2 = {"qkv": (960, 576, "norm"), "o_proj": (576, 576, "residual"),
                 "gate_up": (3072, 576, "norm"), "down": (576, 1536, "silu_residual"),
                 "lm_head": (49152, 576, "f32")}
LAYERS = {"8b": 32, "smollm2": 30}


def _site_kwargs(fused: str, nw: torch.Tensor, res: torch.Tensor) -> dict:
    """The `gemv` keyword arguments of a site's fusion (norm weight, residual given)."""
    return {"norm": {"norm_weight": nw, "eps": 1e-5}, "residual": {"residual": res},
            "silu_residual": {"silu_mul": True, "residual": res},
            "f32": {"out_dtype": torch.float32}}[fused]


def graph_us(fn, calls: int, iters: int = 20) -> float:
    """Median microseconds per call of `fn` captured `calls` times in one graph."""
    fn()
    return engine_graph_us(fn, calls, iters)


def attention_decode(ctx: int = 1060) -> list[dict]:
    import flashinfer

    from tandem.engine.attention import AttentionShape, SeqSlice, build_metadata
    from tandem.engine.attention.flashinfer_backend import (
        FLOAT_WORKSPACE_BYTES,
        DecodeWrappers,
    )

    shape = AttentionShape(num_qo_heads=32, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16,
                           scale=128**-0.5)
    ws = torch.zeros(FLOAT_WORKSPACE_BYTES, dtype=torch.uint8, device=DEV)
    rows = []
    for bs in (1, 8, 64):
        pages_per = -(-ctx // 16)
        cache = torch.randn(1 + bs * pages_per, 2, 16, 8, 128, device=DEV).bfloat16()
        perm = (torch.randperm(bs * pages_per) + 1).tolist()
        slices = [SeqSlice(page_ids=perm[i * pages_per : (i + 1) * pages_per],
                           num_cached=ctx - 1, num_new=1) for i in range(bs)]
        meta = build_metadata(slices, 16, DEV).attn
        q = torch.randn(bs, 32, 128, device=DEV).bfloat16()
        row = {"batch": bs, "ctx": ctx}
        for tc in (True, False):
            dw = DecodeWrappers(flashinfer, ws, shape, DEV, bs, bs * pages_per, growable=False,
                                use_tensor_cores=tc)
            plan = dw.plan(meta)
            row["tensor_core_us" if tc else "cuda_core_us"] = graph_us(
                lambda plan=plan, q=q, cache=cache: plan.wrapper.run(q, cache), calls=32)
        kv_bytes = bs * ctx * 8 * 128 * 2 * 2
        row["floor_us"] = kv_bytes / 4.2e12 * 1e6
        rows.append(row)
        print(row, flush=True)
    return rows


def gemv_sites() -> list[dict]:
    from tandem.engine.kernels import triton_gemv, triton_ops

    rows = []
    for name, (n, k, fused) in SITES_8B.items():
        ws = [(0.02 * torch.randn(n, k, device=DEV)).bfloat16() for _ in range(2)]
        silu = fused.startswith("silu")
        x = torch.randn(1, 2 * k if silu else k, device=DEV).bfloat16()
        xk = x[:, :k].contiguous()
        nw = (1 + 0.1 * torch.randn(k, device=DEV)).bfloat16()
        res = torch.randn(1, n, device=DEV).bfloat16()
        kwargs = _site_kwargs(fused, nw, res)
        for variant, (xin, kw) in (("plain", (xk, {})), (fused, (x, kwargs))):
            per_cfg = {}
            for cfg in triton_gemv.CONFIGS:
                state = {"i": 0}

                def call(cfg=cfg, xin=xin, kw=kw, state=state, ws=ws):
                    state["i"] ^= 1
                    triton_gemv.gemv(xin, ws[state["i"]], config=cfg, **kw)

                per_cfg[cfg] = graph_us(call, calls=10)
            best = min(per_cfg, key=per_cfg.__getitem__)
            ranked = sorted(per_cfg.items(), key=lambda kv: kv[1])[:4]
            cublas = (graph_us(lambda xk=xk, w=ws[0]: xk @ w.t(), calls=10)
                      if variant == "plain" else None)
            row = {"site": name, "variant": variant, "n": n, "k": k, "best_config": best,
                   "us": per_cfg[best], "tbs": n * k * 2 / (per_cfg[best] * 1e-6) / 1e12,
                   "top4": ranked, "cublas_us": cublas}
            rows.append(row)
            print({kk: v for kk, v in row.items() if kk != "top4"}, flush=True)
        del ws
    x4, r4 = (torch.randn(1, 4096, device=DEV).bfloat16() for _ in range(2))
    w4 = torch.ones(4096, device=DEV).bfloat16()
    gu = torch.randn(1, 28672, device=DEV).bfloat16()
    small = {
        "add_rms_norm_4096": graph_us(lambda: triton_ops.add_rms_norm(x4, r4, w4, 1e-5), 32),
        "rms_norm_4096": graph_us(lambda: triton_ops.rms_norm(x4, w4, 1e-5), 32),
        "silu_and_mul_14336": graph_us(lambda: triton_ops.silu_and_mul(gu), 32),
        "torch_add_4096": graph_us(lambda: x4 + r4, 32),
    }
    print(small, flush=True)
    rows.append({"site": "small_kernels", **small})
    return rows


SKINNY_ROWS = (1, 2, 4, 5, 8)


def _sweep_grid() -> list:
    """A wide grid of multi-row configs (--sweep): where ROWS_CONFIGS was pruned from."""
    from tandem.engine.kernels.triton_gemv import RowsConfig

    base = [RowsConfig(bn, bk, warps, stages) for bn in (16, 32, 64, 128)
            for bk in (128, 256, 512) for warps in (4, 8) for stages in (3, 5)
            if bn * bk * 2 * stages <= 160 * 1024]  # pipeline buffers in shared memory
    return base + [c._replace(split_silu=True) for c in base]  # (SiLU-mul sites only)


def skinny_sites(sweep: bool, row_counts: tuple[int, ...] = SKINNY_ROWS,
                 model: str = "8b") -> list[dict]:
    """Every site of the model (8B or SmolLM2), plain and with its layer's fusion, for each row
    count in SKINNY_ROWS: the unfused sequence vs each GEMV candidate (the one-row kernel's CONFIGS for M = 1,
    ROWS_CONFIGS -- or the --sweep grid -- for M > 1), alternating two weights so that
    no call finds its weight in L2."""
    from tandem.engine.kernels import triton_gemv

    rows = []
    grid = _sweep_grid() if sweep else [c for c in triton_gemv.ROWS_CONFIGS
                                        if c != triton_gemv.UNFUSED]
    for name, (n, k, fused) in (SITES_8B if model == "8b" else SITES_SMOLLM2).items():
        weights = [(0.02 * torch.randn(n, k, device=DEV)).bfloat16() for _ in range(2)]
        w64 = weights[0].double()
        nw = (1 + 0.1 * torch.randn(k, device=DEV)).bfloat16()
        silu = fused == "silu_residual"
        for m in row_counts:
            x = torch.randn(m, 2 * k if silu else k, device=DEV).bfloat16()
            xk = x[:, :k].contiguous()
            res = torch.randn(m, n, device=DEV).bfloat16()
            kwargs = _site_kwargs(fused, nw, res)
            for variant, xin, kw in (("plain", xk, {}), (fused, x, kwargs)):
                # split_silu configs differ from their plain twins only with SiLU-mul
                cands = ([c for c in grid
                          if "silu_mul" in kw or not getattr(c, "split_silu", False)]
                         if m > 1 else list(triton_gemv.CONFIGS))
                row = _skinny_row(name, variant, n, k, m, cands, weights, w64, xin, kw)
                rows.append(row)
                print({kk: v for kk, v in row.items() if kk != "top4"}, flush=True)
        del weights, w64
    return rows


def _skinny_row(name, variant, n, k, m, candidates, weights, w64, xin, kw):
    """One (site, variant, M): check every candidate against the float64 twin, then time the
    unfused sequence (triton_gemv.unfused) and every candidate (graph of 10 calls, alternating
    the two weights). kw: the variant's keyword arguments of `gemv`."""
    from tandem.engine.kernels import torch_ops, triton_gemv

    nw, res = kw.get("norm_weight"), kw.get("residual")
    want = torch_ops.fused_linear(  # [M, N] float64 twin
        xin.double(), w64, None if nw is None else nw.double(), 1e-5,
        kw.get("silu_mul", False), None if res is None else res.double())
    bad = {}
    for cfg in candidates:
        got = triton_gemv.gemv(xin, weights[0], config=cfg, **kw)
        err = float((got.double() - want).norm() / want.norm())
        if not err < 6e-3:  # the GPU test's bound
            bad[str(cfg)] = err
    got = triton_gemv.unfused(xin, weights[0], **kw)
    unfused_err = float((got.double() - want).norm() / want.norm())

    def timed(fn) -> float:
        state = {"i": 0}

        def call() -> None:
            state["i"] ^= 1
            fn(weights[state["i"]])

        return graph_us(call, calls=10)

    unfused_us = timed(lambda w: triton_gemv.unfused(xin, w, **kw))
    per_cfg = {cfg: timed(lambda w, cfg=cfg: triton_gemv.gemv(xin, w, config=cfg, **kw))
               for cfg in candidates if str(cfg) not in bad}
    best = min(per_cfg, key=per_cfg.__getitem__)
    gbs = n * k * 2 / 1e9
    return {"site": name, "variant": variant, "m": m, "n": n, "k": k,
            "unfused_us": unfused_us, "unfused_gbs": gbs / (unfused_us * 1e-6),
            "best_config": str(best), "us": per_cfg[best],
            "gbs": gbs / (per_cfg[best] * 1e-6), "speedup": unfused_us / per_cfg[best],
            "unfused_rel_err": unfused_err, "failed_check": bad,
            "top4": sorted(((str(c), t) for c, t in per_cfg.items()), key=lambda kv: kv[1])[:4]}


def print_skinny(rows: list[dict], row_counts: tuple[int, ...] = SKINNY_ROWS,
                 model: str = "8b") -> None:
    print("\nsite      variant        M  unfused us   GB/s   kernel us   GB/s  speedup  config")
    for r in rows:
        failed = f"  FAILED CHECK {r['failed_check']}" if r["failed_check"] else ""
        print(f"{r['site']:<9} {r['variant']:<14} {r['m']}  {r['unfused_us']:9.1f} "
              f"{r['unfused_gbs']:6.0f} {r['us']:11.1f} {r['gbs']:6.0f} {r['speedup']:7.2f}x  "
              f"{r['best_config']}{failed}")
    # What one forward of M tokens spends in projections: the fused layers + the LM head.
    layers = LAYERS[model]
    print(f"\n{model} forward, projections only ({layers} layers x fused sites + lm_head), us:")
    print("M   unfused   kernel   best-of-both")
    for m in row_counts:
        fused = [r for r in rows if r["m"] == m and r["variant"] != "plain"]
        scale = {r["site"]: 1 if r["site"] == "lm_head" else layers for r in fused}
        tot = {key: sum(scale[r["site"]] * f(r) for r in fused) for key, f in (
            ("unfused", lambda r: r["unfused_us"]), ("kernel", lambda r: r["us"]),
            ("best", lambda r: min(r["us"], r["unfused_us"])))}
        print(f"{m}  {tot['unfused']:8.0f} {tot['kernel']:8.0f} {tot['best']:8.0f}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=Path("results"))
    ap.add_argument("--skinny", action="store_true",
                    help="only the multi-row GEMV table (M = 1, 2, 4, 5, 8); no FlashInfer")
    ap.add_argument("--sweep", action="store_true",
                    help="with --skinny: time a wide grid of multi-row configs")
    ap.add_argument("--rows", type=int, nargs="+", default=list(SKINNY_ROWS),
                    help="with --skinny: the row counts M (default: 1 2 4 5 8)")
    ap.add_argument("--model", choices=sorted(LAYERS), default="8b",
                    help="with --skinny: whose projection shapes")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.skinny:
        row_counts = tuple(args.rows)
        res = {"device": torch.cuda.get_device_name(), "sweep": args.sweep,
               "model": args.model, "skinny": skinny_sites(args.sweep, row_counts, args.model)}
        (args.out / "gpu_micro_skinny.json").write_text(json.dumps(res, indent=1, default=str))
        print_skinny(res["skinny"], row_counts, args.model)
        return
    res = {"device": torch.cuda.get_device_name(), "attention_decode": attention_decode()}
    (args.out / "gpu_micro.json").write_text(json.dumps(res, indent=1, default=str))
    res["gemv"] = gemv_sites()
    (args.out / "gpu_micro.json").write_text(json.dumps(res, indent=1, default=str))
    print("\nsite      variant        best config          us     TB/s   cublas us")
    for r in res["gemv"]:
        if "variant" in r:
            cub = f"{r['cublas_us']:9.1f}" if r["cublas_us"] else ""
            print(f"{r['site']:<9} {r['variant']:<14} {r['best_config']!s:<18} "
                  f"{r['us']:7.1f} {r['tbs']:7.2f} {cub}")
    for r in res["attention_decode"]:
        print(r)


if __name__ == "__main__":
    with torch.inference_mode():  # as serving runs: the kernels' dispatch keeps Triton
        main()
