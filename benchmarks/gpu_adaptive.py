"""Adaptive speculation on a GPU: build an adaptive speculative engine -- CUDA graphs for every
k in 0..num_steps (spec/graph_set.py), then its step-cost table profiled through them (or read
from the cache) -- print the table, check that every k has its graphs, and print the k the
policy picks per batch size at a few acceptance levels; with --generate, tokens/s of plain
rounds at num_steps vs the adaptive engine on the chat prompts. --out writes it all as JSON.

    source .devbundle-fi/activate.sh; export PYTHONPATH=.:$PYTHONPATH
    python benchmarks/gpu_adaptive.py --model /tmp/gc/smollm2 --num-steps 4
    python benchmarks/gpu_adaptive.py --model llama-3.1-8b --load-format dummy   # costs only
    TANDEM_SPEC_COST_CACHE=0 python benchmarks/gpu_adaptive.py ...   # profile afresh

On a machine without CUDA it runs on the CPU with the engine's CPU grid (slow, but it shows
the shape of the output). Results go to docs/perf.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT)]

import torch  # noqa: E402

from tandem.engine import EngineConfig, SamplingParams  # noqa: E402
from tandem.spec import SpecConfig, SpecEngine  # noqa: E402
from tandem.spec.adaptive import expected_tokens, plan_round  # noqa: E402
from tandem.spec.cost_profile import cache_file  # noqa: E402
from tandem.tokenizer import ChatMessage  # noqa: E402

ACCEPTANCE = (0.2, 0.4, 0.6, 0.8, 0.9)  # the same p at every position


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="default")
    ap.add_argument("--num-steps", type=int, default=4)
    ap.add_argument("--generate", action="store_true",
                    help="also time generation, fixed num_steps vs adaptive")
    ap.add_argument("--load-format", choices=["auto", "dummy"], default="auto",
                    help="dummy: random weights of the model's shape (a preset name such as "
                         "smollm2-135m or llama-3.1-8b) and a random EAGLE head: for the cost "
                         "table only (acceptance is ~0)")
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--debug", action="store_true",
                    help="log every profiled k's time and what it queued ahead (spec/ahead.py)")
    ap.add_argument("--out", help="write the table, the policy's picks and the set-up as JSON")
    args = ap.parse_args()
    cuda = torch.cuda.is_available()
    cfg = EngineConfig(model=args.model, device="cuda" if cuda else "cpu",
                       dtype="bfloat16" if cuda else "float32",
                       attention_backend="flashinfer" if cuda else "torch", cuda_graphs=cuda,
                       max_num_seqs=128, max_model_len=2048, kv_cache_bytes=4 << 30,
                       load_format=args.load_format)
    draft = None
    if args.load_format == "dummy":
        from tandem.bench.dummy_head import write_dummy_head
        from tandem.engine import resolve_model

        draft = str(write_dummy_head(resolve_model(cfg)[0], cfg.dtype))
    spec = SpecConfig(num_steps=args.num_steps, draft_model=draft)
    notes: list[str] = []  # what graph capture and profiling log (times, memory)
    level = logging.DEBUG if args.debug else logging.INFO
    handler = logging.Handler(level)
    handler.emit = lambda rec: notes.append(rec.getMessage()) or print(rec.getMessage())
    logging.getLogger("tandem.spec").addHandler(handler)
    logging.getLogger("tandem.spec").setLevel(level)
    t0 = time.perf_counter()
    eng = SpecEngine.from_config(cfg, dataclasses.replace(spec, adaptive=True))
    build_s = time.perf_counter() - t0
    table = eng.spec_scheduler.policy.table  # type: ignore[union-attr]
    graphed = [k for k in range(spec.num_steps + 1) if eng._graphs_for(k) is not None]
    print(f"engine with graphs for k in {graphed} and its cost table: {build_s:.1f} s "
          f"(cache {cache_file(eng)})")
    if cuda and graphed != list(range(spec.num_steps + 1)):
        raise SystemExit(f"graphs missing: only k in {graphed}")
    print("batch | " + " | ".join(f"k={k} ms" for k in range(table.max_k + 1)))
    for b, row in zip(table.batch_sizes, table.seconds):
        print(f"{b:5d} | " + " | ".join(f"{s * 1e3:7.3f}" for s in row))
    print("\npolicy's k per batch size (rows: acceptance p at every position)")
    print("p    | " + " | ".join(f"bs={b}" for b in table.batch_sizes))
    picks = {}
    for p in ACCEPTANCE:
        est = (p,) * table.max_k
        ks = [plan_round(table, [est] * b, table.max_k, allow_split=False).num_drafts
              for b in table.batch_sizes]
        picks[str(p)] = ks
        print(f"{p:.2f} | " + " | ".join(f"{k:>4d}" for k in ks)
              + f"   (E(max k) = {expected_tokens(est, table.max_k):.2f})")
    if args.out:
        mem = torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0
        Path(args.out).write_text(json.dumps({
            "model": args.model, "load_format": args.load_format, "num_steps": args.num_steps,
            "device": torch.cuda.get_device_name() if cuda else "cpu",
            "graphed_ks": graphed, "build_seconds": build_s, "max_memory_gib": mem,
            "batch_sizes": list(table.batch_sizes),
            "ms": [[s * 1e3 for s in row] for row in table.seconds],
            "policy_k_by_acceptance": picks, "log": notes}, indent=1))
    if args.generate:
        _generate(cfg, spec, table, args)


def _generate(cfg: EngineConfig, spec: SpecConfig, table, args) -> None:
    import tempfile

    questions = [q.strip() for q in (ROOT / "tandem/assets/chat-prompts-50.txt").read_text()
                 .splitlines() if q.strip()][: args.num_prompts]
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        f.write(table.to_json())
    for name, s in (("fixed", spec),
                    ("adaptive", dataclasses.replace(spec, adaptive=True, cost_table=f.name))):
        eng = SpecEngine.from_config(cfg, s)
        tok = eng.tokenizer
        prompts = [tok.encode_chat([ChatMessage(role="user", content=q)])  # type: ignore
                   for q in questions]
        params = SamplingParams(max_new_tokens=args.max_new_tokens)
        t0 = time.perf_counter()
        done = eng.generate(prompts, params)
        dt = time.perf_counter() - t0
        n = sum(len(c.output_ids) for c in done)
        print(f"{name:8s}: {n} tokens in {dt:.2f} s = {n / dt:.1f} tok/s, "
              f"tau {eng.spec_stats.mean_acceptance_length:.2f}")


if __name__ == "__main__":
    main()
