"""One step's plan under a k policy (`plan_round`): which k its round drafts, and which rows
draft at all, from each row's per-position acceptance estimate and a price list of steps
(`Prices`: the `StepCostTable`, or the policy's served view of it, spec/served.py). Pure
Python, no torch; the maths of spec/adaptive.py's module docstring."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol


class Prices(Protocol):
    """Seconds of a step of k drafts per request over a batch (k = 0: a plain round)."""

    @property
    def max_k(self) -> int: ...

    def cost(self, k: int, batch_size: int) -> float: ...


def expected_tokens(p: Sequence[float], k: int) -> float:
    """E(k) = 1 + sum_{j=1..k} prod_{i<=j} p_i: tokens a k-draft round commits on average."""
    return _expected_by_k(p, k)[k]


def _expected_by_k(p: Sequence[float], max_k: int) -> list[float]:
    """[E(0), E(1), .., E(max_k)] in one pass (`expected_tokens` for every k)."""
    out, total, run = [1.0], 1.0, 1.0
    for j in range(max_k):
        run *= p[j]
        total += run
        out.append(total)
    return out


def break_even(table: Prices, k: int, batch_size: int) -> float:
    """Expected tokens a request must commit per k-round for its drafting to pay."""
    return table.cost(k, batch_size) / table.cost(0, batch_size)


@dataclass(frozen=True, slots=True, kw_only=True)
class RoundPlan:
    """What one step runs: rows with `drafting[r]` in a round of `num_drafts` drafts, the
    others (if any) in a plain round (k = 0) of the same step."""

    num_drafts: int  # k of the drafting round (0: the whole step is plain)
    drafting: tuple[bool, ...]  # [bs] per row of the step, in the caller's order

    @property
    def splits(self) -> bool:
        return self.num_drafts > 0 and not all(self.drafting)


def plan_round(table: Prices, estimates: Sequence[Sequence[float]], max_k: int,
               allow_split: bool = True, keep_k: int = 0, keep_margin: float = 0.0) -> RoundPlan:
    """The plan of highest expected tokens per second for a batch whose rows have
    `estimates` (per-position acceptance, each at least max_k long); an unsplit round at
    `keep_k` stands against another unsplit round of k > 0 unless that wins by `keep_margin`."""
    bs, max_k = len(estimates), min(max_k, table.max_k)
    plain = table.cost(0, bs)
    best, best_rate = RoundPlan(num_drafts=0, drafting=(False,) * bs), bs / plain
    kept_rate = 0.0  # keep_k's unsplit rate (0: keep_k not among the k tried)
    # (on the host's critical path every round: E(k) of every row by k in one pass, each
    # row's cumulative product carried from one k to the next)
    gains, run = [1.0] * bs, [1.0] * bs
    for k in range(1, max_k + 1):
        for r, p in enumerate(estimates):
            run[r] *= p[k - 1]
            gains[r] += run[r]
        cost = table.cost(k, bs)
        rate = sum(gains) / cost
        kept_rate = rate if k == keep_k else kept_rate
        if rate > best_rate:
            best, best_rate = RoundPlan(num_drafts=k, drafting=(True,) * bs), rate
        if not allow_split:
            continue
        need = cost / plain  # `break_even`
        pays = tuple([g >= need for g in gains])
        n = sum(pays)
        if 0 < n < bs:  # split: drafting rows at k, the rest in a plain round
            split_tokens = sum(g for g, d in zip(gains, pays) if d) + (bs - n)
            rate = split_tokens / (table.cost(k, n) + table.cost(0, bs - n))
            if rate > best_rate:
                best, best_rate = RoundPlan(num_drafts=k, drafting=pays), rate
    if (kept_rate and best.num_drafts not in (0, keep_k) and not best.splits
            and best_rate < kept_rate * (1.0 + keep_margin)):
        return RoundPlan(num_drafts=keep_k, drafting=(True,) * bs)
    return best
