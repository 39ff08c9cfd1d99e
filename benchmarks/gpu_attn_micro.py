"""Decode attention at batch 1-8 on the GPU: FlashInfer's paged decode (tensor-core kernel +
split-KV merge, planned on the host: plain decode graphs with TANDEM_DEVICE_DECODE=0) against
tandem's device-metadata paged decode (`kernels.triton_decode.paged_decode`: every decode graph
by default), over split counts (`triton_decode.PAGED_DECODE_PROGRAMS` = 1: each count as asked).

Each case first checks the Triton output against FlashInfer's (relative error), then times 64
calls captured back to back in one CUDA graph, each over its own layer's pages (32 KV layers,
so the keys come from HBM as in a model, not L2): us per call, the graph's gaps included.

    source benchmarks/gpu_env.sh; python3 benchmarks/gpu_attn_micro.py --out $OUT
Writes $OUT/gpu_attn_micro.json and prints a table.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT)]

import torch  # noqa: E402

from tandem.engine import graph_timing  # noqa: E402
from tandem.engine.attention.device_decode import decode_splits  # noqa: E402
from tandem.engine.kernels import triton_decode  # noqa: E402

PAGE = 16
LAYERS = 32
CALLS = 64
# (name, Hq, Hkv, D, context, batch): SmolLM2-135M, Llama-3.1-8B per TP rank (TP 1 and 2)
CASES = [
    ("smollm2 b1", 9, 3, 64, 516, 1), ("smollm2 b8", 9, 3, 64, 516, 8),
    ("8b-tp2 b1", 16, 4, 128, 1071, 1), ("8b-tp2 b8", 16, 4, 128, 1071, 8),
    ("8b-tp1 b1", 32, 8, 128, 1071, 1), ("8b-tp1 b8", 32, 8, 128, 1071, 8),
    ("8b-tp1 b1 4k", 32, 8, 128, 4096, 1),
]


def graph_us(fn) -> float:
    """us per call of `fn(i)`, calls i = 0 .. CALLS-1 captured back to back in one graph (each
    over its own layer's pages), after 3 eager calls."""
    for i in range(3):
        fn(i)
    index = itertools.count()
    return graph_timing.graph_us(lambda: fn(next(index)), CALLS, 20)


def run_case(name, hq, hkv, d, ctx, bs, fi, dev) -> dict:
    g = torch.Generator(dev).manual_seed(0)
    pages_per_seq = -(-ctx // PAGE)
    num_pages = bs * pages_per_seq + 1
    caches = [torch.randn(num_pages, 2, PAGE, hkv, d, device=dev, generator=g,
                          dtype=torch.bfloat16) for _ in range(LAYERS)]
    q = torch.randn(bs, hq, d, device=dev, generator=g, dtype=torch.bfloat16)
    table = (torch.randperm(num_pages - 1, device=dev, generator=g)[: bs * pages_per_seq] + 1
             ).view(bs, pages_per_seq).to(torch.int32)  # [B, P]
    lens = torch.full((bs,), ctx, dtype=torch.int64, device=dev)
    scale = d ** -0.5
    programs = triton_decode.PAGED_DECODE_PROGRAMS
    row = {"case": name, "hq": hq, "hkv": hkv, "d": d, "ctx": ctx, "batch": bs}

    ws = torch.empty(128 << 20, dtype=torch.uint8, device=dev)
    indptr = torch.arange(bs + 1, dtype=torch.int32, device=dev) * pages_per_seq
    last = torch.full((bs,), ctx - (pages_per_seq - 1) * PAGE, dtype=torch.int32, device=dev)
    ids = table.reshape(-1).contiguous()
    wrapper = fi.BatchDecodeWithPagedKVCacheWrapper(
        ws, "NHD", use_cuda_graph=True, use_tensor_cores=True, paged_kv_indptr_buffer=indptr,
        paged_kv_indices_buffer=ids, paged_kv_last_page_len_buffer=last, backend="fa2")
    wrapper.plan(indptr.cpu(), ids, last.cpu(), hq, hkv, d, PAGE, q_data_type=torch.bfloat16,
                 kv_data_type=torch.bfloat16, sm_scale=scale)
    want = wrapper.run(q, caches[0]).float()
    row["flashinfer_us"] = graph_us(lambda i: wrapper.run(q, caches[i % LAYERS]))

    default = decode_splits(ctx + 512)
    triton_decode.PAGED_DECODE_PROGRAMS = 1  # the split count as given, not raised
    for splits in sorted({default, 4, 8, 16, 32}):
        got = triton_decode.paged_decode(q, caches[0], table, lens, scale, splits).float()
        row[f"triton_s{splits}_rel_err"] = ((got - want).norm() / want.norm()).item()
        row[f"triton_s{splits}_us"] = graph_us(lambda i, s=splits: triton_decode.paged_decode(
            q, caches[i % LAYERS], table, lens, scale, s))
    triton_decode.PAGED_DECODE_PROGRAMS = programs
    row["auto_splits"] = triton_decode.decode_split_count(default, bs, hkv)
    row["triton_auto_us"] = graph_us(lambda i: triton_decode.paged_decode(
        q, caches[i % LAYERS], table, lens, scale, default))
    row["default_splits"] = default
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=Path("results"))
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    import flashinfer

    dev = torch.device("cuda")
    res = {"env": {"device": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d"),
                   "flashinfer": flashinfer.__version__, "torch": torch.__version__},
           "rows": []}
    for case in CASES:
        row = run_case(*case, flashinfer, dev)
        res["rows"].append(row)
        (args.out / "gpu_attn_micro.json").write_text(json.dumps(res, indent=1))
        best = min((k for k in row if k.startswith("triton_s") and k.endswith("_us")),
                   key=row.get)
        print(f"{row['case']:14s} flashinfer {row['flashinfer_us']:6.2f} us | triton at "
              f"{row['auto_splits']} splits (the default) {row['triton_auto_us']:6.2f} | best "
              f"{best} {row[best]:6.2f} (err {row[best.replace('_us', '_rel_err')]:.1e})",
              flush=True)
        for k in sorted(row):
            if k.endswith("_us") and k.startswith("triton"):
                print(f"    {k:28s} {row[k]:7.2f}")
    print(json.dumps(res["env"]))


if __name__ == "__main__":
    with torch.inference_mode():
        main()
