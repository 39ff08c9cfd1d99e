"""The repository's bf16 near-tie rule for GPU tests (docs/architecture.md, "Lossless"): two
greedy runs of the same model may part only where plain's two best logits are within 2% of the
logit scale and both runs' tokens are those two (`spec.evaluate.parting_gap` measures it)."""

from __future__ import annotations

from collections.abc import Sequence

from tandem.spec.evaluate import parting_gap

NEAR_TIE = 0.02  # of the logit scale


def first_parting(a: Sequence[int], b: Sequence[int]) -> int | None:
    """The first index where `a` and `b` differ (None: none within the shorter)."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


def assert_parts_only_at_near_ties(plain, prompts, got, want, top2: bool = True) -> None:
    """For every prompt, `got` (token ids) equals `want` up to where they first part, and there
    the two tokens are a near-tie of `plain`'s logits after the common prefix. top2=False
    (TP against one GPU: the row-parallel sums add in another order) also lets `got` take
    another candidate there whose logit is within NEAR_TIE of `plain`'s best."""
    for p, a, b in zip(prompts, got, want):
        d = first_parting(a, b)
        if d is None:
            continue
        context = list(p) + list(b[:d])
        tie = parting_gap(plain, context, (a[d], b[d]))
        if not tie.both_in_top2 and not top2:
            logits = plain.next_token_logits(context)
            top = float(logits.max())
            gap = (top - float(logits[a[d]])) / max(1.0, abs(top))
            assert gap <= NEAR_TIE, (d, tie, gap)
            continue
        assert tie.both_in_top2 and tie.rel_gap <= NEAR_TIE, (d, tie)
