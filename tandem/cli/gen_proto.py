"""`tandem gen-proto`: regenerate (or --check) the checked-in protobuf code."""

from __future__ import annotations

import argparse
import sys


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "gen-proto", help="Regenerate the checked-in gRPC/protobuf Python code.",
        description="Run grpcio-tools on proto/tandem/v1/*.proto and write tandem/v1/*_pb2*.py "
                    "(dev dependency).")
    p.add_argument("--check", action="store_true",
                   help="Only compare with the checked-in files (exit 1 and print a diff if stale)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
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
