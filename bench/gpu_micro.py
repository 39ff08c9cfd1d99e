"""Kernel-level measurements behind the engine's choices (run on the device machine):
FlashInfer decode attention (tensor-core vs CUDA-core kernel) and every batch-1 GEMV site of
the Llama-3.1-8B shape, plain and fused, over all Triton configs, next to the small kernels
the fusions remove. Each number: a CUDA graph of repeated calls, median replay / calls.

    source .devbundle/activate.sh; PYTHONPATH=. python3 bench/gpu_micro.py --out $OUT
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

DEV = torch.device("cuda")


def graph_us(fn, calls: int, iters: int = 20) -> float:
    """Median microseconds per call of `fn` captured `calls` times in one graph."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / calls)
    return statistics.median(times)


def attention_decode(ctx: int = 1060) -> list[dict]:
    import flashinfer

    from tandem.engine.attention import AttentionShape, SeqSlice, build_metadata
    from tandem.engine.attention.flashinfer_backend import FLOAT_WORKSPACE_BYTES, DecodeWrappers

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
                lambda: plan.wrapper.run(q, cache), calls=32)
        kv_bytes = bs * ctx * 8 * 128 * 2 * 2
        row["floor_us"] = kv_bytes / 4.2e12 * 1e6
        rows.append(row)
        print(row, flush=True)
    return rows


def gemv_sites() -> list[dict]:
    from tandem.engine.kernels import triton_gemv, triton_ops

    rows = []
    sites = {"qkv": (6144, 4096, "norm"), "o_proj": (4096, 4096, "residual"),
             "gate_up": (28672, 4096, "norm"), "down": (4096, 14336, "silu_residual"),
             "lm_head": (128256, 4096, "f32")}
    for name, (n, k, fused) in sites.items():
        ws = [(0.02 * torch.randn(n, k, device=DEV)).bfloat16() for _ in range(2)]
        silu = fused.startswith("silu")
        x = torch.randn(1, 2 * k if silu else k, device=DEV).bfloat16()
        xk = x[:, :k].contiguous()
        nw = (1 + 0.1 * torch.randn(k, device=DEV)).bfloat16()
        res = torch.randn(1, n, device=DEV).bfloat16()
        kwargs = {"norm": dict(norm_weight=nw, eps=1e-5), "residual": dict(residual=res),
                  "silu_residual": dict(silu_mul=True, residual=res),
                  "f32": dict(out_dtype=torch.float32)}[fused]
        for variant, (xin, kw) in (("plain", (xk, {})), (fused, (x, kwargs))):
            per_cfg = {}
            for cfg in triton_gemv.CONFIGS:
                state = {"i": 0}

                def call(cfg=cfg, xin=xin, kw=kw, state=state):
                    state["i"] ^= 1
                    triton_gemv.gemv(xin, ws[state["i"]], config=cfg, **kw)

                per_cfg[cfg] = graph_us(call, calls=10)
            best = min(per_cfg, key=per_cfg.__getitem__)
            ranked = sorted(per_cfg.items(), key=lambda kv: kv[1])[:4]
            cublas = graph_us(lambda: xk @ ws[0].t(), calls=10) if variant == "plain" else None
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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=Path("results"))
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    res = {"device": torch.cuda.get_device_name(), "attention_decode": attention_decode()}
    (args.out / "gpu_micro.json").write_text(json.dumps(res, indent=1, default=str))
    res["gemv"] = gemv_sites()
    (args.out / "gpu_micro.json").write_text(json.dumps(res, indent=1, default=str))
    print("\nsite      variant        best config          us     TB/s   cublas us")
    for r in res["gemv"]:
        if "variant" in r:
            cub = f"{r['cublas_us']:9.1f}" if r["cublas_us"] else ""
            print(f"{r['site']:<9} {r['variant']:<14} {str(r['best_config']):<18} "
                  f"{r['us']:7.1f} {r['tbs']:7.2f} {cub}")
    for r in res["attention_decode"]:
        print(r)


if __name__ == "__main__":
    main()
