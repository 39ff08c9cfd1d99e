"""Where an EAGLE head's top-1 accuracy goes between its training data and chat, on the CPU.

`train-eagle` logs a training top-1 accuracy per draft step of ~0.66 / 0.63 / 0.59 for the
shipped SmolLM2 head, while `eval-eagle` on the 50 chat prompts measures P(draft j accepted)
0.53 / 0.28 / 0.15 / 0.08 (conditional ~0.53 at every position). This script measures the same
teacher-forced quantity the training logs (`ttt_forward`, the training's own code) on
  (a) answers the head was trained on, or any other named set (`--samples NAME=FILE`), and
  (b) the target's own greedy answers to the chat prompts (`--prompts-file`),
per draft step, over the whole vocabulary and over the head's draft vocabulary, and split by
the position in the answer. (a) vs (b) is the prompts' distribution; (b) vs eval-eagle's
acceptance is any difference between the training forward and inference.

    python benchmarks/head_gap.py [--model DIR] [--head DIR] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tandem.engine import EngineConfig, LLMEngine  # noqa: E402
from tandem.spec.head_config import read_head_checkpoint  # noqa: E402
from tandem.spec.shipped import SHIPPED_HEADS  # noqa: E402
from tandem.spec.train import init_head, start_from, target_batch  # noqa: E402
from tandem.spec.train_config import TrainConfig  # noqa: E402
from tandem.spec.train_data import generate_samples, read_samples  # noqa: E402
from tandem.spec.ttt import ttt_forward  # noqa: E402

BUCKETS = ((0, 16), (16, 64), (64, 128), (128, 10_000))  # answer positions


@torch.no_grad()
def accuracy(engine, head, samples, draft_ids, steps: int, batch: int, max_len: int) -> dict:
    """Teacher-forced top-1 per step: counts over the whole vocabulary and the draft one, and
    per bucket of answer position (whole vocabulary)."""
    full = torch.zeros(steps)
    draft = torch.zeros(steps)
    total = torch.zeros(steps)
    by_pos = torch.zeros(steps, len(BUCKETS), 2)  # [step, bucket, (correct, total)]
    in_draft = torch.zeros(engine.model_cfg.vocab_size, dtype=torch.bool)
    in_draft[draft_ids] = True
    for i in range(0, len(samples), batch):
        chunk = samples[i : i + batch]
        tb = target_batch(engine, chunk, head, max_len)
        outs = ttt_forward(head, tb.tokens, tb.features, steps)
        t = torch.arange(tb.mask.shape[1])[None, :].expand_as(tb.mask)
        answer_pos = t - tb.answer_start[:, None]  # 0: the first label that is an answer token
        for s, h in enumerate(outs):
            valid = tb.mask & (t >= s)
            logp = head.log_probs(h[valid])  # [n, V]
            labels = tb.labels[valid]
            hit = logp.argmax(-1) == labels
            masked = logp.masked_fill(~in_draft, float("-inf"))
            full[s] += hit.sum()
            draft[s] += (masked.argmax(-1) == labels).sum()
            total[s] += len(labels)
            pos = answer_pos[valid]
            for b, (lo, hi) in enumerate(BUCKETS):
                sel = (pos >= lo) & (pos < hi)
                by_pos[s, b, 0] += hit[sel].sum()
                by_pos[s, b, 1] += sel.sum()
    return {
        "tokens": int(total[0]),
        "top1_full": [round(float(x), 4) for x in full / total],
        "top1_draft_vocab": [round(float(x), 4) for x in draft / total],
        "top1_by_answer_position": {
            f"{lo}-{hi}": [round(float(by_pos[s, b, 0] / max(by_pos[s, b, 1], 1)), 4)
                           for s in range(steps)]
            for b, (lo, hi) in enumerate(BUCKETS)},
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None,
                    help="SmolLM2-135M-Instruct directory (default: the bundled model)")
    ap.add_argument("--head", default=str(SHIPPED_HEADS["default"]))
    ap.add_argument("--prompts-file", default=str(ROOT / "tandem/assets/chat-prompts-50.txt"))
    ap.add_argument("--samples", action="append", default=None, metavar="NAME=JSONL",
                    help="a named set of answers (samples.jsonl[.gz]) to measure next to the "
                         "chat prompts' own; repeatable. Default: the answers the shipped head "
                         "trained on, a=benchmarks/data/smollm2-answers-a.jsonl.gz and b=...-b")
    ap.add_argument("--num-samples", type=int, default=100, help="answers drawn from each set")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--steps", type=int, default=3, help="unrolled draft steps (TTT)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None, help="write the result as JSON here")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    sets = dict(x.split("=", 1) for x in args.samples or [
        f"{n}={ROOT / f'benchmarks/data/smollm2-answers-{n}.jsonl.gz'}" for n in ("a", "b")])
    if args.model is None:
        from tandem.engine.model_import import ensure_default_model

        args.model = str(ensure_default_model())
    engine = LLMEngine.from_config(EngineConfig(model=args.model, dtype=args.dtype,
                                                num_pages=4096, max_num_batched_tokens=4096))
    head = init_head(engine, TrainConfig(out_dir="unused", kind="eagle"), None)
    start_from(head, Path(args.head))
    head.eval()
    _, state = read_head_checkpoint(Path(args.head))
    n_draft = len(state["d2t"])
    draft_ids = torch.arange(n_draft) + state["d2t"]

    prompts = [line.strip() for line in Path(args.prompts_file).read_text().splitlines()
               if line.strip()]
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "chat.jsonl"
        for _ in generate_samples(engine, prompts, path, args.max_new_tokens, 16, False):
            pass
        chat = read_samples(path)
    max_len = 640
    result = {"head": args.head, "dtype": args.dtype, "steps": args.steps,
              "chat": accuracy(engine, head, chat, draft_ids, args.steps, 8, max_len)}
    print("chat", json.dumps(result["chat"]), flush=True)
    for name, path in sets.items():
        got = read_samples(Path(path))
        got = random.Random(0).sample(got, min(args.num_samples, len(got)))
        result[name] = accuracy(engine, head, got, draft_ids, args.steps, 8, max_len)
        result[name]["file"] = path
        print(name, json.dumps(result[name]), flush=True)
    text = json.dumps(result, indent=1)
    if args.out:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
