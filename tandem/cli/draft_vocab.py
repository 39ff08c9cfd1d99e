"""`tandem draft-vocab`: restrict an EAGLE-1/2 head to the tokens the target emits most."""

from __future__ import annotations

import argparse
import sys


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "draft-vocab",
        help="Restrict an EAGLE-1/2 head to a reduced draft vocabulary (fewer lm_head rows read "
             "per draft step).",
        description="Write a copy of an EAGLE-1/2 head that drafts over the SIZE tokens the "
                    "target emits most often in the given samples (train-eagle's "
                    "samples.jsonl[.gz]). Output stays lossless (the target verifies); each draft "
                    "step reads SIZE lm_head rows instead of the whole vocabulary.")
    p.add_argument("--head", required=True, help="EAGLE-1/2 head directory")
    p.add_argument("--samples", action="append", required=True, metavar="JSONL",
                   help="Self-distilled answers (samples.jsonl[.gz]); repeatable")
    p.add_argument("--size", type=int, default=8192, help="Draft vocabulary. Default: %(default)s")
    p.add_argument("--out", required=True, help="Output head directory")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
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
