"""The adaptive policy's choices under a GPU's cost table, replayed on the CPU.

The policy decides from its cost table and the acceptance it observes, not from the clock
(except `served`, which this replay turns off: CPU step times say nothing of a GPU's). So a
closed loop on the CPU with a table a GPU profiled (the `adaptive_table` of a
`gpu_spec_chat.py` JSON) makes the choices that GPU's engine would make on the same prompts,
up to float32-vs-bf16 differences in acceptance. Prints the steps by kind (after an arrival,
the others) and the sequence of step paths: S = a speculative prompt step (target and draft
prefill), P = a plain-regime step, R = a round.

    python benchmarks/policy_replay.py --table docs/perf-data/s19/chat_sweep_arrival/gpu_spec_chat.json \\
        --concurrency 4 --num-prompts 24 --max-new-tokens 64
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

from gpu_spec_chat import closed_loop  # noqa: E402

from tandem.engine import EngineConfig, SamplingParams  # noqa: E402
from tandem.spec import SpecConfig, SpecEngine  # noqa: E402
from tandem.spec.adaptive import AdaptivePolicy, StepCostTable  # noqa: E402
from tandem.spec.shipped import SHIPPED_HEADS  # noqa: E402
from tandem.tokenizer import ChatMessage  # noqa: E402


class TableOnly(AdaptivePolicy):
    """The adaptive policy without `served`: the table's prices stay the GPU's."""

    def served(self, batch_size: int, seconds: float, num_drafts: int | None) -> None:
        pass


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--table", type=Path, required=True,
                    help="a gpu_spec_chat.py JSON (its adaptive_table) or a StepCostTable JSON")
    ap.add_argument("--model", default=None, help="default: the bundled SmolLM2")
    ap.add_argument("--draft-model", default=str(SHIPPED_HEADS["default"]))
    ap.add_argument("--prompts-file", default=str(ROOT / "tandem/assets/chat-prompts-50.txt"))
    ap.add_argument("--concurrency", default="4",
                    help="comma list: levels run one after another on the same engine (as "
                         "gpu_spec_chat.py's sweep does), e.g. 1,4")
    ap.add_argument("--num-prompts", type=int, default=24)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=0)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    raw = json.loads(args.table.read_text())
    table = StepCostTable.from_json(json.dumps(raw.get("adaptive_table", raw)))
    if args.model is None:
        from tandem.engine.model_import import ensure_default_model

        args.model = str(ensure_default_model())
    cfg = EngineConfig(model=args.model, dtype="float32", max_num_seqs=64, max_model_len=1024,
                       kv_cache_bytes=256 << 20)
    with torch.inference_mode():
        eng = SpecEngine.from_config(cfg, SpecConfig(draft_model=args.draft_model, num_steps=4))
        eng.spec_scheduler.policy = TableOnly(table=table, max_k=eng.spec.num_steps)
        paths: list[str] = []
        plain_step, prefill_step, spec_round = eng.plain_step, eng._prefill_step, eng._spec_round

        def traced_plain():
            paths.append("P")
            return plain_step()

        def traced_prefill(plan):
            paths.append("S")
            return prefill_step(plan)

        ks: list[int] = []  # each round's k: on a GPU a change of k drops the drafting queued
        # ahead for the old k (spec/ahead.py), a cost the profile (fixed k) never timed

        def traced_round(inp, ahead=False):
            paths.append("R")
            ks.append(inp.num_drafts)
            return spec_round(inp, ahead)

        eng.plain_step, eng._prefill_step, eng._spec_round = (traced_plain, traced_prefill,
                                                              traced_round)
        questions = [q.strip() for q in Path(args.prompts_file).read_text().splitlines()
                     if q.strip()][: args.num_prompts]
        prompts = [eng.tokenizer.encode_chat([ChatMessage(role="user", content=q)])
                   for q in questions]
        for level in (int(c) for c in args.concurrency.split(",")):
            paths.clear()
            ks.clear()
            _, _, times = closed_loop(eng, prompts,
                                      SamplingParams(max_new_tokens=args.max_new_tokens), level)
            pol = eng.spec_scheduler.policy
            st = times["steps"]
            print(f"== c={level}")
            for part in ("arrival", "other"):
                kinds = st[f"{part}_by_kind"]
                print(f"{part}: " + ", ".join(f"{k} {v['steps']}" for k, v in kinds.items()))
            print(f"step paths: {dict(collections.Counter(paths))}")
            switches = sum(a != b for a, b in zip(ks, ks[1:]))
            print(f"rounds by k: {dict(sorted(collections.Counter(ks).items()))}, "
                  f"k changed between consecutive rounds {switches} times")
            print("".join(paths))
            print("after: engine-wide estimate " + " ".join(f"{p:.3f}" for p in pol.overall)
                  + f", output_len {pol.output_len:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
