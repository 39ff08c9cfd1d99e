"""MoE decode on N GPUs (2: issue 26; 4: issue 23): TP=N vs DP-attention N + EP N,
Qwen3-30B-A3B shape, dummy bf16, both in CUDA graphs (DP graphs: every rank replays the size the
ranks agree on).

On the device machine, from the repository root:

    source benchmarks/gpu_env.sh; PYTHONUNBUFFERED=1 python3 benchmarks/gpu_moe_decode.py --out $OUT
    # 4 GPUs:  ... gpu_moe_decode.py --ranks 4 --batch 64 256 512 --out $OUT

    python3 benchmarks/gpu_moe_decode.py --smoke [--ranks 4] --out /tmp/moe   # CPU, gloo

Layouts (one process per GPU, NCCL; N = --ranks):
  - `tp`: attention heads, dense columns and the 128 experts split over the N ranks (experts
    by EP over the same group), every token on every rank, all-reduces;
  - `dp_ep_alltoall`: each rank its own requests (1/N of the batch) with whole attention, the
    experts split over the ranks, tokens to their experts' rank and back at a fixed capacity
    (`moe_dispatch: alltoall_padded`, graph-safe);
  - `dp_ep_allreduce`: the same with the DP ranks' tokens gathered and the expert outputs
    all-reduced (the oracle dispatch).
For each: decode tokens/s at each total batch (whole `step()` median of back-to-back steps, all
ranks' tokens) next to its floor -- the bytes one GPU's step must read: its attention and dense
weights, the experts its tokens actually hit (counted from the router's choices in one decode
forward of the batch), its KV -- over the copy bandwidth measured in the same run. Prints a table,
writes $OUT/gpu_moe_decode.json.
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

import torch  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

TINY = {  # --smoke: a Qwen3-MoE small enough for 2-4 CPU ranks
    "architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 512, "hidden_size": 64,
    "intermediate_size": 128, "moe_intermediate_size": 32, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 4, "head_dim": 16, "num_experts": 8,
    "num_experts_per_tok": 2, "norm_topk_prob": True, "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0, "max_position_embeddings": 4096, "tie_word_embeddings": False,
    "eos_token_id": 2,
}
LAYOUTS = ("tp", "dp_ep_alltoall", "dp_ep_allreduce")


def log(*args: object) -> None:
    print(f"[{time.strftime('%H:%M:%S')}]", *args, flush=True)


def _parallel(layout: str, group, rank: int):
    from tandem.engine import ParallelContext, ParallelGroup

    if layout == "tp":
        return ParallelContext(tp=group, ep=group), "allreduce"
    single = ParallelGroup(rank=0, size=1)
    return (ParallelContext(tp=single, dp=group, ep=group),
            "alltoall_padded" if layout.endswith("alltoall") else "allreduce")


def experts_hit(eng, batch) -> float:
    """Mean number of this rank's local experts that some token of the whole step (every
    rank's) routes to, per MoE layer, from one eager forward of `batch` (the router's own
    choices, every rank's gathered)."""
    import torch.distributed as dist

    from tandem.engine.layers.mlp import SparseMoE

    layers = [m for m in eng.model.modules() if isinstance(m, SparseMoE)]
    seen: list[set[int]] = [set() for _ in layers]
    for i, m in enumerate(layers):
        def route(x, orig=m.route, i=i):
            weights, experts = orig(x)
            seen[i].update(experts.reshape(-1).tolist())
            return weights, experts
        m.route = route
    try:
        eng.runner.forward(batch)
    finally:
        for m in layers:
            del m.route  # the instance attribute: the class's route again
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, seen)
    hits = []
    for i, m in enumerate(layers):
        union = set().union(*(rank_seen[i] for rank_seen in every))
        lo, n = m.expert_start, m.w13.shape[0]
        hits.append(sum(1 for e in union if lo <= e < lo + n))
    return statistics.mean(hits) if hits else 0.0


def bench(eng, rank: int, dp: int, args, bw: float) -> list[dict]:
    """Per total batch: decode tokens/s (all ranks), step ms, and this rank's floor."""
    from gpu_engine import kv_bytes_per_token

    from tandem.engine import SamplingParams

    cfg = eng.model_cfg
    experts = [(n, p) for n, p in eng.model.named_parameters() if n.endswith((".w13", ".w2"))]
    expert_bytes = sum(p.numel() * p.element_size() for _, p in experts)
    num_local = next(p.shape[0] for n, p in experts if n.endswith(".w13"))
    # one local expert of one layer (gate, up and down), and everything that is not an expert
    per_expert = expert_bytes / (num_local * cfg.num_layers)
    other = sum(p.numel() * p.element_size() for p in eng.model.parameters()) - expert_bytes
    per_tok = kv_bytes_per_token(eng)
    g = torch.Generator().manual_seed(rank)
    rows = []
    for total in args.batch:
        mine = total // dp
        ids = [eng.add_request(torch.randint(3, cfg.vocab_size, (args.ctx,), generator=g).tolist(),
                               SamplingParams(max_new_tokens=400, ignore_eos=True))
               for _ in range(mine)]
        reqs = [eng.scheduler.requests[i] for i in ids]
        dp_group = eng.model.par.dp  # DP ranks must agree on every loop's end (collectives)
        while dp_group.all_reduce_max(int(any(not r.output_ids for r in reqs)), eng.device):
            eng.step()  # prefill
        for _ in range(5):
            eng.step()
        plan = eng.scheduler.schedule()  # one more decode batch, measured eagerly (not committed)
        hit = experts_hit(eng, eng._build_batch(plan, len(plan.chunks)))
        # Back to back, synchronized only at the ends: with overlap scheduling a step() returns
        # once the next step is launched, so one step timed between two synchronizations would
        # measure its host work, not the GPU's. Median over a few such runs.
        # How the timed steps ran: graph replays vs eager forwards (DP ranks fall back to
        # eager when any rank has a prefill chunk)
        counts = {"graph": 0, "eager": 0}
        wrapped = [(obj, attr, getattr(obj, attr)) for obj, attr, key in
                   ((eng.graphs, "run", "graph"), (eng.runner, "forward", "eager"))
                   if obj is not None]
        for obj, attr, orig in wrapped:
            key = "graph" if attr == "run" else "eager"

            def counted(*a, orig=orig, key=key, **kw):
                counts[key] += 1
                return orig(*a, **kw)
            setattr(obj, attr, counted)
        runs = []
        for _ in range(3):
            if eng.device.type == "cuda":
                torch.cuda.synchronize(eng.device)
            t0 = time.perf_counter()
            for _ in range(args.steps):
                eng.step()
            if eng.device.type == "cuda":
                torch.cuda.synchronize(eng.device)
            runs.append((time.perf_counter() - t0) * 1e3 / args.steps)
        step_ms = statistics.median(runs)
        for obj, attr, _ in wrapped:
            delattr(obj, attr)  # the instance attribute: the class's method again
        kv_len = sum(r.num_tokens for r in reqs) / max(1, mine)
        floor_bytes = other + hit * cfg.num_layers * per_expert + mine * kv_len * per_tok
        rows.append(dict(batch=total, per_rank=mine, step_ms=step_ms,
                         tokens_per_s=total / (step_ms * 1e-3), experts_hit=hit,
                         floor_ms=floor_bytes / bw * 1e3 if bw else None,
                         graphs=eng.graphs is not None, overlap=eng.overlap,
                         forwards=counts))
        if rank == 0:
            log(rows[-1])
        for i in ids:
            eng.abort(i)
        while eng.any_rank_has_work():
            eng.step()
    return rows


def run_rank(rank: int, args, port: int, out_path: str) -> None:
    import os

    from gpu_tp import copy_bandwidth, join_ranks

    from tandem.engine import EngineConfig, LLMEngine

    dev, group = join_ranks(rank, args.ranks, port, args.smoke)
    cuda = dev.type == "cuda"
    res: dict = {"rank": rank, "ranks": args.ranks, "copy_bytes_per_s": copy_bandwidth(dev)}
    with torch.inference_mode():
        for layout in args.layouts:
            par, dispatch = _parallel(layout, group, rank)
            try:
                cfg = EngineConfig(model=args.model, load_format="dummy", device=str(dev),
                                   dtype="bfloat16" if cuda else "float32",
                                   attention_backend="flashinfer" if cuda else "torch",
                                   cuda_graphs=cuda, max_num_seqs=max(args.batch),
                                   max_model_len=args.ctx + 512, kv_cache_bytes=args.kv_bytes,
                                   max_num_batched_tokens=8192, moe_dispatch=dispatch,
                                   dp_decode_graphs=True)
                eng = LLMEngine.from_config(cfg, par)
                dp = par.num_dp_ranks
                res[layout] = bench(eng, rank, dp, args, res["copy_bytes_per_s"])
                del eng
            except Exception as exc:  # the other layouts still report
                import traceback

                traceback.print_exc()
                res[layout] = {"error": repr(exc)}
            if cuda:
                torch.cuda.empty_cache()
            if rank == 0:
                Path(out_path).write_text(json.dumps(res, default=str))
    # ncclCommDestroy hangs on communicators captured in CUDA graphs (pytorch#115388).
    os._exit(0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=Path("results"))
    ap.add_argument("--model", default="qwen3-30b-a3b")
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--batch", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--kv-bytes", type=int, default=16 << 30)
    ap.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=LAYOUTS)
    ap.add_argument("--ranks", type=int, default=2, help="GPUs (one process each)")
    ap.add_argument("--smoke", action="store_true", help="CPU + gloo, a tiny Qwen3-MoE")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.smoke:
        tmp = Path(tempfile.mkdtemp())
        (tmp / "config.json").write_text(json.dumps(TINY))
        args.model, args.ctx, args.steps, args.kv_bytes = str(tmp), 16, 3, 8 << 20
        args.batch = [args.ranks, 2 * args.ranks]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out_path = str(args.out / "gpu_moe_decode.json")
    mp.start_processes(run_rank, args=(args, port, out_path), nprocs=args.ranks,
                       start_method="spawn", join=True)
    res = json.loads(Path(out_path).read_text())
    print(f"\n{args.ranks} ranks ({args.model})")
    print(f"{'layout':<20} {'batch':>5} {'tok/s':>9} {'step ms':>8} {'floor ms':>9} "
          f"{'step/floor':>10} {'experts/layer':>13}")
    for layout in args.layouts:
        for r in res.get(layout) or []:
            if isinstance(r, dict) and "step_ms" in r:
                fl = r.get("floor_ms")
                print(f"{layout:<20} {r['batch']:>5} {r['tokens_per_s']:9.0f} {r['step_ms']:8.2f} "
                      f"{fl or 0:9.2f} {r['step_ms'] / fl if fl else 0:9.2f}x "
                      f"{r['experts_hit']:13.1f}")
        if isinstance(res.get(layout), dict):
            print(f"{layout}: {res[layout]}")


if __name__ == "__main__":
    main()
