"""Prefill/decode workers on GPUs, TP inside the workers: start each deployment on a local Ray
instance of the GPU machine, check its greedy outputs against the colocated single-GPU engine,
then measure output throughput and TTFT at a few concurrencies. Run it through
benchmarks/gpu_workers.sh (it activates the bundle); see that file for the machine kinds.

Deployments (benchmarks/workers-*.yaml; the model and head paths are filled in here):
  2gpu      1 prefill + 1 decode worker, one GPU each, KV over NIXL
  4gpu-tp2  1 prefill worker of TP=2 + 1 decode worker of TP=2 (4 GPUs, NCCL inside each
            worker, prefill rank r -> decode rank r over NIXL)

Model: SmolLM2-135M's shape (30 layers, hidden 576 -> here 512 so that heads split over TP=2:
8 query heads / 4 KV heads of 64, intermediate 1536, vocab 49152, tied embeddings) with dummy
weights, and a random EAGLE-1 head (tau ~ 1: this measures the machinery, not acceptance).

Equality rule. float32 (`--dtype float32 --attention-backend torch`): every request's tokens
must equal the colocated engine's exactly. bf16: a request may diverge from the colocated output
only at a near-tie: at its first differing position the colocated model's float32 logits of the
two candidate tokens (one forward over prompt + the shared prefix) must be within `--margin`
(absolute, default 0.02); everything after that point is not compared. Any other difference
fails the run (exit code 1). The JSON records every divergence with its gap.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent
DEPLOYMENTS = {"2gpu": HERE / "workers-2gpu.yaml", "4gpu-tp2": HERE / "workers-4gpu-tp2.yaml"}

SMOLLM2_TP_SHAPE = {
    "architectures": ["LlamaForCausalLM"], "vocab_size": 49152, "hidden_size": 512,
    "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 8,
    "num_key_value_heads": 4, "head_dim": 64, "rms_norm_eps": 1e-5, "rope_theta": 100000.0,
    "max_position_embeddings": 8192, "tie_word_embeddings": True, "bos_token_id": 1,
    "eos_token_id": 2, "torch_dtype": "bfloat16",
}


def make_model_and_head(root: Path, num_layers: int) -> tuple[Path, Path]:
    """A config-only model directory (dummy weights) and a random EAGLE-1 head directory."""
    import torch
    from safetensors.torch import save_file

    from tandem.engine import EngineConfig, ParallelContext, build_model, resolve_model
    from tandem.spec import DraftHeadConfig, dummy_head

    model_dir, head_dir = root / "model", root / "head"
    model_dir.mkdir(parents=True, exist_ok=True)
    (model_dir / "config.json").write_text(json.dumps({**SMOLLM2_TP_SHAPE,
                                                       "num_hidden_layers": num_layers}))
    ecfg = EngineConfig(model=str(model_dir), load_format="dummy", dtype="float32")
    mcfg, path = resolve_model(ecfg)
    model = build_model(mcfg, path, ecfg, ParallelContext(), 4096)
    head = dummy_head(DraftHeadConfig.like_target(mcfg, "eagle"), model, torch.float32,
                      torch.device("cpu"), 4096, seed=5)
    head_dir.mkdir(exist_ok=True)
    save_file(head.state_for_saving(), str(head_dir / "model.safetensors"))
    (head_dir / "config.json").write_text(json.dumps(head.cfg.to_json()))
    return model_dir, head_dir


def load_deployment(name: str, model_dir: Path, head_dir: Path, args):
    from tandem.deploy.config import parse_deploy

    raw = yaml.safe_load(DEPLOYMENTS[name].read_text())
    raw["engine"].update(model=str(model_dir), load_format="dummy", dtype=args.dtype,
                         attention_backend=args.attention_backend, cuda_graphs=args.cuda_graphs)
    raw["spec"]["draft_model"] = str(head_dir)
    if args.device == "cpu":  # smoke test of this script on a machine without GPUs
        raw["engine"].update(device="cpu", num_pages=512)
        raw["engine"].pop("kv_cache_bytes", None)
        raw["transfer_backend"] = "mooncake"
        for role in ("prefill", "decode"):
            raw[role].update(num_gpus=0, num_cpus=0.5, torch_threads=1)
    return parse_deploy(raw)


def requests(n: int, prompt_len: int, max_new: int, seed: int):
    from tandem.engine import SamplingParams

    rng = random.Random(seed)
    prompts = [[rng.randrange(3, 49152) for _ in range(rng.randint(prompt_len // 2, prompt_len))]
               for _ in range(n)]
    return prompts, [SamplingParams(max_new_tokens=max_new, ignore_eos=True)] * n


def logit_gap(engine, ids: list[int], a: int, b: int) -> float:
    """|logit(a) - logit(b)| of the colocated model's next-token logits after `ids`."""
    row = engine.next_token_logits(ids)
    return float((row[a] - row[b]).abs())


def compare(reference, got, prompts, engine, margin: float, exact: bool) -> dict:
    """The equality rule of the module docstring; returns a summary (ok, divergences)."""
    divergences, ok = [], True
    for i, (want, have) in enumerate(zip(reference, got)):
        if tuple(want) == tuple(have):
            continue
        j = next((k for k, (x, y) in enumerate(zip(want, have)) if x != y),
                 min(len(want), len(have)))
        if j >= min(len(want), len(have)):  # one is a prefix of the other: a length bug
            divergences.append({"request": i, "position": j, "gap": None, "ok": False})
            ok = False
            continue
        gap = logit_gap(engine, list(prompts[i]) + list(want[:j]), want[j], have[j])
        near_tie = not exact and gap <= margin
        ok &= near_tie
        divergences.append({"request": i, "position": j, "colocated": want[j],
                            "disaggregated": have[j], "gap": gap, "ok": near_tie})
    return {"ok": ok, "num_requests": len(reference),
            "num_identical": len(reference) - len(divergences), "divergences": divergences}


async def run_requests(dispatcher, prompts, params, concurrency: int, room0: int):
    """Submit with at most `concurrency` in flight; per request (tokens, ttft_s, latency_s)."""
    from tandem.router.dispatch import Placement, RoutedRequest

    sem = asyncio.Semaphore(concurrency)

    async def one(i):
        async with sem:
            req = RoutedRequest(request_id=f"b{room0 + i}", room=room0 + i, model="default",
                                prompt_ids=tuple(prompts[i]), params=params[i],
                                placement=Placement(prefill_worker="prefill-0",
                                                    decode_worker="decode-0"),
                                deadline=time.time() + 300)
            t0 = time.perf_counter()
            ttft, toks = None, []
            async for chunk in dispatcher.submit(req):
                if ttft is None and chunk.token_ids:
                    ttft = time.perf_counter() - t0
                toks.extend(chunk.token_ids)
            return tuple(toks), ttft, time.perf_counter() - t0

    return await asyncio.gather(*(one(i) for i in range(len(prompts))))


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def bench_deployment(name: str, args, model_dir: Path, head_dir: Path) -> dict:
    import torch

    from tandem.deploy.launcher import init_ray, launch
    from tandem.router.disagg import DisaggregatedDispatcher
    from tandem.router.dispatch import ModelInfo
    from tandem.spec import SpecEngine

    cfg = load_deployment(name, model_dir, head_dir, args)
    prompts, params = requests(args.check_requests, args.prompt_len, args.check_new_tokens, 1)
    t0 = time.perf_counter()
    colocated = SpecEngine.from_config(cfg.engine, cfg.spec)
    reference = [c.output_ids for c in colocated.generate(prompts, params)]
    print(f"[{name}] colocated reference: {len(prompts)} requests in "
          f"{time.perf_counter() - t0:.1f} s", flush=True)

    init_ray()
    t0 = time.perf_counter()
    dep = launch(cfg, startup_timeout_s=240)
    startup_s = time.perf_counter() - t0
    print(f"[{name}] deployment up in {startup_s:.1f} s (prefill tp={cfg.prefill.tp}, "
          f"decode tp={cfg.decode.tp})", flush=True)
    result: dict = {"deployment": name, "startup_s": startup_s, "dtype": args.dtype,
                    "prefill_tp": cfg.prefill.tp, "decode_tp": cfg.decode.tp, "runs": []}
    try:
        disp = DisaggregatedDispatcher(
            dep.prefill, dep.decode, dep.endpoints,
            ModelInfo(name="default", vocab_size=49152, max_model_len=8192,
                      max_request_tokens=8192), num_steps=cfg.spec.num_steps)
        got = asyncio.run(run_requests(disp, prompts, params, len(prompts), 1000))
        check = compare(reference, [g[0] for g in got], prompts, colocated, args.margin,
                        exact=args.dtype == "float32")
        result["check"] = check
        print(f"[{name}] equality: {check['num_identical']}/{check['num_requests']} identical, "
              f"{'OK' if check['ok'] else 'FAILED'}", flush=True)
        for c in args.concurrency:
            n = max(c * args.requests_per_slot, 4)
            bp, bparams = requests(n, args.prompt_len, args.max_new_tokens, 100 + c)
            t0 = time.perf_counter()
            runs = asyncio.run(run_requests(disp, bp, bparams, c, 100_000 * (c + 1)))
            wall = time.perf_counter() - t0
            out_tokens = sum(len(r[0]) for r in runs)
            ttfts = [r[1] for r in runs if r[1] is not None]
            row = {"concurrency": c, "num_requests": n, "wall_s": wall,
                   "output_tok_s": out_tokens / wall, "ttft_p50_s": pct(ttfts, 0.5),
                   "ttft_p90_s": pct(ttfts, 0.9),
                   "tpot_ms": 1000 * sum((r[2] - r[1]) / max(1, len(r[0]) - 1) for r in runs
                                         if r[1] is not None) / max(1, len(ttfts))}
            result["runs"].append(row)
            print(f"[{name}] c={c:3d}  {row['output_tok_s']:8.1f} tok/s  TTFT p50 "
                  f"{row['ttft_p50_s'] * 1000:7.1f} ms  p90 {row['ttft_p90_s'] * 1000:7.1f} ms  "
                  f"TPOT {row['tpot_ms']:6.2f} ms", flush=True)
    finally:
        dep.shutdown()
        del colocated
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--deploy", default="2gpu", help=f"comma list of {', '.join(DEPLOYMENTS)}")
    ap.add_argument("--out", default="/tmp/out")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--attention-backend", default="auto", choices=["auto", "torch", "flashinfer"])
    ap.add_argument("--cuda-graphs", action="store_true",
                    help="capture decode graphs (off: TP ranks would capture NCCL inside)")
    ap.add_argument("--margin", type=float, default=0.02)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                    help="cpu: smoke-test this script (tiny settings) without GPUs")
    ap.add_argument("--num-layers", type=int, default=30)
    ap.add_argument("--concurrency", default="1,8,32")
    ap.add_argument("--requests-per-slot", type=int, default=2)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--check-requests", type=int, default=8)
    ap.add_argument("--check-new-tokens", type=int, default=48)
    args = ap.parse_args()
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model_dir, head_dir = make_model_and_head(Path("/tmp/tandem-gpu-workers"), args.num_layers)
    results, ok = [], True
    for name in args.deploy.split(","):
        try:
            res = bench_deployment(name, args, model_dir, head_dir)
        except Exception as exc:  # report and go on with the next deployment
            import traceback

            traceback.print_exc()
            res = {"deployment": name, "error": repr(exc)}
        results.append(res)
        ok &= bool(res.get("check", {}).get("ok"))
        (out / "gpu_workers.json").write_text(json.dumps(results, indent=1))
    print("\ndeployment  tp  c    tok/s   TTFT p50 ms  TTFT p90 ms  equal")
    for res in results:
        for row in res.get("runs", []):
            print(f"{res['deployment']:10s} {res['decode_tp']:3d} {row['concurrency']:3d} "
                  f"{row['output_tok_s']:8.1f} {row['ttft_p50_s'] * 1000:12.1f} "
                  f"{row['ttft_p90_s'] * 1000:12.1f}  {res['check']['ok']}")
        if "error" in res:
            print(f"{res['deployment']:10s} ERROR {res['error'][:200]}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
