"""Fused MoE on a GPU: one Qwen3-30B-A3B-shaped MoE layer (H 2048, I 768, 128 experts, top-8,
random weights, bf16) -- the Triton kernels (kernels.moe_experts + moe_weighted_sum) against
their torch twins and the per-expert loop they replaced (kernels/moe_reference.py): max |diff|
from a float32 loop (absolute and relative to the largest output), times per layer, and a
CUDA-graph capture + replay of the whole SparseMoE layer (router included), whose output must
equal the eager one. With two GPUs, also EP = 2 over NCCL: the "allreduce" and
"alltoall_padded" layers captured in CUDA graphs, replay == eager, both == one rank.

    PYTHONPATH=. python3 benchmarks/gpu_fused_moe.py --out $OUT
    python3 benchmarks/gpu_fused_moe.py --smoke      # CPU: small layer, Triton interpreter

Results go to docs/perf.md; the JSON to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT)]
if "--smoke" in sys.argv:  # before anything imports triton
    os.environ["TRITON_INTERPRET"] = "1"
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast stays off (KINDS.md)

import torch  # noqa: E402


def _layer(shape: dict, ep, mode: str, device: torch.device, dtype: torch.dtype):
    """A SparseMoE of `shape` over `ep`, the same full (seeded) weights on every rank."""
    from tandem.engine import ParallelGroup
    from tandem.engine.layers.mlp import SparseMoE

    h, inter, num_experts = shape["hidden"], shape["inter"], shape["experts"]
    with torch.device(device):
        moe = SparseMoE(h, inter, num_experts, shape["top_k"], True, ep, ParallelGroup(), dtype,
                        mode)
    gen = torch.Generator(device=device).manual_seed(0)
    moe.router.load_weight("router", torch.randn(num_experts, h, generator=gen, device=device,
                                                 dtype=dtype) * 0.1)
    w13 = torch.randn(num_experts, 2 * inter, h, generator=gen, device=device, dtype=dtype)
    w2 = torch.randn(num_experts, h, inter, generator=gen, device=device, dtype=dtype)
    start, n = moe.expert_start, moe.w13.shape[0]
    moe.w13.data.copy_(w13[start : start + n] * h**-0.5)
    moe.w2.data.copy_(w2[start : start + n] * inter**-0.5)
    return moe


def _timer(device: torch.device):
    def median_ms(fn, iters: int) -> float:
        for _ in range(3):
            fn()
        times = []
        for _ in range(iters):
            if device.type == "cuda":
                start, end = torch.cuda.Event(True), torch.cuda.Event(True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end))
            else:
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1e3)
        return sorted(times)[len(times) // 2]

    return median_ms


def _diff(got: torch.Tensor, ref: torch.Tensor) -> dict:
    d = (got.float() - ref.float()).abs().max().item()
    return {"max_abs": d, "rel": d / max(ref.float().abs().max().item(), 1e-30)}


def _capture(fn, device: torch.device):
    """(graph, static output) of fn() captured on a side stream after a warm-up."""
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


def single_device(args, device: torch.device, shape: dict) -> list[dict]:
    from tandem.engine import ParallelGroup, kernels
    from tandem.engine.kernels.moe_reference import expert_loop

    dtype = getattr(torch, args.dtype)
    moe = _layer(shape, ParallelGroup(), "allreduce", device, dtype)
    w13_32, w2_32 = moe.w13.float(), moe.w2.float()
    median_ms = _timer(device)
    rows = []
    for batch in args.batch:
        x = torch.randn(batch, shape["hidden"], device=device, dtype=dtype,
                        generator=torch.Generator(device=device).manual_seed(batch))
        with torch.inference_mode():
            weights, experts = moe.route(x)

            def loop(x=x, weights=weights, experts=experts):
                return expert_loop(x, moe.w13, moe.w2, weights, experts, 0)

            def fused(x=x, weights=weights, experts=experts):
                y = kernels.moe_experts(x, moe.w13, moe.w2, experts, 0)
                return kernels.moe_weighted_sum(y, weights, experts)

            ref = expert_loop(x.float(), w13_32, w2_32, weights.float(), experts, 0)
            row = {"batch": batch, "loop": _diff(loop(), ref)}
            with kernels.kernel_policy(triton=False):
                row["twin"] = _diff(fused(), ref)
                row["twin_ms"] = median_ms(fused, args.iters)
            row["triton"] = _diff(fused(), ref)
            row["triton_vs_loop"] = _diff(fused(), loop())
            row["loop_ms"] = median_ms(loop, args.iters)
            row["triton_ms"] = median_ms(fused, args.iters)
            row["layer_ms"] = median_ms(lambda x=x: moe(x), args.iters)  # router + fused
            if device.type == "cuda":
                static_x = x.clone()
                graph, out = _capture(lambda: moe(static_x), device)
                graph.replay()
                eager = moe(static_x)
                row["graph_equals_eager"] = bool(torch.equal(out, eager))
                static_x.copy_(torch.randn_like(x))  # new inputs, same graph
                graph.replay()
                row["graph_new_input_equals_eager"] = bool(torch.equal(out, moe(static_x)))
                row["graph_ms"] = median_ms(graph.replay, args.iters)
        rows.append(row)
        _print_row(row)
    if device.type == "cuda":  # float32: the Triton kernels (IEEE dots) against the loop
        moe32 = _layer(shape, ParallelGroup(), "allreduce", device, torch.float32)
        x = torch.randn(64, shape["hidden"], device=device)
        with torch.inference_mode():
            weights, experts = moe32.route(x)
            ref = expert_loop(x, moe32.w13, moe32.w2, weights, experts, 0)
            y = kernels.moe_experts(x, moe32.w13, moe32.w2, experts, 0)
            got = kernels.moe_weighted_sum(y, weights, experts)
        rows.append({"batch": 64, "dtype": "float32", "triton_vs_loop": _diff(got, ref)})
        print(f"float32, batch 64: triton vs loop {rows[-1]['triton_vs_loop']}", flush=True)
    return rows


def _print_row(row: dict) -> None:
    graph = (f" graph {row['graph_ms']:7.3f} (replay==eager {row['graph_equals_eager']}, "
             f"new input {row['graph_new_input_equals_eager']})" if "graph_ms" in row else "")
    print(f"batch {row['batch']:4d}: loop {row['loop_ms']:8.3f} twin {row['twin_ms']:8.3f} "
          f"triton {row['triton_ms']:7.3f} layer {row['layer_ms']:7.3f}{graph} ms | rel err "
          f"vs fp32: loop {row['loop']['rel']:.1e} twin {row['twin']['rel']:.1e} triton "
          f"{row['triton']['rel']:.1e}", flush=True)


def _ep_rank(rank: int, args, shape: dict, port: int, out_path: str) -> None:
    """One rank of the EP = 2 check: each mode's layer eager == one rank, graph == eager."""
    import torch.distributed as dist

    from tandem.engine import ParallelGroup

    device = torch.device(f"cuda:{rank}")
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2, device_id=device)
    ep = ParallelGroup(rank=rank, size=2, handle=dist.group.WORLD)
    dtype = getattr(torch, args.dtype)
    single = _layer(shape, ParallelGroup(), "allreduce", device, dtype)
    median_ms = _timer(device)
    results = []
    for mode in ("allreduce", "alltoall_padded"):
        layer = _layer(shape, ep, mode, device, dtype)
        for batch in args.ep_batch:
            x = torch.randn(batch, shape["hidden"], device=device, dtype=dtype,
                            generator=torch.Generator(device=device).manual_seed(batch))
            with torch.inference_mode():
                want = single(x)
                eager = layer(x)
                static_x = x.clone()
                graph, out = _capture(lambda: layer(static_x), device)
                graph.replay()
                torch.cuda.synchronize()
                res = {"mode": mode, "batch": batch, "vs_one_rank": _diff(eager, want),
                       "graph_equals_eager": bool(torch.equal(out, eager)),
                       "eager_ms": median_ms(lambda: layer(static_x), args.iters),
                       "graph_ms": median_ms(graph.replay, args.iters)}
            results.append(res)
            if rank == 0:
                print(f"ep2 {mode:15s} batch {batch:4d}: eager {res['eager_ms']:7.3f} graph "
                      f"{res['graph_ms']:7.3f} ms, replay==eager {res['graph_equals_eager']}, "
                      f"vs one rank {res['vs_one_rank']['max_abs']:.1e}", flush=True)
    if rank == 0:
        Path(out_path).write_text(json.dumps(results))
    dist.destroy_process_group()


def ep_two_gpus(args, shape: dict) -> list[dict]:
    import tempfile

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = Path(tempfile.mkdtemp()) / "ep2.json"
    mp.start_processes(_ep_rank, args=(args, shape, port, str(out)), nprocs=2,
                       start_method="spawn")
    return json.loads(out.read_text())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None, help="folder for gpu_fused_moe.json")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 64, 256, 1024])
    ap.add_argument("--ep-batch", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--no-ep", action="store_true", help="skip the EP = 2 part")
    ap.add_argument("--smoke", action="store_true", help="CPU, small layer, interpreter")
    args = ap.parse_args()
    shape = {"hidden": 2048, "inter": 768, "experts": 128, "top_k": 8}  # Qwen3-30B-A3B
    if args.smoke:
        from tandem.engine.kernels import ops

        shape = {"hidden": 64, "inter": 32, "experts": 8, "top_k": 2}
        args.batch, args.iters, args.dtype = [1, 5], 2, "float32"
        ops._on_triton_device = lambda x: True  # the Triton kernels, interpreted on the CPU
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    report = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
              "torch": torch.__version__, "shape": shape, "dtype": args.dtype,
              "date": time.strftime("%Y-%m-%d"), "single": single_device(args, device, shape)}
    if device.type == "cuda" and torch.cuda.device_count() >= 2 and not args.no_ep:
        try:
            report["ep2"] = ep_two_gpus(args, shape)
        except Exception as exc:  # the single-GPU results still come back
            report["ep2_error"] = repr(exc)
            print(f"EP = 2 part failed: {exc!r}", flush=True)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "gpu_fused_moe.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
