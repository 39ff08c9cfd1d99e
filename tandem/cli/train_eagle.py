"""`tandem train-eagle`: self-distil an EAGLE draft head from the target."""

from __future__ import annotations

import argparse
import sys

from tandem.cli.common import add_engine_args, engine_config_from_args


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "train-eagle", help="Train an EAGLE draft head by self-distillation.",
        description="Build chat prompts from text on this machine, let the target answer them "
                    "(stored, resumable), then train a draft head with the training-time test. "
                    "Re-running with the same --out resumes. The head is written to OUT/head.")
    p.add_argument("--out", required=True, help="Working directory (data, checkpoints, head)")
    p.add_argument("--kind", choices=["eagle", "eagle3"], default="eagle3",
                   help="Head architecture. Default: %(default)s")
    p.add_argument("--draft-vocab-size", type=int, default=8192,
                   help="Draft vocabulary: an EAGLE-3 head's own lm_head; an EAGLE-1/2 head "
                        "drafts over this many most frequent answer tokens (the vocabulary "
                        "size = all). Default: %(default)s")
    p.add_argument("--num-prompts", type=int, default=2000, help="Default: %(default)s")
    p.add_argument("--max-new-tokens", type=int, default=256,
                   help="Answer length per prompt. Default: %(default)s")
    p.add_argument("--gen-batch-size", type=int, default=32, help="Default: %(default)s")
    p.add_argument("--max-seq-len", type=int, default=512, help="Default: %(default)s")
    p.add_argument("--batch-size", type=int, default=8, help="Sequences per step. Default: %(default)s")
    p.add_argument("--epochs", type=int, default=2, help="Default: %(default)s")
    p.add_argument("--lr", type=float, default=5e-4, help="Default: %(default)s")
    p.add_argument("--ttt-steps", type=int, default=3,
                   help="Unrolled draft steps in training. Default: %(default)s")
    p.add_argument("--save-every", type=int, default=100, help="Default: %(default)s")
    p.add_argument("--seed", type=int, default=0, help="Default: %(default)s")
    p.add_argument("--extra-samples", action="append", default=[], metavar="JSONL",
                   help="More answered samples to train on (samples.jsonl[.gz] of an earlier "
                        "run); repeatable")
    p.add_argument("--vocab-samples", action="append", default=[], metavar="JSONL",
                   help="Answered samples whose tokens count toward the draft vocabulary only "
                        "(not trained on), so a stage on a narrow prompt set keeps the "
                        "vocabulary of every set the head serves; repeatable")
    p.add_argument("--init-head", default=None, metavar="DIR",
                   help="Start from this trained head (same kind and shape) instead of a random "
                        "init, e.g. the shipped one to train it further (default: random)")
    p.add_argument("--self-prompts", type=int, default=0, metavar="N",
                   help="Also answer N prompts the target writes itself (given only the chat "
                        "template up to a user turn, as Magpie does; kept in OUT/"
                        "self_prompts.jsonl). Default: %(default)s")
    p.add_argument("--num-layers", type=int, default=1,
                   help="Decoder layers of an EAGLE-1/2 head. With --init-head of a head with "
                        "fewer, the new layers start as copies of its last one with their output "
                        "projections zeroed (the grown head starts out computing the same). "
                        "Default: %(default)s")
    p.add_argument("--soft-labels", action="store_true",
                   help="Train against the target's whole next-token distribution (EAGLE's "
                        "loss; computed from the target's features, no extra forward) instead "
                        "of its greedy token alone")
    p.add_argument("--feature-weight", type=float, default=0.0, metavar="W",
                   help="EAGLE-1/2 heads: add W x smooth-L1 between each draft step's hidden "
                        "and the target's next feature (EAGLE-1's regression term). "
                        "Default: %(default)s (token loss alone)")
    p.add_argument("--self-prompt-style", choices=["open", "short"], default="open",
                   help="open: user turns started empty or with one opening word (long, varied "
                        "requests); short: started with a question phrase ('What is', 'How "
                        "does', ...) and kept under 120 characters. Default: %(default)s")
    p.add_argument("--max-train-seconds", type=float, default=None, metavar="S",
                   help="Bound the training loop to about S seconds: after 20 steps the run "
                        "plans the steps it can afford (at most --epochs' worth) and ends its "
                        "learning-rate schedule there, so the head is written in time. "
                        "Default: no bound")
    p.add_argument("--generate-only", action="store_true",
                   help="Only let the target answer the prompts (resumable), then stop")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0 = default)")
    p.add_argument("--no-progress", action="store_true")
    add_engine_args(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import torch

    from tandem.engine import LLMEngine
    from tandem.spec.train import TrainConfig, train
    from tandem.spec.train_answers import answer_prompts

    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = TrainConfig(
        out_dir=args.out, kind=args.kind, draft_vocab_size=args.draft_vocab_size,
        num_prompts=args.num_prompts, max_new_tokens=args.max_new_tokens,
        gen_batch_size=args.gen_batch_size, max_seq_len=args.max_seq_len,
        batch_size=args.batch_size, epochs=args.epochs, lr=args.lr, ttt_steps=args.ttt_steps,
        save_every=args.save_every, seed=args.seed, extra_samples=tuple(args.extra_samples),
        init_head=args.init_head, self_prompts=args.self_prompts,
        soft_labels=args.soft_labels, feature_weight=args.feature_weight,
        num_layers=args.num_layers, self_prompt_style=args.self_prompt_style,
        vocab_samples=tuple(args.vocab_samples), max_seconds=args.max_train_seconds,
    )
    engine = LLMEngine.from_config(engine_config_from_args(args))
    if engine.tokenizer is None:
        print("train-eagle: the target has no tokenizer.json", file=sys.stderr)
        return 2
    if args.generate_only:
        print(answer_prompts(engine, cfg, progress=not args.no_progress))
        return 0
    head_dir = train(engine, cfg, progress=not args.no_progress)
    print(head_dir)
    return 0
