"""The adaptive policy's price list (`StepCostTable`): what a step of k drafts costs at each
batch size, measured at start-up (spec/cost_profile.py) and cached under `POLICY_VERSION`.
Pure Python, no torch."""

from __future__ import annotations

import bisect
import json
from collections.abc import Sequence
from dataclasses import dataclass, field

# Bump when the table's meaning or the profiling changes (cache key). 2: every k runs in CUDA
# graphs (spec/graph_set.py), so tables of version 1 (k < num_steps eager) are stale. 3: the
# table also prices the plain engine's step (`StepCostTable.plain`), and a round is priced as
# the whole engine step (commit and stop checks included). 4: the least of 3 timed runs after
# two warm-ups on CUDA. 5: the profiled table is its monotone envelope. 6: rounds draft ahead
# (spec/ahead.py) and the head shards over TP (spec/head.py): both change what a round costs.
# 7: plain decode graphs plan on the device (engine/attention/device_decode.py), small decode
# launches split finer, chain draft steps skip the normalizer: plain steps and rounds both.
# 8: the table prices a prompt's arrival under rounds (`StepCostTable.arrival`). 9: rounds
# are timed without verifying ahead (spec/ahead.py, cost_profile.profile). 10: each sample
# times every k in turn over fresh requests of a 64-token prompt, and so do the plain steps;
# 5 samples on a GPU, 3 on the CPU (an H200 priced a batch-1 round of k=4 23% over k=3,
# served 6% over; H200s priced plain steps at 16-64 rows up to 1.6x over service, timed last
# over requests grown by ~500 tokens).
POLICY_VERSION = 10


@dataclass(frozen=True, slots=True, kw_only=True)
class StepCostTable:
    """Measured seconds per step: `seconds[i][k]` for a batch of `batch_sizes[i]` requests
    and k drafts per request (k = 0: the speculative engine's plain round, which still
    draft-extends), and `plain[i]` for a step of the plain engine's own path over the same
    batch (no draft model; overlap scheduling where the engine has it; empty: not measured).
    Linear in the batch size between grid points; below the grid the smallest size's row,
    above it the last segment's slope."""

    batch_sizes: tuple[int, ...]  # ascending, >= 1
    seconds: tuple[tuple[float, ...], ...]  # [len(batch_sizes)][max_k + 1] seconds, > 0
    plain: tuple[float, ...] = ()  # [len(batch_sizes)] seconds, > 0; or () unmeasured
    # Seconds a prompt costs more arriving while the engine decodes by rounds than in the plain
    # regime: a speculative prompt step runs the target's prefill, the draft's, the seeds and
    # the others' round as two forwards and two host reads, where a plain step folds the
    # prompt into its one decode forward (served on an H200 at c=16: 4.75 ms against 1.36).
    # Every request pays it once. 0.0: unmeasured (a table of an older version).
    arrival: float = 0.0
    # (k, batch size) -> seconds (k = -1: the plain step), filled as asked: the policy prices
    # every k at its batch on every step, on the host's critical path
    _memo: dict[tuple[int, int], float | None] = field(
        default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.batch_sizes or list(self.batch_sizes) != sorted(set(self.batch_sizes)):
            raise ValueError(f"batch_sizes: must be ascending and distinct, "
                             f"got {self.batch_sizes}")
        if self.batch_sizes[0] < 1:
            raise ValueError(f"batch_sizes: must be >= 1, got {self.batch_sizes}")
        widths = {len(row) for row in self.seconds}
        if len(self.seconds) != len(self.batch_sizes) or len(widths) != 1 or 0 in widths:
            raise ValueError("seconds: one row per batch size, all of the same length >= 1")
        if any(not s > 0 for row in self.seconds for s in row):
            raise ValueError("seconds: every cost must be > 0")
        if self.plain and (len(self.plain) != len(self.batch_sizes)
                           or any(not s > 0 for s in self.plain)):
            raise ValueError("plain: one cost > 0 per batch size, or none")
        if not self.arrival >= 0:
            raise ValueError(f"arrival: must be >= 0, got {self.arrival}")

    @property
    def max_k(self) -> int:
        return len(self.seconds[0]) - 1

    def cost(self, k: int, batch_size: int) -> float:
        """Seconds of a step with k drafts per request over `batch_size` requests."""
        got = self._memo.get((k, batch_size))
        if got is None:
            if not 0 <= k <= self.max_k:
                raise ValueError(f"k: must be in [0, {self.max_k}], got {k}")
            got = self._memo[k, batch_size] = self._at([row[k] for row in self.seconds],
                                                       batch_size)
        return got

    def plain_cost(self, batch_size: int) -> float | None:
        """Seconds of the plain engine's step over `batch_size` requests (None: unmeasured)."""
        key = (-1, batch_size)
        if key not in self._memo:
            self._memo[key] = self._at(self.plain, batch_size) if self.plain else None
        return self._memo[key]

    def _at(self, values: Sequence[float], batch_size: int) -> float:
        sizes = self.batch_sizes
        if batch_size <= sizes[0] or len(sizes) == 1:
            return values[0]
        i = min(bisect.bisect_left(sizes, batch_size), len(sizes) - 1)  # segment [i-1, i]
        lo, hi = sizes[i - 1], sizes[i]
        a, b = values[i - 1], values[i]
        return max(a + (b - a) * (batch_size - lo) / (hi - lo), min(a, b))

    def envelope(self) -> StepCostTable:
        """The table with each cost the least measured for at least as much work: seconds[i][k]
        = min over i' >= i, k' >= k of seconds[i'][k'] (a round of more drafts, or over more
        requests, does all a smaller one does and more), plain[i] = min over i' >= i. Timing
        noise only adds time (another process, a clock dip, a collection), so a cost above one
        of more work is noise: on an H100 one profile priced a batch-1 round of k=1 at 2.95 ms
        and one of k=4 at 1.99, another a batch-16 round of k=2 at 3.26 ms and of k=4 at 2.79.
        Noise that inflates the largest entry is kept (nothing bounds it from above)."""
        rows = [list(r) for r in self.seconds]
        for i in range(len(rows) - 1, -1, -1):
            for k in range(len(rows[i]) - 1, -1, -1):
                if k + 1 < len(rows[i]):
                    rows[i][k] = min(rows[i][k], rows[i][k + 1])
                if i + 1 < len(rows):
                    rows[i][k] = min(rows[i][k], rows[i + 1][k])
        plain = list(self.plain)
        for i in range(len(plain) - 2, -1, -1):
            plain[i] = min(plain[i], plain[i + 1])
        return StepCostTable(batch_sizes=self.batch_sizes,
                             seconds=tuple(tuple(r) for r in rows), plain=tuple(plain),
                             arrival=self.arrival)

    def to_json(self) -> str:
        return json.dumps({"batch_sizes": list(self.batch_sizes),
                           "seconds": [list(r) for r in self.seconds],
                           "plain": list(self.plain), "arrival": self.arrival})

    @staticmethod
    def from_json(text: str) -> StepCostTable:
        raw = json.loads(text)
        return StepCostTable(batch_sizes=tuple(int(b) for b in raw["batch_sizes"]),
                             seconds=tuple(tuple(float(s) for s in r) for r in raw["seconds"]),
                             plain=tuple(float(s) for s in raw.get("plain", ())),
                             arrival=float(raw.get("arrival", 0.0)))
