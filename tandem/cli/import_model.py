"""`tandem import-model`: turn a GGUF into a HF checkpoint directory."""

from __future__ import annotations

import argparse
import sys


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "import-model", help="Import a GGUF into a HF checkpoint directory.",
        description="Without flags: import the bundled SmolLM2-135M-Instruct into the tandem "
                    "cache ($TANDEM_CACHE or ~/.cache/tandem) and print its path. With "
                    "--gguf/--out: convert any llama GGUF.")
    p.add_argument("--gguf", help="A llama-architecture GGUF file")
    p.add_argument("--out", help="Output directory (with --gguf)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
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
