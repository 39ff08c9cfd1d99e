"""`tandem bench`: benchmark a running router or deployments started on Ray."""

from __future__ import annotations

import argparse
import sys


def add_parser(subparsers) -> None:
    from tandem.bench.config import DEFAULT_CONCURRENCY, DEFAULTS

    d = DEFAULTS
    p = subparsers.add_parser(
        "bench", help="Benchmark serving: TTFT, TPOT, ITL, throughput, goodput, tau vs load.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Drive the gRPC router API, or an OpenAI-compatible HTTP front, at several "
                    "load levels and report TTFT, TPOT, ITL, request and token throughput, "
                    "p50/p90/p99, goodput under an SLO and the acceptance length tau "
                    "(speculative servers over gRPC), next to hardware floors. Writes one JSON "
                    "file (schema: tandem/bench/results.py) and a PNG plot.\n\n"
                    "Targets: --target HOST:PORT (or grpc://HOST:PORT) benchmarks a running "
                    "router over gRPC; --target http://HOST:PORT (or https://) benchmarks an "
                    "OpenAI-compatible HTTP front (`tandem serve --http-port`, or another "
                    "server): streamed /v1/completions with the prompt as token ids, "
                    "/v1/chat/completions for --dataset chat, output tokens from the usage it "
                    "reports, HTTP errors counted under the gRPC status names, tau n/a. "
                    "--config FILE (repeatable) starts each deployment on Ray (local, "
                    "--ray-address, or the cluster of a Ray job), benchmarks it, stops it, and "
                    "compares them all in one file. Bench configs are deployment YAMLs with optional name/mode/"
                    "speculative/bench keys (bundled: tandem/deploy/bench/*.yaml, e.g. "
                    "--config cpu-colocated).\n\n"
                    "Measurement flags left out take the configs' `bench:` values, else the "
                    "defaults shown.",
        epilog="examples:\n"
               "  tandem bench --target 127.0.0.1:50051 --concurrency 1,4 --num-requests 8\n"
               "  tandem bench --target http://127.0.0.1:8000 --concurrency 1,4 \\\n"
               "      --auth-token \"$TANDEM_AUTH_TOKEN\" --vocab-size 49152\n"
               "  tandem bench --config cpu-colocated --config cpu-disagg\n"
               "  ray job submit --working-dir . -- python -m tandem.cli bench \\\n"
               "      --config gpu-8b-colocated --config gpu-8b-disagg-nixl --out /tmp/b.json")
    g = p.add_argument_group("what to benchmark")
    g.add_argument("--target", action="append", default=[], metavar="HOST:PORT|URL",
                   help="A running server; the scheme picks the API: HOST:PORT or "
                        "grpc://HOST:PORT, tandem's gRPC router (`tandem serve`); "
                        "http(s)://HOST[:PORT], an OpenAI-compatible HTTP front (`tandem serve "
                        "--http-port`); repeatable")
    g.add_argument("--config", action="append", default=[], metavar="FILE",
                   help="A bench/deployment config to start, benchmark and stop (a path, or a "
                        "bundled name); repeatable: the runs are compared in one file")
    g.add_argument("--ray-address", default=None,
                   help="Ray cluster for --config (default: $RAY_ADDRESS, set inside a Ray job; "
                        "else a local Ray instance)")
    g.add_argument("--model", default="",
                   help="`model` field of --target requests (default: the served model)")
    g.add_argument("--auth-token", default=None,
                   help="Bearer token of a --target server, gRPC or HTTP (`authorization: "
                        "Bearer`; default: $TANDEM_AUTH_TOKEN)")
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
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
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
