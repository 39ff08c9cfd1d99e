"""`tandem eval-eagle`: measure a draft head's acceptance length on held-out prompts."""

from __future__ import annotations

import argparse
import sys

from tandem.cli.common import add_engine_args, engine_config_from_args


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "eval-eagle", help="Measure an EAGLE head's acceptance length.",
        description="Greedy speculative decoding of held-out chat prompts: prints the mean "
                    "acceptance length tau, acceptance per draft position, and how many answers "
                    "equal the target alone.")
    p.add_argument("--draft-model", default=None,
                   help="Head directory (default: the head shipped for the default model)")
    p.add_argument("--num-draft-steps", type=int, default=4, help="Default: %(default)s")
    p.add_argument("--draft-topk", type=int, default=1, help="Default: %(default)s")
    p.add_argument("--num-draft-tokens", type=int, default=None,
                   help="Tree nodes verified per round, root included (default: num_draft_steps "
                        "* draft_topk + 1, every node drafted)")
    p.add_argument("--max-new-tokens", type=int, default=128, help="Default: %(default)s")
    p.add_argument("--prompts-file", default=None, metavar="TXT",
                   help="Chat prompts to measure on, one per line (default: the 10 held-out "
                        "questions whose subjects no training prompt mentions; "
                        "tandem/assets/chat-prompts-50.txt holds 50 more that no training prompt "
                        "contains)")
    add_engine_args(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from tandem.spec import SpecConfig
    from tandem.spec.evaluate import evaluate_head

    spec = SpecConfig(draft_model=args.draft_model, num_steps=args.num_draft_steps,
                      topk=args.draft_topk, num_draft_tokens=args.num_draft_tokens)
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
          f"({'chain' if spec.topk == 1 else 'tree'} k={spec.num_steps} topk={spec.topk} "
          f"nodes={spec.tree_size}, greedy, {args.dtype}); "
          f"P(draft j accepted) j=1..{len(r.per_position)}: {per_pos}; "
          f"identical to the target alone: {r.num_identical}/{r.num_prompts}")
    return 0
