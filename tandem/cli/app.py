"""The top-level `tandem` parser and `main`. Each command lives in its own module with
`add_parser(subparsers)` and `run(args) -> int`; this module only registers them, in the order
`tandem --help` lists them, and turns a config error into exit status 2."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from tandem.cli import (
    bench,
    complete,
    demo,
    draft_vocab,
    eval_eagle,
    gen_proto,
    generate,
    import_model,
    ray_token,
    serve,
    train_eagle,
)
from tandem.cli.common import configure_logging

# Command modules import only the standard library at import time (their add_parser may import
# light tandem modules): `tandem --help` must run where gRPC, Ray or torch cannot load.
COMMANDS = (demo, complete, train_eagle, draft_vocab, eval_eagle, import_model, serve, generate,
            gen_proto, ray_token, bench)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tandem",
        description="Disaggregated LLM serving with EAGLE speculative decoding on Ray.",
    )
    parser.add_argument("--log-level", default="WARNING",
                        choices=["DEBUG", "INFO", "WARNING", "ERROR"], help="Default: %(default)s")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in COMMANDS:
        command.add_parser(subparsers)
    # `tandem soak` lives with the soak it drives; imported here so that `import tandem.cli`
    # stays free of the bench package.
    from tandem.bench import soak_command

    soak_command.add_parser(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    configure_logging(args.log_level)
    try:
        return int(args.func(args) or 0)
    except (ValueError, FileNotFoundError) as exc:
        print(f"tandem {args.command}: error: {exc}", file=sys.stderr)
        return 2
