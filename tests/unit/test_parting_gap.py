"""`LLMEngine.next_token_logits` (one prefill on borrowed pages) and `parting_gap`, the one
place demo, benchmarks and GPU tests read how close two greedy runs' tokens were."""

from __future__ import annotations

import torch
from spec_helpers import assert_pages_free, engine_cfg, greedy, prompts, tiny_target

from tandem.engine import LLMEngine
from tandem.spec.evaluate import parting_gap


def test_next_token_logits_are_the_greedy_steps_and_borrow_no_pages():
    eng = LLMEngine(engine_cfg(), tiny_target("llama"))
    for p in prompts(3, seed=3, lo=2, hi=30):
        out = eng.generate([p], greedy(4))[0].output_ids
        for j, tok in enumerate(out):
            row = eng.next_token_logits(p + list(out[:j]))  # [V] float32
            assert row.dtype == torch.float32 and row.dim() == 1
            assert int(row.argmax()) == tok
    assert_pages_free(eng)


def test_parting_gap_measures_the_top_two():
    eng = LLMEngine(engine_cfg(), tiny_target("llama"))
    ctx = prompts(1, seed=4, lo=5, hi=5)[0]
    row = eng.next_token_logits(ctx)
    top = row.topk(3)
    first, second, third = top.indices.tolist()
    gap = parting_gap(eng, ctx, (first, second))
    want = float(top.values[0] - top.values[1]) / max(1.0, float(top.values[0].abs()))
    assert gap.both_in_top2 and abs(gap.rel_gap - want) < 1e-7 and gap.rel_gap >= 0
    assert not parting_gap(eng, ctx, (first, third)).both_in_top2
    assert_pages_free(eng)
