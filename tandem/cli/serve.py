"""`tandem serve`: the gRPC API over one colocated engine, or over Ray workers (--config); with
--http-port (or the config's `http:`) the OpenAI-compatible HTTP API too, over the same router and
on the same event loop; with --otlp-endpoint (or the config's `observability:`) an OpenTelemetry
trace of every request."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys
import time
from typing import TYPE_CHECKING

from tandem.cli.common import add_engine_args, engine_config_from_args

if TYPE_CHECKING:  # the router imports gRPC: loaded only when the command runs
    from tandem.deploy.config import HttpFrontConfig
    from tandem.http_api import HttpConfig
    from tandem.router import RouterConfig
    from tandem.router.server import ServerConfig


def add_parser(subparsers) -> None:
    from tandem.router.policy import POLICIES

    p = subparsers.add_parser(
        "serve", help="Serve the gRPC API (router + a colocated engine worker).",
        description="Load the model into one colocated worker (prefill and decode in one engine) "
                    "and serve the tandem.v1.Router gRPC API, the grpc.health.v1 health service "
                    "and server reflection until Ctrl-C / SIGTERM; with --http-port, the "
                    "OpenAI-compatible HTTP API as well.")
    p.add_argument("--config", default=None,
                   help="Deployment YAML (deploy/*.yaml): start prefill and decode workers as "
                        "Ray actors on the cluster at --ray-address (or a local one) and serve "
                        "them disaggregated; engine flags given on the command line then "
                        "replace the config's engine fields")
    p.add_argument("--ray-address", default=None,
                   help="Ray cluster to use with --config (default: $RAY_ADDRESS, else local)")
    p.add_argument("--transfer", choices=["mooncake", "nixl"], default=None,
                   help="With --config: the KV transfer backend, instead of the config's "
                        "transfer_backend")
    p.add_argument("--host", default="127.0.0.1",
                   help="Address to bind (0.0.0.0 for all interfaces). Default: %(default)s")
    p.add_argument("--port", type=int, default=50051, help="Default: %(default)s")
    p.add_argument("--http-port", type=int, default=None,
                   help="Also serve the OpenAI-compatible HTTP API (/v1/chat/completions, "
                        "/v1/completions, /v1/models, /health) on this port, with the same "
                        "token, TLS and request size limit as gRPC (default: off; with --config, "
                        "the config's http.port)")
    p.add_argument("--http-host", default=None,
                   help="Address the HTTP API binds (default: the config's http.host, else "
                        "--host)")
    p.add_argument("--served-model-name", default=None,
                   help="Model name in the API (default: --model, or its directory name; with "
                        "--config, the config's model_name)")
    p.add_argument("--tensor-parallel-size", "--tp", dest="tp", type=int, default=1,
                   help="Colocated (no --config): split the model over this many ranks, one "
                        "process each on this host (on CUDA: GPUs 0..N-1); this process serves "
                        "and drives the others step by step. With --config: the config's "
                        "prefill.tp / decode.tp. Default: %(default)s")
    p.add_argument("--speculative", action="store_true",
                   help="Decode with EAGLE speculative decoding (off by default; with --config "
                        "the decode workers always do)")
    p.add_argument("--draft-model", default=None,
                   help="EAGLE head directory (with --speculative or --config; default: the "
                        "shipped head, or the config's spec.draft_model)")
    p.add_argument("--num-draft-steps", type=int, default=None,
                   help=f"Draft tokens per round (default: {DEFAULT_DRAFT_STEPS}, or the "
                        "config's spec.num_steps)")
    p.add_argument("--draft-topk", type=int, default=None,
                   help=f"Draft branches per step, 1 = chain (default: {DEFAULT_DRAFT_TOPK}, or "
                        "the config's spec.topk)")
    p.add_argument("--adaptive-spec", action="store_true",
                   help="Choose the draft tokens per step (0 .. --num-draft-steps) from measured "
                        "step costs and running acceptance, chain only (default: off, or the "
                        "config's spec.adaptive)")
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
    p.add_argument("--otlp-endpoint", default=None, metavar="URL",
                   help="Export an OpenTelemetry trace of every request over OTLP/HTTP to this "
                        "collector (e.g. http://localhost:4318; /v1/traces is appended unless "
                        "given); with --config the workers' spans too. Default: the config's "
                        "observability.otlp_endpoint, else $OTEL_EXPORTER_OTLP_TRACES_ENDPOINT / "
                        "$OTEL_EXPORTER_OTLP_ENDPOINT; none of them: no tracing")
    add_engine_args(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from tandem.router import RouterConfig
    from tandem.colocated_node import build_colocated_router
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
        if args.tp != 1:
            print("tandem serve: error: --tensor-parallel-size: with --config the workers' TP "
                  "is the config's (prefill.tp, decode.tp)", file=sys.stderr)
            return 2
        return _serve_disaggregated(args, server_cfg, router_cfg)
    if args.tp < 1:
        print(f"tandem serve: error: --tensor-parallel-size: must be >= 1, got {args.tp}",
              file=sys.stderr)
        return 2
    http_cfg = _http_config(args, server_cfg)
    tracing = _tracing(args, None)
    engine_cfg = engine_config_from_args(args)
    t0 = time.perf_counter()
    from tandem.colocated_node import tp_processes
    from tandem.spec.config import SpecConfig

    spec = SpecConfig(
        draft_model=args.draft_model, num_steps=_or(args.num_draft_steps, DEFAULT_DRAFT_STEPS),
        topk=_or(args.draft_topk, DEFAULT_DRAFT_TOPK),
        adaptive=args.adaptive_spec) if args.speculative else None
    tp = None
    if args.tp > 1:
        tp = tp_processes.launch(engine_cfg, spec, args.tp)
        engine = tp.engine
    else:
        engine = tp_processes.build_engine(engine_cfg, spec)
    model = args.served_model_name or _served_model_name(args.model)
    router = build_colocated_router(engine, model=model, cfg=router_cfg)
    fronts = _fronts(router, http_cfg)

    def ready(server) -> None:
        mode = ("speculative" if args.speculative else "target only") + (
            f", TP={args.tp}" if tp else "")
        print(f"tandem serve: model '{model}' ({mode}) loaded in {time.perf_counter() - t0:.1f} s; "
              f"listening on {args.host}:{server.port} ({'TLS' if server_cfg.tls else 'plaintext'}"
              f"{', token auth' if server_cfg.auth_token else ''}){_http_line(fronts)}{tracing}. "
              "Ctrl-C stops.", flush=True)

    if tp is None:
        return _serve(router, server_cfg, ready, fronts)
    rc = 1
    try:
        rc = _serve(router, server_cfg, ready, fronts)
    finally:
        router.dispatcher.stop_loops()  # no step after this
        if not tp.close():  # a rank died: end here, before any finaliser meets its group
            _exit_now(rc)
    return rc


def _exit_now(rc: int) -> None:
    """End the process with `rc` at once, flushing the logs and standard streams first. An
    exception on its way out (called from a `finally`) is printed: `os._exit` would drop it."""
    if sys.exc_info()[1] is not None:
        import traceback

        traceback.print_exc()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)


def _serve_disaggregated(args: argparse.Namespace, server_cfg: ServerConfig,
                         router_cfg: RouterConfig) -> int:
    """`tandem serve --config FILE`: prefill and decode workers as Ray actors."""

    from tandem.deploy.config import load_deploy
    from tandem.deploy.launcher import init_ray
    from tandem.deploy.serve import launch_and_build

    cfg = load_deploy(args.config)
    if args.transfer:
        cfg = dataclasses.replace(cfg, transfer_backend=args.transfer)
    cfg = dataclasses.replace(cfg, engine=engine_config_from_args(args, base=cfg.engine))
    cfg = _spec_flags_over(args, cfg)
    http_cfg = _http_config(args, server_cfg, cfg.http)
    tracing = _tracing(args, cfg.observability.otlp_endpoint)  # before the workers start
    t0 = time.perf_counter()
    init_ray(args.ray_address)
    print(f"tandem serve: starting {cfg.prefill.replicas} prefill + {cfg.decode.replicas} decode "
          f"workers ({cfg.transfer_backend}) ...", flush=True)
    dep, router = launch_and_build(cfg, router_cfg)
    fronts = _fronts(router, http_cfg)

    def ready(server) -> None:
        print(f"tandem serve: model '{cfg.model_name}' up in {time.perf_counter() - t0:.1f} s; "
              f"listening on {args.host}:{server.port}{_http_line(fronts)}{tracing}. "
              "Ctrl-C stops.", flush=True)

    try:
        return _serve(router, server_cfg, ready, fronts)
    finally:
        dep.shutdown()


def _serve(router, server_cfg: ServerConfig, ready, fronts: list) -> int:
    """Serve until Ctrl-C / SIGTERM; 1 with a message if a front cannot start."""
    import asyncio

    from tandem.router.app import serve

    try:
        asyncio.run(serve(router, server_cfg, on_ready=ready, fronts=fronts))
    except OSError as exc:  # a port is taken, the certificate unreadable, ...
        print(f"tandem serve: error: {exc}", file=sys.stderr)
        asyncio.run(router.close())
        return 1
    return 0


DEFAULT_DRAFT_STEPS = 4
DEFAULT_DRAFT_TOPK = 1


def _or(value, default):
    return default if value is None else value


def _spec_flags_over(args: argparse.Namespace, cfg):
    """The speculative and naming flags given with --config replace the config's fields (none
    is dropped without a word): --draft-model, --num-draft-steps, --draft-topk and
    --adaptive-spec the `spec:` section, --served-model-name `model_name`; --speculative
    changes nothing (the decode workers always draft) and says so."""
    if args.speculative:
        print("tandem serve: note: --speculative has no effect with --config (disaggregated "
              "decode always runs EAGLE; its settings are the config's spec: section)",
              file=sys.stderr)
    spec = {k: v for k, v in (("draft_model", args.draft_model),
                              ("num_steps", args.num_draft_steps),
                              ("topk", args.draft_topk),
                              ("adaptive", args.adaptive_spec or None)) if v is not None}
    if spec:
        cfg = dataclasses.replace(cfg, spec=dataclasses.replace(cfg.spec, **spec))
    if args.served_model_name:
        cfg = dataclasses.replace(cfg, model_name=args.served_model_name)
    return cfg


def _http_config(args: argparse.Namespace, server_cfg: ServerConfig,
                 deployed: HttpFrontConfig | None = None) -> HttpConfig | None:
    """The HTTP front's config (None: no HTTP front): port and host from the flags, else the
    deployment's `http:`; token, TLS and size limit as the gRPC front's."""
    from tandem.http_api import HttpConfig

    port = args.http_port if args.http_port is not None else (deployed and deployed.port)
    if port is None:
        if args.http_host is not None:
            raise ValueError("--http-host: needs --http-port (or http.port in the config)")
        return None
    if not 0 <= port <= 65535:
        raise ValueError(f"--http-port: must be in [0, 65535], got {port}")
    host = args.http_host or (deployed and deployed.host) or server_cfg.host
    return HttpConfig(host=host, port=port, auth_token=server_cfg.auth_token,
                      tls_cert=server_cfg.tls_cert, tls_key=server_cfg.tls_key,
                      max_body_bytes=server_cfg.max_message_bytes)


def _tracing(args: argparse.Namespace, configured: str | None) -> str:
    """Turn request tracing on when --otlp-endpoint, the config's observability.otlp_endpoint or
    the standard OTEL_EXPORTER_OTLP_(TRACES_)ENDPOINT names a collector (tandem/otel.py; the
    workers the launcher starts afterwards inherit it); the startup line's note about it."""
    import os

    from tandem import otel

    url = otel.endpoint_from(args.otlp_endpoint, configured, os.environ)
    if url is None:
        return ""
    otel.configure(url, "tandem-router")
    return f"; traces to {url}"


def _fronts(router, http_cfg: HttpConfig | None) -> list:
    from tandem.http_api import HttpServer

    return [] if http_cfg is None else [HttpServer(router, http_cfg)]


def _http_line(fronts: list) -> str:
    return "".join(f"; HTTP API on {f.cfg.host}:{f.port} ({'HTTPS' if f.cfg.tls else 'plaintext'})"
                   for f in fronts)


def _served_model_name(model: str) -> str:
    from pathlib import Path

    return Path(model).name if ("/" in model or Path(model).is_dir()) else model
