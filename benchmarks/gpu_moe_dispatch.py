"""EP MoE dispatch on GPUs: one MoE layer (random weights) over `--ep` ranks, timed per batch
size for each `moe_dispatch` (allreduce, alltoall, alltoall_padded), every all-to-all output
checked against the all-reduce one (max |diff| printed; float32 should give 0).

    source .devbundle-fi/activate.sh; export PYTHONPATH=.:$PYTHONPATH
    python benchmarks/gpu_moe_dispatch.py --ep 2          # Qwen3-30B-A3B-shaped layer, bf16
    python benchmarks/gpu_moe_dispatch.py --ep 8 --batch 1 8 64 256 2048

Each rank is a process (NCCL on CUDA, gloo on the CPU: `--cpu` with a small layer is a smoke
test). Rows are this rank's own tokens, as under DP attention. Eager only: the CUDA-graph
capture of the padded path is future work (the per-expert loop must become a grouped GEMM
first). Results go to docs/perf.md.
"""

from __future__ import annotations

import argparse
import socket
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT)]

import torch  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

MODES = ("allreduce", "alltoall", "alltoall_padded")


def _layer(args, ep, mode: str, device: torch.device, dtype: torch.dtype):
    from tandem.engine import ParallelGroup
    from tandem.engine.layers.mlp import SparseMoE

    with torch.device(device):
        moe = SparseMoE(args.hidden, args.inter, args.experts, args.top_k, True, ep,
                        ParallelGroup(), dtype, mode)
    gen = torch.Generator(device=device).manual_seed(0)  # the same full weights on every rank
    moe.router.load_weight("router", torch.randn(args.experts, args.hidden, generator=gen,
                                                 device=device, dtype=dtype) * 0.1)
    for e in range(args.experts):
        for which, shape in (("gate", (args.inter, args.hidden)), ("up", (args.inter, args.hidden)),
                             ("down", (args.hidden, args.inter))):
            full = torch.randn(*shape, generator=gen, device=device, dtype=dtype) * 0.02
            moe.load_expert(f"{e}.{which}", e, which, full)
    return moe


def _time(fn, device: torch.device, iters: int) -> float:
    """Median seconds of `fn()` over `iters` runs after 3 warm-ups."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def _rank(rank: int, args, port: int) -> None:
    import torch.distributed as dist

    from tandem.engine import ParallelGroup

    cuda = torch.cuda.is_available() and not args.cpu
    device = torch.device(f"cuda:{rank}" if cuda else "cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=rank, world_size=args.ep)
    ep = ParallelGroup(rank=rank, size=args.ep, handle=dist.group.WORLD)
    dtype = getattr(torch, args.dtype)
    layers = {mode: _layer(args, ep, mode, device, dtype) for mode in MODES}
    if rank == 0:
        print(f"ep={args.ep} H={args.hidden} I={args.inter} E={args.experts} k={args.top_k} "
              f"{args.dtype} on {device.type}; ms per layer (median), max |diff| vs allreduce")
    for batch in args.batch:
        x = torch.randn(batch, args.hidden, device=device, dtype=dtype,
                        generator=torch.Generator(device=device).manual_seed(rank + 1))
        # allreduce runs on the gathered rows, as DecoderLayer.run_mlp does for DP attention
        counts = tuple([batch] * args.ep)
        oracle_layer = layers["allreduce"]

        def oracle(x=x, counts=counts) -> torch.Tensor:
            out = oracle_layer(ep.all_gather_rows(x, counts))
            return out[rank * batch : (rank + 1) * batch]

        want = oracle()
        row = [f"batch {batch:5d}: allreduce {_time(oracle, device, args.iters) * 1e3:8.3f}"]
        for mode in MODES[1:]:
            layer = layers[mode]

            def run(x=x, layer=layer) -> torch.Tensor:
                return layer(x, batch, ParallelGroup())

            diff = (run() - want).abs().max().item()
            row.append(f"{mode} {_time(run, device, args.iters) * 1e3:8.3f} ({diff:.1e})")
        if rank == 0:
            print("  ".join(row), flush=True)
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ep", type=int, default=2)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32, 128, 512, 2048])
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--inter", type=int, default=768)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--cpu", action="store_true", help="gloo on the CPU (a smoke test)")
    args = ap.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(_rank, args=(args, port), nprocs=args.ep, start_method="spawn")


if __name__ == "__main__":
    main()
