"""What the adaptive policy learns from service (spec/served.py, `AdaptivePolicy.served`,
`arrived`, `plain_wins`'s exploration): served / priced per regime and per batch size, a
regime never served near a batch size tried once there, and the arrival price taken from
served arrival steps. The numbers are an H200's (session 25): its start-up profile, and what
the same process served at c=16 and c=50."""

from __future__ import annotations

import itertools
import random

import pytest
from spec_helpers import (
    assert_pages_free,
    engine_cfg,
    greedy,
    one_thread,  # noqa: F401 (autouse fixture)
    prompts,
    tiny_head,
    tiny_target,
)

from tandem.spec import SpecConfig, SpecEngine
from tandem.spec.adaptive import AdaptivePolicy, AdaptiveSettings, StepCostTable
from tandem.spec.served import ServedPrices, grid_weights

MS = 1e-3
# The profile of an H200 (session 25, SmolLM2 + the shipped head, k = 0..4; plain step last)
H200 = StepCostTable(
    batch_sizes=(1, 2, 4, 8, 16, 32, 64),
    seconds=tuple(tuple(x * MS for x in row) for row in (
        (1.218, 1.218, 1.218, 1.218, 1.502), (1.333, 1.482, 1.642, 1.642, 1.784),
        (1.413, 1.751, 1.867, 1.867, 1.913), (1.747, 2.008, 2.021, 2.222, 2.392),
        (2.151, 2.304, 2.478, 2.504, 2.852), (2.722, 2.793, 3.421, 3.431, 3.435),
        (3.415, 4.400, 4.614, 5.087, 5.269))),
    plain=tuple(x * MS for x in (1.013, 1.049, 1.114, 1.199, 1.499, 1.913, 2.786)))
SERVED_P = (0.61, 0.63, 0.59, 0.61)  # the acceptance it served (conditional, per position)


def policy(**settings) -> AdaptivePolicy:
    pol = AdaptivePolicy(table=H200, max_k=4, settings=AdaptiveSettings(**settings))
    pol.overall = SERVED_P
    return pol


def test_grid_weights_interpolate_inside_the_grid_and_hold_past_it():
    sizes = (1, 2, 4, 8, 16, 32, 64)
    assert grid_weights(sizes, 1) == ((0, 1.0),)
    assert grid_weights(sizes, 100) == ((6, 1.0),)
    assert grid_weights(sizes, 16) == ((4, 1.0),)
    (i, a), (j, b) = grid_weights(sizes, 44)
    assert (i, j) == (5, 6) and a == pytest.approx(20 / 32) and b == pytest.approx(12 / 32)


def test_each_batch_size_keeps_its_own_served_ratio():
    """Served rounds 15% over their price at 44 rows and 20% under at 16 (the H200's): each
    batch size is priced by its own, not by one ratio pooled over every step."""
    pol = policy()
    for _ in range(300):
        pol.served(44, 1.15 * H200.cost(4, 44), 4)
        pol.served(16, 0.8 * H200.cost(4, 16), 4)
    assert pol.prices.scale(True, 44) == pytest.approx(1.15, rel=0.03)
    assert pol.prices.scale(True, 16) == pytest.approx(0.8, rel=0.03)
    assert 0.8 < pol.round_scale < 1.15  # the engine-wide one pools both
    # plain steps, never served, follow the rounds' engine-wide scale at every size
    assert pol.prices.scale(False, 44) == pytest.approx(pol.round_scale)
    assert pol.prices.weight(False, 44) == 0.0 and pol.prices.weight(True, 44) > 0.9


def test_an_unserved_plain_regime_is_tried_once_where_the_profile_may_err():
    """The H200 at c=50: priced from its profile, rounds beat plain steps by ~20% at 44 rows,
    so the engine drafted; served, plain steps took 1.93 ms (priced 2.27) and rounds 4.84
    (priced 4.12): plain won by 8%, and the engine ran 0.82x the plain engine. Now a step
    with arrivals tries the plain regime once where it was never served and lies within the
    band; served plain steps then decide."""
    assert not policy(explore_band=0.0).plain_wins(44)  # the profile alone: rounds
    assert not policy().plain_wins(44)  # plain 30% dearer: outside the default band (0.2)
    pol = policy(explore_band=0.35)  # (the default, 0.2, would not try a 20% gap)
    for _ in range(200):  # rounds served (an earlier run) at their H200 price
        pol.served(44, 4.84 * MS, 4)
    assert pol.plain_wins(44)  # an arrival: the plain regime, never served here, is tried
    assert not pol.plain_wins(44, settled=True)  # never while every request drafts
    assert not policy(explore_band=0.1).plain_wins(44)  # outside the band: not tried
    for _ in range(130):  # the c=50 run's plain steps
        pol.served(45, 1.93 * MS, None)
    assert pol.prices.scale(False, 45) == pytest.approx(1.93 * MS / H200.plain_cost(45), rel=0.1)
    assert pol.plain_wins(44, settled=True)  # now by their own price, even for drafters
    assert pol.plain_wins(44)


def test_exploration_happens_once_per_grid_point_and_only_near_a_tie():
    pol = policy(explore_band=0.35)
    assert pol.plain_wins(44)  # tried
    assert not pol.plain_wins(44)  # not again (nothing served: the profile's choice)
    assert not pol.plain_wins(40)  # 40 is nearest the same grid point (32)
    assert pol.plain_wins(60)  # nearest 64: tried once there too
    assert pol.explored == {(False, 5), (False, 6)}
    # and the other way: where plain steps win (by 28% here), unserved rounds are tried once,
    # and hold for `explore_steps` steps (served meanwhile) before plain steps may win again
    cheap = AdaptivePolicy(table=StepCostTable(
        batch_sizes=H200.batch_sizes, seconds=H200.seconds,
        plain=tuple(0.6 * x for x in H200.plain)), max_k=4,
        settings=AdaptiveSettings(explore_band=0.35))
    cheap.overall = SERVED_P
    assert not cheap.plain_wins(44)  # rounds tried
    for _ in range(cheap.settings.explore_steps):
        assert not cheap.plain_wins(44, settled=True)
        cheap.served(44, H200.cost(4, 44), 4)
    assert cheap.prices.weight(True, 44) > 0.2
    assert cheap.plain_wins(44, settled=True) and cheap.plain_wins(44)
    with pytest.raises(ValueError, match="explore_band"):
        AdaptiveSettings(explore_band=1.5)
    with pytest.raises(ValueError, match="explore_steps"):
        AdaptiveSettings(explore_steps=-1)


def test_a_k_never_served_is_tried_and_then_priced_by_its_own_rounds():
    """The profile's shape in k errs too (one H200 priced a batch-1 round of k=4 23% over
    k=3, where its service said 6%), and a k the policy never drafts is never served. An
    unserved k whose rate lies within the band is tried for `explore_steps` rounds, the
    likeliest first, once per grid point; then its own rounds price it."""
    t = StepCostTable(batch_sizes=(1, 8), seconds=((1.0, 1.1, 1.2, 1.3, 1.6),
                                                   (2.0, 2.2, 2.4, 2.6, 3.2)))
    p = (0.8, 0.8, 0.8, 0.8)  # E(3) 2.952 / 1.3 = 2.27 a second; E(4) 3.362 / 1.6 = 2.10
    fixed = AdaptivePolicy(table=t, max_k=4, overall=p,
                           settings=AdaptiveSettings(explore_band=0.0))
    assert fixed.plan(["a"], True).num_drafts == 3
    pol = AdaptivePolicy(table=t, max_k=4, overall=p)
    ks = []
    for _ in range(60):  # served: k=4 rounds take 1.35 s, every other k its price
        ks.append(pol.plan(["a"], True).num_drafts)
        pol.served(1, 1.35 if ks[-1] == 4 else t.cost(ks[-1], 1), ks[-1])
        pol.observe("a", ks[-1], ks[-1])  # (keeps the estimate high)
    n = pol.settings.explore_steps
    assert ks[: n + 1] == [4] * (n + 1)  # the likeliest unserved k, held while served
    assert pol.prices.scale_k(4, 1) == pytest.approx(1.35 / 1.6, rel=0.05)
    assert ks[-5:] == [4] * 5  # priced as served, k=4 wins: 3.36 / 1.35 = 2.49 a second
    assert (4, 0) in pol.explored_k and (1, 0) not in pol.explored_k  # k=1: out of the band
    assert pol.plan(["a"], True).num_drafts == 4


def test_served_arrivals_price_the_arrival_in_place_of_the_profile():
    """The H200 priced an arrival under rounds at 0.00 ms (profile); at c=16 its arrival
    steps took 5.38 ms under rounds of 2.37 and 1.77 ms in the plain regime, of 1.11: ~2.4 ms
    a prompt more under rounds. Spread over 120-token answers, that turns 15 rows plain where
    steady rounds alone win (here: served at 2.2 ms, 10% a token under plain steps)."""
    pol = policy(explore_band=0.0, output_len_prior=120.0)
    for _ in range(200):
        pol.served(15, 2.2 * MS, 3)
        pol.served(15, 1.11 * MS, None)
    assert pol.arrival_cost == 0.0 and not pol.plain_wins(15)
    for _ in range(30):
        pol.arrived(15, 5.2 * MS, 3, 1)
        pol.arrived(15, 1.77 * MS, None, 1)
    assert pol.arrival_cost == pytest.approx((5.2 - 2.2 - (1.77 - 1.11)) * MS, rel=0.1)
    assert pol.plain_wins(15)
    assert not pol.plain_wins(15, settled=True)  # paid already by requests drafting
    # one regime's arrivals alone say nothing of the other's: the profile's price stands
    one = policy()
    one.arrived(15, 5.38 * MS, 3, 1)
    assert one.arrival_cost == H200.arrival
    # per prompt, never below 0, a wild step capped at ten batch-1 rounds
    prices = ServedPrices(batch_sizes=(1, 2))
    prices.add_arrival(True, 0.004)
    assert prices.arrival(0.0) == 0.0  # (no plain arrival yet)
    pol2 = policy()
    pol2.arrived(0, 1000.0, 4, 1)
    pol2.arrived(0, 1.0 * MS, None, 2)
    assert pol2.prices.arrival_rounds[0] / pol2.prices.arrival_rounds[1] == pytest.approx(
        10 * H200.cost(4, 1))
    assert pol2.prices.arrival_plain[0] / pol2.prices.arrival_plain[1] == pytest.approx(0.5 * MS)


class Heard(AdaptivePolicy):
    """The adaptive policy, recording what the engine tells it."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.heard: list[tuple[str, int, int | None, int]] = []

    def served(self, batch_size, seconds, num_drafts):
        self.heard.append(("steady", batch_size, num_drafts, 0))
        super().served(batch_size, seconds, num_drafts)

    def arrived(self, batch_size, seconds, num_drafts, prompts):
        self.heard.append(("arrival", batch_size, num_drafts, prompts))
        super().arrived(batch_size, seconds, num_drafts, prompts)


@pytest.mark.parametrize("plain", [False, True])
def test_the_engine_reports_arrival_steps_with_their_prompts(plain):
    """Steps that complete prompts go to `arrived` with the number completed and the batch
    decoding beside them (under rounds, or in the plain regime); steady steps to `served`."""
    model = tiny_target("llama")
    # plain steps priced ~free (the plain regime throughout) or dear (rounds throughout)
    t = StepCostTable(batch_sizes=(1, 8), seconds=((1.0, 1.1, 1.2), (2.0, 2.2, 2.4)),
                      plain=(1e-4, 1e-4) if plain else (100.0, 100.0))
    pol = Heard(table=t, max_k=2, settings=AdaptiveSettings(explore_band=0.0))
    eng = SpecEngine(engine_cfg(), SpecConfig(num_steps=2), model, tiny_head(model, "eagle"),
                     policy=pol)
    ps = prompts(4, seed=9)
    for p in ps[:2]:
        eng.add_request(p, greedy(12))
    for step in itertools.count():
        if not eng.has_unfinished():
            break
        if step == 3:
            eng.add_request(ps[2], greedy(12))
        eng.step()
    arrivals = [h for h in pol.heard if h[0] == "arrival"]
    assert [(b, p) for _, b, _, p in arrivals] == [(0, 2), (2, 1)]
    assert all((k is None) == plain for _, _, k, _ in pol.heard)
    assert sum(h[0] == "steady" for h in pol.heard) >= 8
    assert_pages_free(eng)


# ---- leaving the plain regime under load ----------------------------------------------------


def test_plain_loses_only_on_served_plain_prices_where_rounds_win_by_the_margin():
    pol = policy(explore_band=0.0)
    dear = AdaptivePolicy(table=StepCostTable(
        batch_sizes=H200.batch_sizes, seconds=H200.seconds,
        plain=tuple(1.6 * x for x in H200.plain)), max_k=4,
        settings=AdaptiveSettings(explore_band=0.0))
    dear.overall = SERVED_P
    assert not dear.plain_loses(16)  # plain steps never served at 16: no drain on the table
    for _ in range(40):  # rounds served at their price; plain steps at 1.6x / 0.7x theirs
        for p in (dear, pol):
            p.served(16, H200.cost(4, 16), 4)
        dear.served(16, 1.6 * H200.plain_cost(16), None)
        pol.served(16, 0.7 * H200.plain_cost(16), None)
    assert dear.plain_loses(16)  # served: rounds win by far more than the margin
    assert not pol.plain_loses(16)  # plain steps served 30% under their price: they win
    assert not pol.plain_loses(1)  # (not served near 1)


class Draining:
    """Plain on the first ask; afterwards, rounds win (`plain_loses`); drafts k = 2."""

    def __init__(self):
        self.asked = 0

    def plain_wins(self, batch_size, req_ids=(), settled=False):
        self.asked += 1
        return self.asked == 1

    def plain_step(self):
        pass

    def plain_loses(self, batch_size):
        return True

    def plan(self, req_ids, allow_split):
        from tandem.spec.adaptive import RoundPlan
        return RoundPlan(num_drafts=2, drafting=(True,) * len(req_ids))

    def observe(self, req_id, num_drafts, num_accepted):
        pass

    def forget(self, req_id):
        pass


@pytest.mark.parametrize("overlap", [False, True])
def test_the_plain_regime_drains_when_rounds_win_and_arrivals_then_draft(overlap):
    """Under steady load the plain regime would never end (each arrival turns plain). Where
    the policy says rounds now win, arrivals wait until the plain requests are gone, then
    draft; outputs stay plain decoding's, every page back."""
    from spec_helpers import reference

    model = tiny_target("llama")
    eng = SpecEngine(engine_cfg(overlap_schedule=overlap), SpecConfig(num_steps=2), model,
                     tiny_head(model, "eagle"), policy=Draining())
    first, later = prompts(2, seed=31), prompts(2, seed=32)
    ids = [eng.add_request(p, greedy(16)) for p in first]
    out: dict[str, list[int]] = {}
    waited = seeded_later = False
    for step in itertools.count():
        assert step < 300
        if step == 4:
            ids += [eng.add_request(p, greedy(16)) for p in later]
        if not eng.has_unfinished():
            break
        for o in eng.step():
            out.setdefault(o.req_id, []).extend(o.new_token_ids)
        plain_running = any(eng.spec_scheduler.is_plain(r.req_id)
                            for r in eng.scheduler.running)
        if step >= 4 and plain_running:  # the later ones wait while plain ones decode
            assert {r.req_id for r in eng.scheduler.waiting} == set(ids[2:])
            waited = True
        seeded_later |= any(r in eng.seeds for r in ids[2:])
    assert waited and seeded_later
    assert not any(eng.spec_scheduler.is_plain(r) for r in ids[2:])
    want = reference(model, first + later, greedy(16))
    assert [out[r] for r in ids] == [list(c.output_ids) for c in want]
    assert_pages_free(eng)


def test_a_round_observed_at_once_teaches_what_each_row_observed_in_turn_does():
    """`observe_many` (one call per round, on the host's critical path) leaves the engine-wide
    and per-request estimates exactly where `observe` row by row leaves them."""
    rows = [("a", 2), ("b", 0), ("a", 4), ("c", 1), ("d", 3)]
    one, many = policy(), policy()
    for pol in (one, many):
        pol.observe("a", 4, 1)  # "a" known before the round; "b", "c", "d" new to it
    for rid, a in rows:
        one.observe(rid, 4, a)
    many.observe_many(4, rows)
    assert many.overall == one.overall and many.per_request == one.per_request
    assert one.overall != policy().overall  # the round moved them


# An H200's profile of SmolLM2 + the shipped head (session 29), ms: batch -> k = 0..4, plain
H200_MS = {1: (0.896, 1.062, 1.078, 1.148, 1.239, 0.793), 2: (1.072, 1.227, 1.294, 1.338, 1.495,
           0.881), 4: (1.249, 1.420, 1.547, 1.547, 1.611, 0.912), 8: (1.495, 1.720, 1.725,
           1.725, 1.823, 1.039), 16: (1.881, 2.069, 2.163, 2.163, 2.463, 1.244)}


def _arrivals_turning_plain(overall_alpha: float, seed: int, arrivals: int = 300) -> float:
    """Four requests decode by rounds; every 12 rounds one ends and the next arrives, and the
    policy is asked (unsettled) whether plain steps win. Each request accepts at its own level
    (the conditionals scaled by U(0.6, 1.45): ~2.6 tokens a round pooled), so rounds beat
    plain by ~30% a token here, arrival included. -> the share of arrivals turned plain."""
    rng = random.Random(seed)
    table = StepCostTable(batch_sizes=tuple(H200_MS),
                          seconds=tuple(tuple(x / 1e3 for x in r[:5]) for r in H200_MS.values()),
                          plain=tuple(r[5] / 1e3 for r in H200_MS.values()), arrival=3.6e-3)
    pol = AdaptivePolicy(table=table, max_k=4, measured=(0.62, 0.40, 0.24, 0.16),
                         settings=AdaptiveSettings(explore_band=0.0,
                                                   overall_alpha=overall_alpha))
    for _ in range(20):
        pol.finished(119)
    level: dict[str, float] = {}

    def accepted(rid: str, k: int) -> int:
        f = level.setdefault(rid, rng.uniform(0.6, 1.45))
        a = 0
        while a < k and rng.random() < min(0.97, (0.61, 0.64, 0.59, 0.65)[a] * f):
            a += 1
        return a

    ids, plain = [f"r{i}" for i in range(4)], 0
    for n in range(4, 4 + arrivals):
        for _ in range(12):
            k = pol.plan(ids, True).num_drafts
            pol.observe_many(k, [(r, accepted(r, k)) for r in ids])
        pol.forget(ids[0])
        ids = ids[1:] + [f"r{n}"]
        plain += pol.plain_wins(4, tuple(ids), settled=False)
    return plain / arrivals


def test_the_engine_wide_estimate_does_not_swing_a_winning_batch_plain():
    """At c=4 the engine-wide estimate pools the four requests decoding, whose acceptance
    differs by request. With a memory of ~50 observations (~12 rounds) its E(4) swung by the
    decision's margin and arrivals turned plain where rounds won by ~20% (an H200, session
    29); the default (~200 observations) keeps such turns rare."""
    default = AdaptiveSettings().overall_alpha
    shares = [_arrivals_turning_plain(default, seed) for seed in range(3)]
    assert sum(shares) / len(shares) < 0.025, shares
    short = [_arrivals_turning_plain(0.02, seed) for seed in range(3)]
    assert sum(short) / len(short) > 2 * sum(shares) / len(shares), (short, shares)
