"""`tandem soak`: the argument parser and runner of the soak (bench/soak.py). One command, one
module: `tandem/cli/app.py` only registers it."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from dataclasses import asdict
from pathlib import Path


def _prompts(path: str | None) -> tuple[str, ...]:
    if path is None:
        from importlib import resources

        text = resources.files("tandem").joinpath("assets/chat-prompts-50.txt").read_text()
    else:
        text = Path(path).read_text()
    prompts = tuple(line.strip() for line in text.splitlines() if line.strip())
    if not prompts:
        raise SystemExit(f"tandem soak: --prompts-file {path} has no prompts")
    return prompts


def add_parser(sub) -> None:
    p = sub.add_parser(
        "soak", help="Hold a running router under streaming load with client cancels and short "
                     "deadlines; check every request ends as it should and no KV page leaks.",
        description="N clients each send streaming chat requests one after another for "
                    "--duration seconds. A random --cancel-fraction of the requests is "
                    "cancelled by the client after a random delay and a --deadline-fraction "
                    "gets a short deadline; the rest must end OK. A probe times the router's "
                    "grpc.health.v1 Check meanwhile. Afterwards every worker must have all its "
                    "KV pages free. Prints counts per status, the worst deadline overrun, the "
                    "health latency percentiles and any unexpected outcome; exits 1 if any.",
        epilog="example:\n  tandem serve --config local --port 50051 &\n"
               "  tandem soak --target 127.0.0.1:50051 --clients 64 --duration 600",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", required=True, help="HOST:PORT of the router")
    p.add_argument("--clients", type=int, default=32, help="Default: %(default)s")
    p.add_argument("--duration", type=float, default=60.0, help="Seconds. Default: %(default)s")
    p.add_argument("--cancel-fraction", type=float, default=0.2, help="Default: %(default)s")
    p.add_argument("--deadline-fraction", type=float, default=0.2, help="Default: %(default)s")
    p.add_argument("--max-tokens", type=int, default=48, help="Default: %(default)s")
    p.add_argument("--prompts-file", default=None,
                   help="One prompt per line (default: the bundled 50 chat prompts)")
    p.add_argument("--allow-resource-exhausted", action="store_true",
                   help="Count RESOURCE_EXHAUSTED as expected (load over the router's bound)")
    p.add_argument("--auth-token", default=os.environ.get("TANDEM_AUTH_TOKEN"),
                   help="Bearer token (default: $TANDEM_AUTH_TOKEN)")
    p.add_argument("--seed", type=int, default=0, help="Default: %(default)s")
    p.add_argument("--out", default=None, help="Also write the report as JSON here")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from tandem.bench.soak import SoakConfig, run_soak

    try:
        cfg = SoakConfig(target=args.target, clients=args.clients, duration_s=args.duration,
                         cancel_fraction=args.cancel_fraction,
                         deadline_fraction=args.deadline_fraction, max_tokens=args.max_tokens,
                         prompts=_prompts(args.prompts_file),
                         allow_resource_exhausted=args.allow_resource_exhausted,
                         auth_token=args.auth_token, seed=args.seed)
    except ValueError as exc:
        print(f"tandem soak: {exc}", file=sys.stderr)
        return 2
    report = asyncio.run(run_soak(cfg, progress=sys.stderr.isatty()))
    print(report.summary())
    if args.out:
        data = report_json(report) | {"config": {
            k: v for k, v in asdict(cfg).items() if k not in ("prompts", "auth_token")}}
        Path(args.out).write_text(json.dumps(data, indent=1, default=str))
    return 0 if report.ok else 1


def report_json(report) -> dict:
    """The report as JSON values (asdict would turn its Counters into Counters of pairs)."""
    from tandem.bench.soak import percentile

    return {
        "ok": report.ok, "duration_s": report.duration_s, "num_requests": report.num_requests,
        "counts": dict(report.counts), "by_kind": {k: dict(c) for k, c in report.by_kind.items()},
        "failures": report.failures, "tokens": report.tokens,
        "max_deadline_overrun_s": max(report.deadline_overrun_s, default=None),
        "max_cancel_latency_s": max(report.cancel_latency_s, default=None),
        "router_health_ms": {"p50": percentile(report.health_ms, 50),
                             "p99": percentile(report.health_ms, 99),
                             "max": max(report.health_ms, default=None),
                             "probes": len(report.health_ms),
                             "failed": report.health_failures},
        "worker_health_ms": {n: {"p50": a, "p99": b}
                             for n, (a, b) in report.worker_health_ms.items()},
        "leaks": report.leaks,
    }
