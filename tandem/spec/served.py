"""What steps take in service against what the cost table priced them at (`ServedPrices`),
per regime -- plain-regime steps, rounds -- and per batch size, and what a prompt's arrival
adds to a step of each regime. Pure Python, no torch; `AdaptivePolicy` owns one and prices
with it.

Why per batch size: the start-up profile errs differently at different batch sizes. On an
H200 (session 25) it priced plain steps 35% over service at 16 rows and 17% over at 45, and
rounds 24% over at 16 but 15% under at 44. One scale per regime, fitted where the engine
happened to run, then said rounds beat plain steps by 29% at 44 rows where plain steps won
by 8% (the engine drafted at c=50 and ran 0.82x the plain engine).

Why arrivals: a prompt step under rounds runs the target's prefill, the draft's and a host
read before the others' round, where a plain step folds the prompt into its one forward. The
profile prices that once, at one batch size (`StepCostTable.arrival`); the same H200 priced
it 0.00 ms, and service showed 2.3 ms (c=16: arrival steps 5.38 ms against 2.37 for a round;
plain 1.77 against 1.11). Served arrival steps replace the profile's price as they come.

Owns: its EWMA sums. Written by `add` and `add_arrival` only."""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass, field

from tandem.spec.cost_table import StepCostTable

Ewma = tuple[float, float]  # (sum of weighted values, sum of weights): mean = sum / weight


def grid_weights(sizes: Sequence[int], batch_size: int) -> tuple[tuple[int, float], ...]:
    """(grid index, weight) pairs that interpolate `batch_size` linearly between the grid's
    two neighbouring sizes, as `StepCostTable` prices inside its grid; at or past either end
    one pair, the end point (the table extrapolates its prices there, a ratio is held)."""
    if batch_size <= sizes[0] or len(sizes) == 1:
        return ((0, 1.0),)
    if batch_size >= sizes[-1]:
        return ((len(sizes) - 1, 1.0),)
    i = bisect.bisect_left(sizes, batch_size)
    lo, hi = sizes[i - 1], sizes[i]
    if hi == batch_size:
        return ((i, 1.0),)
    w = (batch_size - lo) / (hi - lo)
    return ((i - 1, 1.0 - w), (i, w))


def _moved(e: Ewma, value: float, alpha: float) -> Ewma:
    return ((1 - alpha) * e[0] + alpha * value, (1 - alpha) * e[1] + alpha)


def _filled(own: Ewma, fill: float) -> float:
    """The EWMA's value with its missing weight taken at `fill`."""
    return own[0] + (1.0 - own[1]) * fill


@dataclass(slots=True, kw_only=True)
class ServedPrices:
    """Served / priced ratios of steady steps, per regime (`plain`: the plain regime's steps;
    `rounds`: rounds of any k), engine-wide and per grid point of the cost table; and the
    seconds per prompt an arrival step took over its regime's priced steady step."""

    batch_sizes: tuple[int, ...]  # the cost table's grid, ascending
    alpha: float = 0.02  # EWMA weight of one step, engine-wide
    # ... at the grid points it touches (split between them): faster, so that a regime tried
    # for a few dozen steps (`AdaptivePolicy._explore`) is priced by what it served
    grid_alpha: float = 0.05
    arrival_alpha: float = 0.1  # EWMA weight of one arrival step
    plain: Ewma = (0.0, 0.0)
    rounds: Ewma = (0.0, 0.0)
    plain_at: list[Ewma] = field(default_factory=list)  # [len(batch_sizes)]
    rounds_at: list[Ewma] = field(default_factory=list)  # [len(batch_sizes)]
    # rounds of one k at a grid point: (k, grid index) -> EWMA (the k's shape against the
    # table's: one H200 profile priced k=4 23% over k=3 at batch 1, service 6%)
    k_at: dict[tuple[int, int], Ewma] = field(default_factory=dict)
    arrival_plain: Ewma = (0.0, 0.0)  # extra seconds per prompt, plain regime
    arrival_rounds: Ewma = (0.0, 0.0)  # ... under rounds
    version: int = 0  # counts the writes (`PricedTable` memoizes within one version)

    def __post_init__(self) -> None:
        n = len(self.batch_sizes)
        self.plain_at = self.plain_at or [(0.0, 0.0)] * n
        self.rounds_at = self.rounds_at or [(0.0, 0.0)] * n

    def add(self, rounds: bool, batch_size: int, ratio: float, k: int | None = None) -> None:
        """A steady step of `batch_size` requests took `ratio` x its price (a round: of `k`
        drafts, where given)."""
        self.version += 1
        if rounds:
            self.rounds = _moved(self.rounds, ratio, self.alpha)
        else:
            self.plain = _moved(self.plain, ratio, self.alpha)
        at = self.rounds_at if rounds else self.plain_at
        for i, w in grid_weights(self.batch_sizes, batch_size):
            at[i] = _moved(at[i], ratio, self.grid_alpha * w)
            if rounds and k is not None:
                self.k_at[k, i] = _moved(self.k_at.get((k, i), (0.0, 0.0)), ratio,
                                         self.grid_alpha * w)

    def global_scale(self, rounds: bool) -> float:
        """A regime's served / priced over every batch size: its EWMA, the missing weight
        taken at the other regime's mean (else 1.0). A regime the engine does not run is
        never timed; much of what sets the prices off (the profile's cold start, the host's
        drift) touches both alike, so its scale follows the other's until it runs."""
        own, other = (self.rounds, self.plain) if rounds else (self.plain, self.rounds)
        return _filled(own, other[0] / other[1] if other[1] > 0 else 1.0)

    def scale(self, rounds: bool, batch_size: int) -> float:
        """The regime's served / priced at `batch_size`: the grid points' own EWMAs, their
        missing weight taken at the regime's engine-wide scale."""
        at = self.rounds_at if rounds else self.plain_at
        g = self.global_scale(rounds)
        return sum(w * _filled(at[i], g) for i, w in grid_weights(self.batch_sizes, batch_size))

    def weight(self, rounds: bool, batch_size: int) -> float:
        """How much the regime has been served near `batch_size` (0: never; -> 1)."""
        at = self.rounds_at if rounds else self.plain_at
        return sum(w * at[i][1] for i, w in grid_weights(self.batch_sizes, batch_size))

    def scale_k(self, k: int, batch_size: int) -> float:
        """Rounds of `k` drafts at `batch_size`: their own grid EWMAs, the missing weight
        taken at the rounds' ratio there (`scale`)."""
        g = self.global_scale(True)
        return sum(w * _filled(self.k_at.get((k, i), (0.0, 0.0)), _filled(self.rounds_at[i], g))
                   for i, w in grid_weights(self.batch_sizes, batch_size))

    def weight_k(self, k: int, batch_size: int) -> float:
        return sum(w * self.k_at.get((k, i), (0.0, 0.0))[1]
                   for i, w in grid_weights(self.batch_sizes, batch_size))

    def nearest(self, batch_size: int) -> int:
        """The grid point that weighs most at `batch_size` (exploration is marked on it)."""
        return max(grid_weights(self.batch_sizes, batch_size), key=lambda iw: iw[1])[0]

    def add_arrival(self, rounds: bool, extra_per_prompt: float) -> None:
        """An arrival step took `extra_per_prompt` seconds per completed prompt over its
        regime's priced steady step."""
        self.version += 1
        if rounds:
            self.arrival_rounds = _moved(self.arrival_rounds, extra_per_prompt, self.arrival_alpha)
        else:
            self.arrival_plain = _moved(self.arrival_plain, extra_per_prompt, self.arrival_alpha)

    def arrival(self, profiled: float) -> float:
        """Seconds a prompt costs more arriving under rounds than in the plain regime: the
        served extras' difference, weighed against the profile's price by how much of both
        regimes has been served (the profile's alone until both have)."""
        r, p = self.arrival_rounds, self.arrival_plain
        if not (r[1] > 0 and p[1] > 0):
            return profiled
        c = min(r[1], p[1])
        return max(0.0, c * (r[0] / r[1] - p[0] / p[1]) + (1.0 - c) * profiled)

    def summary(self) -> dict:
        """For logs and benchmarks: engine-wide scales, per-grid scales, the arrival price."""
        return {"plain_at": [round(_filled(e, self.global_scale(False)), 3)
                             for e in self.plain_at],
                "rounds_at": [round(_filled(e, self.global_scale(True)), 3)
                              for e in self.rounds_at],
                "arrival_plain_ms": _mean_ms(self.arrival_plain),
                "arrival_rounds_ms": _mean_ms(self.arrival_rounds)}


def _mean_ms(e: Ewma) -> float | None:
    return round(e[0] / e[1] * 1e3, 3) if e[1] > 0 else None


@dataclass(slots=True)
class PricedTable:
    """The cost table as served: a round's price times its k's served / priced ratio at the
    batch (`ServedPrices.scale_k`), a plain step's times the plain regime's (`scale`). What
    the policy plans and compares with (`round_plan.plan_round` takes it as its `Prices`)."""

    table: StepCostTable
    prices: ServedPrices
    # (k, batch size) -> seconds, for `_version` of the prices: a step asks the same few
    # dozen times (plain_wins, plan), on the host's critical path
    _memo: dict[tuple[int, int], float] = field(default_factory=dict, repr=False)
    _version: int = field(default=-1, repr=False)

    @property
    def max_k(self) -> int:
        return self.table.max_k

    def cost(self, k: int, batch_size: int) -> float:
        if self._version != self.prices.version:
            self._memo.clear()
            self._version = self.prices.version
        got = self._memo.get((k, batch_size))
        if got is None:
            got = self._memo[k, batch_size] = (self.table.cost(k, batch_size)
                                               * self.prices.scale_k(k, batch_size))
        return got

    def plain_cost(self, batch_size: int) -> float | None:
        c = self.table.plain_cost(batch_size)
        return None if c is None else c * self.prices.scale(False, batch_size)
