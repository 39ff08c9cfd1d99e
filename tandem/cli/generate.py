"""`tandem generate`: a gRPC client that streams one answer from a running router."""

from __future__ import annotations

import argparse
import sys

from tandem.cli.common import add_sampling_args


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "generate", help="Send one prompt to a running `tandem serve` and stream the answer.",
        description="A gRPC client: streams the generated text to stdout, then prints usage, TTFT "
                    "and speed to stderr. Failures print the gRPC status code and the server's "
                    "message.")
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
    add_sampling_args(p, client=True)
    p.add_argument("--stop-token-id", type=int, action="append", default=[],
                   help="Stop token id (repeatable)")
    p.add_argument("--ignore-eos", action="store_true", help="Keep generating after EOS")
    p.add_argument("--logprobs", type=int, default=None, metavar="N",
                   help="Ask for each token's log-probability and its N most likely "
                        "alternatives (0-20; printed to stderr after the answer)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
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
        stop_token_ids=tuple(args.stop_token_id), ignore_eos=args.ignore_eos,
        logprobs=args.logprobs is not None, top_logprobs=args.logprobs)
    request = build_request(args.prompt, chat=args.chat, system=args.system, sampling=sampling,
                            model=args.model, prefill_worker=args.prefill_worker,
                            decode_worker=args.decode_worker, request_id=args.request_id)
    return stream_generate(cfg, request, sys.stdout, sys.stderr)
