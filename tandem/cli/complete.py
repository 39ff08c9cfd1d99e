"""`tandem complete`: stream one completion from the in-process engine (no server)."""

from __future__ import annotations

import argparse
import sys
import time

from tandem.cli.common import (
    add_engine_args,
    add_sampling_args,
    engine_config_from_args,
    sampling_params_from_args,
)


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "complete", help="Generate from one prompt with the in-process engine.",
        description="Stream a completion of PROMPT to stdout (no server).")
    p.add_argument("prompt", help="Prompt text")
    p.add_argument("--chat", action="store_true", help="Wrap the prompt as a user chat message")
    add_engine_args(p)
    add_sampling_args(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from tandem.engine import LLMEngine
    from tandem.tokenizer import ChatMessage

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
