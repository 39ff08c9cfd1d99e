"""Adaptive speculation: how many draft tokens k the next step proposes (0 = a plain decode
step), chosen to maximise expected tokens per second. Pure Python, no torch: the engine asks,
the maths lives here and is unit-tested on its own.

For one request with per-position acceptance p_i = P(draft i accepted | drafts < i accepted),
a round with k chain drafts commits on average

    E(k) = 1 + sum_{j=1..k} prod_{i<=j} p_i        (the bonus token, plus each accepted prefix)

tokens and costs `cost(k, batch)` seconds (a `StepCostTable`, measured). A batch of requests r
at k commits sum_r E_r(k) tokens, so the step's rate is

    rate(k) = sum_r E_r(k) / cost(k, batch),   k = 0 .. max_k    (E(0) = 1: a plain step)

and the policy takes the argmax (ties: the smaller k; the last step's k within a margin).

Per request: drafting pays for request r only when E_r(k) >= cost(k, batch) / cost(0, batch)
(its break-even: a drafting row's share of the round must buy at least what a plain row's
share buys). The rows under it may run as a second, plain (k = 0) round of the same step --
the batch splits -- when the table says the two forwards together beat one round over
everybody (`plan_round` compares the options; at small, memory-bound batches one round wins,
so a split happens only where a target forward's cost grows with the rows it carries).

The estimates are exponentially weighted: a round that proposed k drafts and accepted a
observes, for each j <= k, whether at least j were accepted (the cumulative prod_{i<=j} p_i;
positions past k are unobserved and relax toward the prior). A request that does not draft is
not observed; its estimate relaxes toward the prior (the head's measured acceptance where its
config gives it) at `relax` per step, so a muted request (or a whole engine stuck at k = 0, or
in the plain regime: `plain_step`) drafts again after a while and is measured afresh.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from tandem.spec.cost_table import POLICY_VERSION, StepCostTable  # noqa: F401 (also here)
from tandem.spec.round_plan import (  # noqa: F401 (also here)
    RoundPlan,
    _expected_by_k,
    break_even,
    expected_tokens,
    plan_round,
)
from tandem.spec.served import PricedTable, ServedPrices

log = logging.getLogger(__name__)


def ewma_update(p: Sequence[float], num_drafts: int, num_accepted: int, alpha: float,
                prior: Sequence[float] = (), rate: float = 0.0) -> tuple[float, ...]:
    """The estimate after a round that proposed k = `num_drafts` and accepted a =
    `num_accepted`. The round observes, for every j <= k, whether at least j drafts were
    accepted: the cumulative q_j = prod_{i<=j} p_i moves `alpha` toward [a >= j], and p_j for
    j <= k is q_j / q_{j-1} again. Positions past k keep their conditional p_j, or, given a
    `prior`, move `rate` of the way toward it (`relax` from k on, in the same pass).

    (Not each conditional p_j on its own rounds: p_j is observed only in rounds that accepted
    j - 1 drafts, ~15% of them for j = 4 with the shipped SmolLM2 head, so its EWMA stayed
    near the prior long after p_1 had converged and E(4) read ~0.1-0.2 tokens high: at a
    tie, as SmolLM2 at batch 1 on an H200 is, that kept the engine drafting at a loss.)"""
    out = list(p)
    n = len(out)
    k = num_drafts if num_drafts < n else n
    keep = 1.0 - alpha
    q_prev_old = q_prev_new = 1.0  # q_0
    for j in range(k):  # (on the host's critical path, once per row a step: no min/max calls)
        q_old = q_prev_old * out[j]
        q_new = keep * q_old + (alpha if j < num_accepted else 0.0)
        if q_prev_new > 1e-12:
            v = q_new / q_prev_new
            out[j] = 1.0 if v > 1.0 else (0.0 if v < 0.0 else v)
        q_prev_old, q_prev_new = q_old, q_new
    if rate and k < n:  # (k == n, the usual round of max_k, relaxes nothing)
        for j in range(k, min(n, len(prior))):
            out[j] += rate * (prior[j] - out[j])
    return tuple(out)


def relax(p: Sequence[float], prior: Sequence[float], rate: float) -> tuple[float, ...]:
    """One unobserved step: the estimate moves `rate` of the way back toward the prior (past
    a drafting round's k, `ewma_update` does the same for the positions it did not observe)."""
    return tuple(x + rate * (q - x) for x, q in zip(p, prior))


class KPolicy(Protocol):
    """What `SpecScheduler` asks of a policy (the adaptive one, or a test's forced one)."""

    def plan(self, req_ids: Sequence[str], allow_split: bool) -> RoundPlan: ...

    def observe(self, req_id: str, num_drafts: int, num_accepted: int) -> None: ...

    def forget(self, req_id: str) -> None: ...

    # A policy may also offer `plain_wins(batch_size, req_ids, settled) -> bool` (AdaptivePolicy
    # does): whether plain engine steps beat every round at that batch size.
    # `SpecScheduler.plain_regime` asks it; a policy without it never runs the plain regime.
    # And `plain_step() -> None`, told of each plain-regime step the scheduler runs without
    # asking, and `served(batch_size, seconds, num_drafts | None) -> None`, told what each
    # step without prompt work took.


@dataclass(frozen=True, slots=True)
class FixedK:
    """The policy of k drafts for every request every step (cost profiling)."""

    k: int

    def plan(self, req_ids: Sequence[str], allow_split: bool) -> RoundPlan:
        return RoundPlan(num_drafts=self.k, drafting=(True,) * len(req_ids))

    def observe(self, req_id: str, num_drafts: int, num_accepted: int) -> None:
        pass

    def forget(self, req_id: str) -> None:
        pass


@dataclass(frozen=True, slots=True, kw_only=True)
class AdaptiveSettings:
    alpha: float = 0.1  # EWMA weight of one observation in a request's own estimate
    # ... in the engine-wide one (prices the plain regime; pools all rows): ~200 observations,
    # ~50 rounds at c=4 (at 0.02 it followed the 4 requests decoding, whose acceptance differs,
    # and swung arrivals plain where rounds won by ~20%: H200, docs/architecture.md)
    overall_alpha: float = 0.005
    prior: float = 0.6  # P(accepted) at every position before anything is observed
    relax: float = 0.02  # per unobserved step, the pull back toward the prior
    # per step of the plain regime (no request drafts): slower, so that trying speculation
    # again costs a few rounds every few hundred steps, not every few dozen
    plain_relax: float = 0.002
    # Ties go to the plain regime: rounds must beat a plain step's time per token by this
    # fraction (within it drafting gains nothing, and a switch costs a speculative prompt
    # step and the plain steps' overlap).
    margin: float = 0.05
    # Output tokens a request runs before any finished (then their running mean, weight
    # `output_len_alpha` each): the arrival cost is spread over them.
    output_len_prior: float = 256.0
    output_len_alpha: float = 0.05
    # EWMA weight of one served step in its regime's scale (`AdaptivePolicy.served`)
    served_alpha: float = 0.02
    # Keep the last step's k unless another beats it by this fraction: a change of k drops
    # what was queued ahead for the old k (spec/ahead.py), unpriced by the fixed-k profile.
    k_switch_margin: float = 0.03
    # A regime never served near a batch size (its served weight there under
    # `explore_weight`) is tried once at that grid point, on a step with a request arriving,
    # where its price lies within `explore_band` of the chosen regime's: the profile errs by
    # tens of percent at some batch sizes, and only a regime that runs corrects its price.
    # A try costs: tried plain steps hold for the tried requests' lives (on a 2-core CPU at
    # c=4, where rounds won by 29%, a band of 0.35 tried plain and lost ~20% of the level's
    # throughput), tried rounds `explore_steps`. (0: never explore.)
    explore_band: float = 0.2
    explore_weight: float = 0.05
    # Steps a tried rounds regime holds before plain steps may win again: long enough to be
    # served (an H200 at c=50 tried rounds, then turned plain on the next step, having
    # served none: the try cost a speculative prompt step and taught nothing)
    explore_steps: int = 16

    def __post_init__(self) -> None:
        for name in ("alpha", "overall_alpha", "prior", "relax", "plain_relax", "margin",
                     "output_len_alpha", "served_alpha", "k_switch_margin", "explore_band",
                     "explore_weight"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name}: must be in [0, 1], got {getattr(self, name)}")
        if not self.output_len_prior >= 1.0:
            raise ValueError(f"output_len_prior: must be >= 1, got {self.output_len_prior}")
        if not self.explore_steps >= 0:
            raise ValueError(f"explore_steps: must be >= 0, got {self.explore_steps}")


@dataclass(slots=True)
class AdaptivePolicy:
    """Owns the acceptance estimates: the engine-wide one (what a new request starts from)
    and one per request decoding by rounds. Only `plan`, `observe` and `forget` write."""

    table: StepCostTable
    max_k: int  # SpecConfig.num_steps
    settings: AdaptiveSettings = field(default_factory=AdaptiveSettings)
    overall: tuple[float, ...] = ()  # [max_k] engine-wide estimate
    per_request: dict[str, tuple[float, ...]] = field(default_factory=dict)  # req_id -> [max_k]
    output_len: float = 0.0  # running mean of finished requests' output tokens (0: the prior)
    last_k: int = 0  # the last plan's k where every row drafted (0: none, or a split)
    measured: tuple[float, ...] = ()  # the head's P(draft j accepted), j = 1..: see _prior
    _prior_est: tuple[float, ...] = field(default=(), init=False, repr=False)  # (_prior)
    # What steps take in service over their price, per regime and batch size (`served`,
    # `arrived`), and the (regime, grid point) pairs tried once unserved (`plain_wins`)
    prices: ServedPrices = field(init=False)
    explored: set[tuple[bool, int]] = field(default_factory=set, init=False)
    trial: int = field(default=0, init=False)  # steps a tried rounds regime still holds
    priced: PricedTable = field(init=False)  # the table at served prices (what plans use)
    # ... and per k: the (k, grid point) pairs tried once unserved, the k on trial and the
    # rounds it still holds (`plan`)
    explored_k: set[tuple[int, int]] = field(default_factory=set, init=False)
    k_trial: tuple[int, int] = field(default=(0, 0), init=False)
    # plain_wins' plan of the step's requests, which `plan` takes when asked for the same
    # ones at the same prices: (req_ids, prices.version, plan), or None
    _planned: tuple | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        self.prices = ServedPrices(batch_sizes=self.table.batch_sizes,
                                   alpha=self.settings.served_alpha)
        self.priced = PricedTable(self.table, self.prices)
        self.max_k = min(self.max_k, self.table.max_k)
        m, fill = self.measured, self.settings.prior
        cond = [b / a if a > 0 else fill for a, b in zip((1.0, *m), m)]
        self._prior_est = tuple(cond[: self.max_k]) + (fill,) * (self.max_k - len(cond))
        if not self.overall:
            self.overall = self._prior()
        if not self.output_len:
            self.output_len = self.settings.output_len_prior

    def _prior(self) -> tuple[float, ...]:
        """Per position: the head's measured conditional P_j / P_{j-1}, else settings.prior."""
        return self._prior_est

    def plan(self, req_ids: Sequence[str], allow_split: bool) -> RoundPlan:
        """The step's plan (the last step's k unless another wins by `k_switch_margin`); rows
        that will not draft relax toward the prior (not observed)."""
        ests = [self.per_request.setdefault(r, self.overall) for r in req_ids]
        trial_k, left = self.k_trial
        cached, self._planned = self._planned, None
        if (allow_split and cached is not None and cached[1] == self.prices.version
                and cached[0] == tuple(req_ids)):
            plan = cached[2]
        else:
            plan = self._plan_round(ests, allow_split)
        if left:
            self.k_trial = (trial_k, left - 1)
        elif plan.num_drafts and not plan.splits:
            plan = self._explore_k(ests, plan)
        self.last_k = 0 if plan.splits else plan.num_drafts
        rate = self.settings.relax
        for rid, drafts in zip(req_ids, plan.drafting):
            if not drafts or plan.num_drafts == 0:
                self.per_request[rid] = relax(self.per_request[rid], self._prior(), rate)
        if plan.num_drafts == 0:
            self.overall = relax(self.overall, self._prior(), rate)
        return plan

    def _plan_round(self, ests: Sequence[Sequence[float]], allow_split: bool) -> RoundPlan:
        """`plan_round` at served prices, the last k kept (for good while a k is on trial)."""
        return plan_round(self.priced, ests, self.max_k, allow_split, keep_k=self.last_k,
                          keep_margin=(float("inf") if self.k_trial[1]
                                       else self.settings.k_switch_margin))

    def _explore_k(self, ests: Sequence[Sequence[float]], plan: RoundPlan) -> RoundPlan:
        """The unsplit round of `plan`, or of another k never served near this batch whose
        rate lies within `explore_band` of the plan's: tried for `explore_steps` rounds, once
        per grid point (the profile's shape in k errs too: one H200 priced a batch-1 round of
        k=4 23% over k=3 where service said 6%, and k=4 was never drafted)."""
        s, bs, k = self.settings, len(ests), plan.num_drafts
        grid = self.prices.nearest(bs)
        untried = [j for j in range(1, self.max_k + 1)
                   if j != k and (j, grid) not in self.explored_k
                   and self.prices.weight_k(j, bs) < s.explore_weight]
        if s.explore_band <= 0 or not untried:
            return plan
        by_k = [_expected_by_k(p, self.max_k) for p in ests]
        rates = {j: sum(e[j] for e in by_k) / self.priced.cost(j, bs) for j in (k, *untried)}
        for other in sorted(untried, key=rates.__getitem__, reverse=True):  # likeliest first
            if rates[other] * (1.0 + s.explore_band) >= rates[k]:
                self.explored_k.add((other, grid))
                self.k_trial = (other, s.explore_steps)
                log.info("adaptive speculation: trying k=%d at batch %d (never served near it; "
                         "k=%d chosen)", other, bs, k)
                return RoundPlan(num_drafts=other, drafting=(True,) * bs)
        return plan

    def plain_wins(self, batch_size: int, req_ids: Sequence[str] = (),
                   settled: bool = False) -> bool:
        """Whether `batch_size` requests decode faster as plain engine steps (no draft model,
        overlapped where the engine can) than by the best round at the engine-wide estimate,
        or than by the k = 0 round the requests `req_ids` would run by their own estimates.
        Asked once per step while it holds (the plain regime, `SpecEngine.step`), which is
        also an unobserved step: the estimate relaxes toward the prior, so the engine tries
        speculation again after a while and measures it afresh.

        `settled` (every request held drafts, its arrival paid): turning plain is for good, on
        an estimate that moves every round (H200, batch 1: rounds won by ~10%, yet unlucky first
        rounds turned 20-70% of tokens plain), so plain must win by `margin`, arrival unpriced."""
        # Per committed token (seconds): a plain step's plain / b; a k-round's cost / (b E(k))
        # plus the arrival cost over the tokens a request runs (each token a round commits
        # brings the next arrival 1 / output_len closer). Rounds win by the margin; settled, plain.
        plain = self.table.plain_cost(batch_size)
        if plain is None:
            return False
        if self.trial > 0:  # rounds tried (`_explore`): they hold until served a while
            self.trial -= 1
            return False
        plain, rounds = self._per_token(batch_size, settled)
        plain *= batch_size  # (seconds a plain step)
        if settled:
            wins = plain / batch_size * (1.0 + self.settings.margin) <= rounds
        else:
            wins = plain / batch_size <= rounds * (1.0 + self.settings.margin)
        if not wins and req_ids:
            # The requests' own estimates (`req_ids`, the engine-wide one for a request not
            # seen yet) may have no row draft: the step would be a k = 0 round, which still
            # draft-extends and reads the host before the next launch -- dearer than a plain
            # step (H200, batch 1: 1.01 ms against 0.77), and served as the c=1 steps of a
            # request whose drafts had failed.
            ids = tuple(req_ids[:batch_size])
            planned = self._plan_round([self.per_request.get(r, self.overall) for r in ids],
                                       True)  # (what `plan` takes, asked for these rows)
            self._planned = (ids, self.prices.version, planned)
            idle = planned.num_drafts == 0
            wins = idle and plain <= self.priced.cost(0, batch_size)
        if not settled:
            wins = self._explore(batch_size, wins, plain / batch_size, rounds)
        if wins:
            self.plain_step()
        return wins

    def _per_token(self, batch_size: int, settled: bool) -> tuple[float, float]:
        """Seconds per committed token at `batch_size`, as served prices say: a plain step's,
        and the best round's at the engine-wide estimate (plus, unless `settled`, the arrival
        cost spread over a request's tokens). The table must price plain steps."""
        plain = self.priced.plain_cost(batch_size)
        assert plain is not None
        per_token = 0.0 if settled else self.arrival_cost / self.output_len
        e = _expected_by_k(self.overall, self.max_k)  # E(0..max_k), one pass
        rounds = min((self.priced.cost(k, batch_size) / (batch_size * e[k]) + per_token
                      for k in range(1, self.max_k + 1)), default=float("inf"))
        return plain / batch_size, rounds

    def plain_loses(self, batch_size: int) -> bool:
        """Asked on plain-regime steps while requests wait: whether rounds now beat plain
        steps at `batch_size` by twice the margin, plain steps priced by what they served there
        (only once served: `explore_weight`). Then the engine admits no one until its plain
        requests are gone, and leaves the regime (`SpecScheduler.plain_regime`); under
        steady load it would otherwise never end, each arrival turning plain in turn."""
        if (self.table.plain_cost(batch_size) is None
                or self.prices.weight(False, batch_size) < self.settings.explore_weight):
            return False
        plain, rounds = self._per_token(batch_size, settled=False)
        return plain > rounds * (1.0 + 2.0 * self.settings.margin)  # (a drain is no tie-break)

    def _explore(self, batch_size: int, plain_chosen: bool, plain: float, rounds: float
                 ) -> bool:
        """The regime a step with an arrival runs: the chosen one, unless the other was never
        served near `batch_size` and its price per token (`plain`, `rounds`: seconds) lies
        within `explore_band` of the chosen one's -- then the other, once per grid point.
        Once served, its own price decides (the profile's error there is measured)."""
        s = self.settings
        try_rounds = plain_chosen
        key = (try_rounds, self.prices.nearest(batch_size))
        if (s.explore_band <= 0 or key in self.explored
                or self.prices.weight(try_rounds, batch_size) >= s.explore_weight):
            return plain_chosen
        chosen, other = (plain, rounds) if plain_chosen else (rounds, plain)
        if other > chosen * (1.0 + s.explore_band):
            return plain_chosen
        self.explored.add(key)
        self.trial = s.explore_steps if try_rounds else 0
        log.info("adaptive speculation: trying %s at batch %d, never served near it (priced "
                 "%+.1f%% a token against %s)", "rounds" if try_rounds else "plain steps",
                 batch_size, 100.0 * (other / chosen - 1.0),
                 "plain steps" if plain_chosen else "rounds")
        return not plain_chosen

    def plain_step(self) -> None:
        """A step of the plain regime, asked or not (while any plain request is held, the
        engine runs plain steps without asking `plain_wins`): unobserved, so the engine-wide
        estimate relaxes toward the prior and a later request drafts again."""
        self.overall = relax(self.overall, self._prior(), self.settings.plain_relax)

    def served(self, batch_size: int, seconds: float, num_drafts: int | None) -> None:
        """A step without prompt work took `seconds` in service: a plain-regime step
        (`num_drafts` None) or one round of `num_drafts` over `batch_size` requests. Its ratio
        to the table's price moves that regime's scale at that batch size (spec/served.py),
        which `plain_wins` applies. The profile runs at start-up, on a few steps of one
        prompt; in service the same steps may take otherwise (on an H200: plain batch-1 steps
        profiled 0.77 ms, served 0.66; rounds 1.46 ms and 1.31): the regimes' ratio errs by
        ~5%, all of a tie at batch 1, and by more at other batch sizes. One ratio counts
        within [2/3, 3/2]: a collection or a first capture does not swing the scale."""
        priced = (self.table.plain_cost(batch_size) if num_drafts is None
                  else self.table.cost(min(num_drafts, self.table.max_k), batch_size))
        if not priced or not seconds > 0:
            return
        self.prices.add(num_drafts is not None, batch_size,
                        min(1.5, max(2 / 3, seconds / priced)), num_drafts)

    def arrived(self, batch_size: int, seconds: float, num_drafts: int | None,
                prompts: int) -> None:
        """A step that completed `prompts` prompts next to `batch_size` requests decoding (a
        round of `num_drafts`, or a plain-regime step: None) took `seconds`: what it took over
        the steady step's served price, per prompt, prices the arrival (`arrival_cost`).
        Capped at ten batch-1 rounds a prompt (a first capture, a collection)."""
        if prompts < 1 or not seconds > 0:
            return
        rounds = num_drafts is not None
        priced = 0.0
        if batch_size > 0:
            priced = (self.priced.cost(min(num_drafts, self.max_k), batch_size) if rounds
                      else self.priced.plain_cost(batch_size) or 0.0)
        cap = 10.0 * self.table.cost(self.table.max_k, 1)
        self.prices.add_arrival(rounds, min(cap, max(0.0, seconds - priced) / prompts))

    @property
    def arrival_cost(self) -> float:
        """Seconds a prompt costs more arriving under rounds than in the plain regime: as
        served (`arrived`, both regimes), else as profiled (`StepCostTable.arrival`)."""
        return self.prices.arrival(self.table.arrival)

    @property
    def plain_scale(self) -> float:
        """What plain-regime steps take over their price, over every batch size: their own
        served ratio, filled in by the rounds' while little of it is served."""
        return self.prices.global_scale(False)

    @property
    def round_scale(self) -> float:
        return self.prices.global_scale(True)

    def observe(self, req_id: str, num_drafts: int, num_accepted: int) -> None:
        """A round of `num_drafts` accepted `num_accepted` for `req_id`. Positions past
        `num_drafts` were not observed: they relax toward the prior, as a row that does not
        draft does. (Left as they were, a low estimate past k was a trap: it kept k below
        it, so it was never observed again. On an H200 a 4th-position conditional of 0.35,
        a warm-up fluctuation against the head's 0.66, held the engine at k <= 3 for 50
        requests: tau 2.23 against 2.47 at k = 4.)"""
        s, prior = self.settings, self._prior()
        self._planned = None
        own = self.per_request.get(req_id, self.overall)  # (before this round counts in it)
        self.overall = ewma_update(self.overall, num_drafts, num_accepted, s.overall_alpha,
                                   prior, s.relax)
        self.per_request[req_id] = ewma_update(own, num_drafts, num_accepted, s.alpha, prior,
                                               s.relax)

    def observe_many(self, num_drafts: int, rows: Sequence[tuple[str, int]]) -> None:
        """`observe` of each (req_id, num_accepted) of one round, in order, in one call."""
        s, prior, per = self.settings, self._prior(), self.per_request
        self._planned = None
        overall = self.overall
        for rid, a in rows:
            own = per.get(rid, overall)
            overall = ewma_update(overall, num_drafts, a, s.overall_alpha, prior, s.relax)
            per[rid] = ewma_update(own, num_drafts, a, s.alpha, prior, s.relax)
        self.overall = overall

    def forget(self, req_id: str) -> None:
        self.per_request.pop(req_id, None)
        self._planned = None

    def finished(self, num_output_tokens: int) -> None:
        """A request ended by its stop conditions after `num_output_tokens` (aborted and
        failed ones are not told): the running mean the arrival cost is spread over."""
        a = self.settings.output_len_alpha
        self.output_len = (1 - a) * self.output_len + a * max(1, num_output_tokens)
