"""The plain regime of adaptive speculation (SpecScheduler.plain_regime, AdaptivePolicy.plain_wins):
where the cost table prices a plain engine step above every round, the speculative engine runs
plain engine steps (no draft model; overlapped where the engine overlaps) and every request it
holds decodes plain for the rest of its life. Tested: the policy's choice from the table, and
the engine under a forced regime schedule -- greedy output equal to plain decoding token for
token in float32 (with and without overlap scheduling, requests arriving on both sides of a
switch), requests made plain never drafting again, seeded sampling reproducible, every page
back."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
from spec_helpers import (
    assert_pages_free,
    assert_seeded_runs_equal,
    engine_cfg,
    greedy,
    one_thread,  # noqa: F401 (autouse fixture)
    prompts,
    reference,
    tiny_head,
    tiny_target,
)

from tandem.engine import SamplingParams
from tandem.spec import SpecConfig, SpecEngine
from tandem.spec.adaptive import (
    AdaptivePolicy,
    AdaptiveSettings,
    RoundPlan,
    StepCostTable,
)

# A round of k drafts costs 1 + 0.1 k at 1 row; a plain step 0.5 (cheap: a launch-bound small
# model with overlap) or 0.9 at 1 row, 3.0 at 64 rows.
ROUNDS = ((1.0, 1.1, 1.2, 1.3), (4.0, 8.0, 12.0, 16.0))
# The pure choice, without trying an unserved regime (tested on its own below)
NO_EXPLORE = AdaptiveSettings(explore_band=0.0)


def table(plain: tuple[float, ...]) -> StepCostTable:
    return StepCostTable(batch_sizes=(1, 64), seconds=ROUNDS, plain=plain)


# ---- the policy, pure ---------------------------------------------------------------------------


def test_plain_wins_where_a_plain_step_beats_the_best_round():
    # prior 0.6: E(3) = 1 + .6 + .36 + .216 = 2.176 tokens per 1.3 s round = 1.67 tokens/s
    cheap = AdaptivePolicy(table=table((0.5, 3.0)), max_k=3, settings=NO_EXPLORE)
    assert cheap.plain_wins(1)  # 2 tokens/s plain
    dear = AdaptivePolicy(table=table((0.9, 3.0)), max_k=3, settings=NO_EXPLORE)
    assert not dear.plain_wins(1)  # 1.11 tokens/s plain
    assert dear.plain_wins(64)  # 64 / 3.0 plain vs 64 * 2.176 / 16.0 at k = 3
    for _ in range(20):  # drafts that always land: speculation wins at 1 row again
        dear.observe("a", 3, 3)
    assert not dear.plain_wins(1)
    # unmeasured plain cost (a table of an older version): never the plain regime
    assert not AdaptivePolicy(table=table(()), max_k=3, settings=NO_EXPLORE).plain_wins(64)


def test_a_request_whose_own_drafts_fail_turns_plain_not_to_k0_rounds():
    """Where a request's own estimate has no row draft, its step would be a k = 0 round (a
    draft-extend and a host read before the next launch): a plain step costs less, so the
    regime turns plain even while the engine-wide estimate still favours rounds."""
    pol = AdaptivePolicy(table=table((0.9, 3.0)), max_k=3, settings=NO_EXPLORE)
    assert not pol.plain_wins(1, ["a"])  # prior 0.6: rounds pay
    for _ in range(30):  # a's drafts never land: its own p_1 0.03, the engine-wide 0.33
        pol.observe("a", 3, 0)
    assert pol.plan(["a"], True).num_drafts == 0
    assert not pol.plain_wins(1)  # the engine-wide estimate: rounds still pay
    assert pol.plain_wins(1, ["a"])  # a's own: a k = 0 round (1.0 s) against 0.9 s plain
    # where a plain step would cost more than the k = 0 round, the round stays
    dear = AdaptivePolicy(table=table((1.05, 3.0)), max_k=3, settings=NO_EXPLORE)
    for _ in range(30):
        dear.observe("a", 3, 0)
    assert not dear.plain_wins(1, ["a"])


def test_the_plain_regime_relaxes_the_estimate_toward_the_prior_slowly():
    pol = AdaptivePolicy(table=table((0.7, 3.0)), max_k=3,
                         settings=AdaptiveSettings(explore_band=0.0, plain_relax=0.01))
    for _ in range(60):
        pol.observe("a", 3, 0)  # drafts that never land
    low = pol.overall
    assert pol.plain_wins(1)
    assert low[0] < pol.overall[0] < 0.6  # one unobserved step: a little back toward 0.6
    steps = 1
    while pol.plain_wins(1):  # back toward the prior until speculation looks worth a try
        steps += 1
        assert steps < 2000
    assert steps > 20


def test_unasked_plain_steps_relax_the_estimate_too():
    """While every request is plain the engine runs plain steps without asking `plain_wins`,
    and tells the policy of each (`plain_step`): an engine that went plain comes back."""
    pol = AdaptivePolicy(table=table((0.7, 3.0)), max_k=3,
                         settings=AdaptiveSettings(explore_band=0.0, plain_relax=0.01))
    for _ in range(60):
        pol.observe("a", 3, 0)
    assert pol.plain_wins(1)
    for _ in range(500):
        pol.plain_step()
    assert not pol.plain_wins(1)


def test_the_engine_wide_estimate_moves_slower_than_a_request_s():
    """One request's rounds move its own estimate by alpha and the engine-wide one (which
    prices the plain regime) by overall_alpha: a few unlucky rounds do not turn the engine
    plain where rounds pay."""
    pol = AdaptivePolicy(table=table((0.9, 3.0)), max_k=3,
                         settings=AdaptiveSettings(explore_band=0.0, alpha=0.1,
                                                   overall_alpha=0.02))
    for _ in range(5):
        pol.observe("a", 3, 0)
    assert pol.per_request["a"][0] == pytest.approx(0.6 * 0.9**5)
    assert pol.overall[0] == pytest.approx(0.6 * 0.98**5)
    assert not pol.plain_wins(1)
    with pytest.raises(ValueError, match="overall_alpha"):
        AdaptiveSettings(overall_alpha=1.5)


def test_served_step_times_rescale_what_each_regime_costs():
    """The start-up profile may price both regimes off what they take in service (on an
    H200: plain batch-1 steps 0.77 ms profiled, 0.66 served; rounds 1.46 and 1.31). Served
    steps rescale each regime's prices, so the choice follows what the steps take now; one
    wild time (a collection, a first capture) barely moves a scale."""
    # at 1 row: a k=3 round of 2.176 tokens in 1.3 s = 0.597 s a token (x 1.05: 0.627)
    # against a 0.65 s plain step: rounds win, narrowly
    pol = AdaptivePolicy(table=table((0.65, 3.0)), max_k=3, settings=NO_EXPLORE)
    assert not pol.plain_wins(1)
    pol.served(1, 100.0, None)  # one wild time: the scale moves by alpha x 0.5 at most
    assert pol.plain_scale == pytest.approx(1.0 + 0.02 * 0.5)
    for _ in range(200):  # plain steps served at 0.5 s, not 0.65; rounds at their price
        pol.served(1, 0.5, None)
        pol.served(1, 1.3, 3)
    assert pol.plain_scale == pytest.approx(0.5 / 0.65, rel=0.02)
    assert pol.round_scale == pytest.approx(1.0, rel=0.02)
    assert pol.plain_wins(1)
    # rounds served 20% over their price, plain steps at theirs: the same turn
    other = AdaptivePolicy(table=table((0.65, 3.0)), max_k=3, settings=NO_EXPLORE)
    for _ in range(200):
        other.served(1, 1.3 * 1.2, 3)
        other.served(1, 0.65, None)
    assert other.round_scale == pytest.approx(1.2, rel=0.02) and other.plain_wins(1)


def test_a_regime_never_served_takes_the_other_s_scale():
    """Rounds served 10% under their price say little of plain steps, which do not run:
    the prices of both scale alike until plain steps are served too. Scaling rounds alone
    would tilt every tie toward them, and the plain regime, never entered, would never
    correct it (on an H200 the profile priced plain steps 16% over service, rounds 11%)."""
    pol = AdaptivePolicy(table=table((0.62, 3.0)), max_k=3, settings=NO_EXPLORE)
    assert pol.plain_wins(1)  # 0.62 s a token plain; 1.3 / 2.176 x 1.05 = 0.627 by rounds
    for _ in range(300):
        pol.served(1, 1.3 * 0.9, 3)
    assert pol.round_scale == pytest.approx(0.9, rel=0.01)
    assert pol.plain_scale == pytest.approx(0.9, rel=0.01)
    assert pol.plain_wins(1)  # the same tie, both sides 10% cheaper
    for _ in range(300):  # plain steps served 20% under their price: now theirs
        pol.served(1, 0.62 * 0.8, None)
    assert pol.plain_scale == pytest.approx(0.8, rel=0.01)
    assert pol.round_scale == pytest.approx(0.9, rel=0.01)
    with pytest.raises(ValueError, match="served_alpha"):
        AdaptiveSettings(served_alpha=2.0)


def test_the_plain_cost_round_trips_and_is_checked():
    t = table((0.5, 3.0))
    assert StepCostTable.from_json(t.to_json()) == t
    assert t.plain_cost(1) == 0.5 and t.plain_cost(32) == pytest.approx(0.5 + 2.5 * 31 / 63)
    old = '{"batch_sizes": [1, 64], "seconds": [[1.0, 1.1], [4.0, 8.0]]}'  # before "plain"
    assert StepCostTable.from_json(old).plain_cost(1) is None
    with pytest.raises(ValueError, match="plain"):
        table((0.5,))
    with pytest.raises(ValueError, match="plain"):
        table((0.5, 0.0))


# ---- the engine under a forced regime schedule -------------------------------------------------


class ForcedRegime:
    """A policy that drafts k every speculative step and answers `plain_wins` from a schedule,
    one entry per call (the engine asks once per step)."""

    def __init__(self, regime: tuple[bool, ...], k: int = 3) -> None:
        self.regime, self.k = itertools.cycle(regime), k
        self.asked: list[bool] = []
        self.settled: list[bool] = []  # per ask: every request held was decoding by rounds
        self.unasked = 0  # plain-regime steps the engine ran without asking

    def plain_step(self) -> None:
        self.unasked += 1

    def plain_wins(self, batch_size: int, req_ids=(), settled=False) -> bool:
        assert 1 <= batch_size <= len(req_ids)  # the requests held, whose estimates count
        self.settled.append(settled)
        self.asked.append(next(self.regime))
        return self.asked[-1]

    def plan(self, req_ids, allow_split):
        return RoundPlan(num_drafts=self.k, drafting=(True,) * len(req_ids))

    def observe(self, req_id, num_drafts, num_accepted):
        pass

    def forget(self, req_id):
        pass


SPEC = SpecConfig(num_steps=3)
# The policy's answers, one per ask: spec steps (prefill, rounds), then plain -- the requests of
# the first spec stretch go plain and stay plain; requests added while they decode are plain
# too, unasked (a step never runs plain rows next to a round) --, then, once every plain
# request is gone, spec again for the ones added after: they draft.
REGIME = (False,) * 4 + (True,) + (False,) * 100


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("bs", [1, 3])
def test_greedy_equals_plain_across_regime_switches(bs, overlap):
    model = tiny_target("llama")
    first, later, last = prompts(bs, seed=61 + bs), prompts(2, seed=71), prompts(2, seed=72)
    policy = ForcedRegime(REGIME)
    eng = SpecEngine(engine_cfg(overlap_schedule=overlap), SPEC, model,
                     tiny_head(model, "eagle"), policy=policy)
    assert eng.overlap_ok == overlap and not eng.overlap
    rounds = []  # rounds per step, to see that none ran next to plain rows
    ids = [eng.add_request(p, greedy(30)) for p in first]
    out: dict[str, list[int]] = {}
    made_plain: set[str] = set()
    drafted_last = overlapped = False
    for step in itertools.count():
        assert step < 600
        if step == 12:  # the first ones decode plain now: these join them, unasked
            asked = len(policy.asked)
            ids += [eng.add_request(p, greedy(30)) for p in later]
        if not eng.has_unfinished():
            if len(ids) == bs + 4:
                break
            ids += [eng.add_request(p, greedy(30)) for p in last]  # nothing plain left
        before = eng.spec_stats.num_rounds
        for o in eng.step():
            out.setdefault(o.req_id, []).extend(o.new_token_ids)
        held_plain = any(eng.spec_scheduler.is_plain(r) for r in eng.scheduler.requests)
        rounds.append((eng.spec_stats.num_rounds > before, held_plain))
        made_plain |= {r for r in ids if eng.spec_scheduler.is_plain(r)}
        assert not made_plain & set(eng.seeds), "a request made plain drafted again"
        drafted_last |= any(r in eng.seeds for r in ids[bs + 2:])
        overlapped |= eng._inflight is not None  # a plain step left in flight
        if step == 12:
            assert len(policy.asked) == asked  # joined the regime without asking
    assert made_plain == set(ids[: bs + 2]) and drafted_last and overlapped == overlap
    assert not [r for r in rounds if r == (True, True)]  # no round next to a plain request
    assert True in policy.asked and policy.unasked > 0
    want = reference(model, first + later + last, greedy(30))
    assert [out[r] for r in ids] == [list(c.output_ids) for c in want]
    assert_pages_free(eng)


def test_the_engine_tells_the_policy_what_steady_steps_took():
    """Each step without prompt work reports its time, its batch and its regime (k, or None
    for a plain-regime step); a step that prefills reports nothing (the table prices
    arrivals apart)."""
    class Timed(ForcedRegime):
        def __init__(self, regime):
            super().__init__(regime)
            self.served_steps: list[tuple[int, int | None, float]] = []

        def served(self, batch_size, seconds, num_drafts):
            self.served_steps.append((batch_size, num_drafts, seconds))

    model = tiny_target("llama")
    policy = Timed(REGIME)
    eng = SpecEngine(engine_cfg(overlap_schedule=True), SPEC, model, tiny_head(model, "eagle"),
                     policy=policy)
    for p in prompts(2, seed=5):
        eng.add_request(p, greedy(20))
    arrived, arrivals = True, 0  # steps that prefill a prompt: the first, and step 8's
    for step in itertools.count():
        if not eng.has_unfinished():
            break
        if step == 8:  # the first two decode plain by now: it arrives in the plain regime
            eng.add_request(prompts(1, seed=6)[0], greedy(20))
            arrived = True
        before = len(policy.served_steps)
        eng.step()
        eng.spec_scheduler.flush_plain()  # what a steady plain-regime step defers (next test)
        added = policy.served_steps[before:]
        assert len(added) <= 1 and not (arrived and added)
        arrivals += arrived
        arrived = False
    kinds = {(b, k) for b, k, _ in policy.served_steps}
    assert (2, 3) in kinds and (3, None) in kinds  # rounds of k = 3, then plain steps
    assert arrivals == 2
    assert all(sec > 0 for _, _, sec in policy.served_steps)
    assert_pages_free(eng)


def test_seeded_sampling_is_reproducible_under_a_regime_schedule():
    model = tiny_target("llama")
    ps = prompts(3, seed=8)
    params = SamplingParams(max_new_tokens=24, ignore_eos=True, temperature=0.8, seed=5)
    assert_seeded_runs_equal(lambda: SpecEngine(engine_cfg(overlap_schedule=True), SPEC, model,
                                                tiny_head(model, "eagle"),
                                                policy=ForcedRegime(REGIME)), ps, params)


def test_no_plain_regime_while_a_prefill_only_request_is_in_the_engine():
    """A prefill worker's requests leave with a draft seed: the regime never takes them."""
    model = tiny_target("llama")
    policy = ForcedRegime((True,))
    eng = SpecEngine(engine_cfg(), SPEC, model, tiny_head(model, "eagle"), policy=policy)
    eng.add_prefill_request(prompts(1, seed=3)[0], greedy(8), "p-0")
    while eng.has_unfinished():
        eng.step()
    (handoff,) = eng.take_handoffs()
    assert handoff.seed is not None and not eng.spec_scheduler.is_plain("p-0")
    assert policy.asked == []
    eng.free_pages(handoff.page_ids)


@pytest.mark.timeout(120)
def test_a_decode_worker_never_overlaps_its_plain_steps(tmp_path):
    """KV transfers land in a decode worker's free pages: a page freed while a plain step is
    in flight must not be handed to a transfer, so the worker's engine never overlaps, even
    where its config asks for overlap scheduling."""
    import dataclasses

    from disagg_helpers import tiny_model_and_head, worker_config

    from tandem.decode_node.worker import DecodeWorker

    model_dir, head_dir = tiny_model_and_head(tmp_path)
    cfg = worker_config("d", model_dir, head_dir, "fake")
    cfg = dataclasses.replace(cfg, engine=dataclasses.replace(cfg.engine, overlap_schedule=True))
    decode = DecodeWorker(cfg)
    try:
        assert not decode.engine.overlap_ok and not decode.engine.overlap
    finally:
        decode.close()


@pytest.mark.timeout(120)
def test_profiling_an_engine_whose_plain_regime_holds_still_seeds_its_requests():
    """The cost profile seeds its requests under a fixed k: under a policy whose plain regime
    holds they would never get a seed, and the profile would step forever."""
    from tandem.spec import cost_profile

    model = tiny_target()
    policy = ForcedRegime((True,))
    eng = SpecEngine(engine_cfg(), SPEC, model, tiny_head(model, "eagle"), policy=policy)
    table = cost_profile.profile(eng, repeats=1, batch_sizes=(1, 2))
    assert table.batch_sizes == (1, 2) and len(table.plain) == 2
    assert eng.spec_scheduler.policy is policy  # its own policy again afterwards
    assert_pages_free(eng)


def test_plain_requests_keep_overlapped_plain_steps_after_the_policy_turns():
    """Once every request the engine holds is plain, its steps are plain engine steps
    (overlapped) without asking the policy -- also after the policy stopped favouring plain
    steps, and for a request added meanwhile, which is plain too: a round next to plain rows
    would cost two forwards a step. A request added once they are gone asks the policy again
    and drafts."""
    model = tiny_target("llama")
    policy = ForcedRegime((True,) + (False,) * 50)
    eng = SpecEngine(engine_cfg(overlap_schedule=True), SPEC, model,
                     tiny_head(model, "eagle"), policy=policy)
    run_plan = []
    eng._run_plan = lambda plan, orig=eng._run_plan: run_plan.append(plan) or orig(plan)
    first, later, last = prompts(2, seed=81), prompts(1, seed=82), prompts(1, seed=83)
    ids = [eng.add_request(p, greedy(20)) for p in first]
    out: dict[str, list[int]] = {}

    def drain() -> None:
        while eng.has_unfinished():
            for o in eng.step():
                out.setdefault(o.req_id, []).extend(o.new_token_ids)

    for step in range(12):
        for o in eng.step():
            out.setdefault(o.req_id, []).extend(o.new_token_ids)
        assert eng._inflight is not None  # overlapped plain steps throughout
    assert policy.asked == [True] and not run_plan
    ids += [eng.add_request(p, greedy(20)) for p in later]
    drain()
    assert policy.asked == [True] and eng.spec_stats.num_rounds == 0 and not run_plan
    ids += [eng.add_request(p, greedy(20)) for p in last]
    drain()
    assert policy.asked[1] is False and eng.spec_stats.num_rounds > 0  # the newcomer drafted
    want = reference(model, first + later + last, greedy(20))
    assert [out[r] for r in ids] == [list(c.output_ids) for c in want]
    assert_pages_free(eng)

# ---- what an arriving prompt costs under rounds, and the margin ----------------------------


def test_the_arrival_cost_of_rounds_turns_the_choice_plain():
    """Each request pays a dearer prompt step when the engine decodes by rounds
    (`StepCostTable.arrival`), spread over the tokens a request runs. Rounds that beat plain
    steps per token lose once that is counted, the more so the shorter the requests."""
    rounds = StepCostTable(batch_sizes=(1, 64), seconds=ROUNDS, plain=(0.9, 3.0))
    settings = AdaptiveSettings(explore_band=0.0, margin=0.0, output_len_prior=100.0)
    assert not AdaptivePolicy(table=rounds, max_k=3, settings=settings).plain_wins(1)
    # at the prior, a 3-round: 1.3 s / 2.176 tokens = 0.597 s a token, plain 0.9 s: rounds win
    # by 0.30 s a token, which an arrival cost of 0.31 s a token (31 s over 100 tokens) undoes
    dear = dataclasses.replace(rounds, arrival=31.0)
    pol = AdaptivePolicy(table=dear, max_k=3, settings=settings)
    assert pol.plain_wins(1)
    long = AdaptivePolicy(table=dear, max_k=3, settings=dataclasses.replace(
        settings, output_len_prior=1000.0))
    assert not long.plain_wins(1)  # 0.031 s a token over 1000-token requests: rounds win
    for _ in range(200):  # requests turn out short: the mean moves toward 10 tokens
        long.finished(10)
    assert long.output_len == pytest.approx(10.0, rel=0.01)
    assert long.plain_wins(1)


def test_requests_already_drafting_keep_rounds_through_a_near_tie():
    """`settled` (every request held decodes by rounds, its arrival paid): turning plain is for
    good for requests already drafting, so plain must win by the margin, and the arrival cost
    -- already paid -- is not priced."""
    # at the prior a 3-round costs 1.3 / 2.176 = 0.597 s a token
    for plain, unsettled, settled in ((0.62, True, False),   # rounds ahead by 3.8%: a tie
                                      (0.56, True, False),   # plain ahead by 6.2% < margin 7%
                                      (0.55, True, True)):   # plain ahead by 8.6%
        t = StepCostTable(batch_sizes=(1, 64), seconds=ROUNDS, plain=(plain, 3.0))
        settings = AdaptiveSettings(explore_band=0.0, margin=0.07)
        assert AdaptivePolicy(table=t, max_k=3, settings=settings).plain_wins(1) == unsettled
        assert AdaptivePolicy(table=t, max_k=3, settings=settings).plain_wins(
            1, settled=True) == settled
    # an arrival priced at 0.31 s a token turns a new request plain, not one drafting already
    t = StepCostTable(batch_sizes=(1, 64), seconds=ROUNDS, plain=(0.9, 3.0), arrival=31.0)
    settings = AdaptiveSettings(explore_band=0.0, margin=0.0, output_len_prior=100.0)
    assert AdaptivePolicy(table=t, max_k=3, settings=settings).plain_wins(1)
    assert not AdaptivePolicy(table=t, max_k=3, settings=settings).plain_wins(1, settled=True)


def test_the_engine_asks_settled_only_while_every_request_drafts():
    """`SpecScheduler.plain_regime` asks the policy as settled exactly on the steps where every
    request held has its draft seed: not on a step with a request to prefill (an arrival)."""
    model = tiny_target("llama")
    policy = ForcedRegime((False,))
    eng = SpecEngine(engine_cfg(), SPEC, model, tiny_head(model, "eagle"), policy=policy)
    eng.add_request(prompts(1, seed=81)[0], greedy(12))
    want = []
    for step in range(8):
        if step == 4:
            eng.add_request(prompts(1, seed=82)[0], greedy(12))
        want.append(set(eng.scheduler.requests) <= set(eng.seeds))
        eng.step()
    assert policy.settled == want
    assert want == [False, True, True, True, False, True, True, True]
    while eng.has_unfinished():
        eng.step()
    assert_pages_free(eng)


def test_near_ties_go_to_the_plain_regime():
    """Rounds must beat a plain step's time per token by `margin`."""
    # at the prior a 3-round costs 0.597 s a token; a plain step of 0.62 s is 3.8% dearer
    t = StepCostTable(batch_sizes=(1, 64), seconds=ROUNDS, plain=(0.62, 3.0))
    def wins(margin: float) -> bool:
        settings = AdaptiveSettings(explore_band=0.0, margin=margin)
        return AdaptivePolicy(table=t, max_k=3, settings=settings).plain_wins(1)

    assert not wins(0.0)
    assert wins(0.05)
    assert not wins(0.03)
    with pytest.raises(ValueError, match="margin"):
        AdaptiveSettings(margin=-0.1)
    with pytest.raises(ValueError, match="output_len_prior"):
        AdaptiveSettings(output_len_prior=0.0)


def test_the_arrival_cost_round_trips_and_is_checked():
    t = dataclasses.replace(table((0.5, 3.0)), arrival=0.004)
    assert StepCostTable.from_json(t.to_json()) == t
    assert t.envelope().arrival == 0.004
    old = '{"batch_sizes": [1], "seconds": [[1.0, 1.1]], "plain": [0.5]}'  # before "arrival"
    assert StepCostTable.from_json(old).arrival == 0.0
    with pytest.raises(ValueError, match="arrival"):
        dataclasses.replace(t, arrival=-1.0)


def test_the_engine_tells_the_policy_how_long_requests_ran():
    """Requests that end by their stop conditions report their output length to the policy
    (`AdaptivePolicy.finished`); aborted ones do not."""

    told: list[int] = []

    class Told(AdaptivePolicy):
        def finished(self, num_output_tokens: int) -> None:
            told.append(num_output_tokens)

    model = tiny_target("llama")
    pol = Told(table=table((0.9, 3.0)), max_k=2, settings=NO_EXPLORE)
    eng = SpecEngine(engine_cfg(), SpecConfig(num_steps=2), model, tiny_head(model, "eagle"),
                     policy=pol)
    ps = prompts(3, seed=5)
    got = eng.generate(ps, [greedy(n) for n in (4, 7, 9)])
    assert sorted(told) == sorted(len(c.output_ids) for c in got) == [4, 7, 9]
    rid = eng.add_request(ps[0], greedy(50))
    eng.step()
    eng.step()
    eng.abort(rid)
    assert len(told) == 3
    assert_pages_free(eng)


def test_profiling_prices_an_arrival_as_rounds_minus_plain_steps(monkeypatch):
    """cost_profile.profile: `arrival` is what a prompt adds to a step under rounds less what
    it adds to a plain step, at one batch size, never below 0; every page back after."""
    import tandem.spec.cost_profile as cost_profile

    model = tiny_target("llama")
    eng = SpecEngine(engine_cfg(), SpecConfig(num_steps=2), model, tiny_head(model, "eagle"))
    priced: list[str] = []

    def fake(e, step, repeats):
        priced.append(step.__name__)
        return 0.007 if step.__name__ == "step" else 0.002

    monkeypatch.setattr(cost_profile, "_arrival", fake)
    t = cost_profile.profile(eng, repeats=1, batch_sizes=(1, 2))
    assert priced == ["step", "plain_step"] and t.arrival == pytest.approx(0.005)
    monkeypatch.setattr(cost_profile, "_arrival",
                        lambda e, step, r: 0.001 if step.__name__ == "step" else 0.002)
    assert cost_profile.profile(eng, repeats=1, batch_sizes=(1, 2)).arrival == 0.0
    monkeypatch.undo()
    real = cost_profile.profile(eng, repeats=1, batch_sizes=(1, 2))  # the real timing
    assert real.arrival >= 0.0 and not eng.scheduler.requests
    # the arriving request takes a slot only below the largest size: that one stays profiled
    assert_pages_free(eng)
    four = SpecEngine(engine_cfg(max_num_seqs=4), SpecConfig(num_steps=2), model,
                      tiny_head(model, "eagle"))
    assert cost_profile.profile(four, repeats=1, batch_sizes=(1, 4)).batch_sizes == (1, 4)
    assert_pages_free(four)


def test_steady_plain_regime_steps_reach_the_policy_late_all_and_in_order():
    """A steady step of the plain regime (`SpecScheduler.plain_held`: every request held plain,
    none waiting, none gone) runs without asking the policy or walking the requests; what it
    tells the policy (an unobserved step, its time) waits for `flush_plain` -- 32 such steps,
    a request leaving, or the next step that asks. The policy hears the same steps in the same
    order as when told at once, and nothing stays untold once the engine is idle."""
    class Timed(ForcedRegime):
        def __init__(self, regime):
            super().__init__(regime)
            self.heard: list[tuple[str, int | None]] = []

        def plain_step(self):
            super().plain_step()
            self.heard.append(("unobserved", None))

        def served(self, batch_size, seconds, num_drafts):
            self.heard.append(("served", batch_size))

    def run(flush_each_step: bool) -> tuple[Timed, list[int]]:
        model = tiny_target("llama")
        policy = Timed(REGIME)
        eng = SpecEngine(engine_cfg(overlap_schedule=True), SPEC, model,
                         tiny_head(model, "eagle"), policy=policy)
        for p in prompts(3, seed=7):
            eng.add_request(p, greedy(60))
        lag = []  # per step: steps the policy has not heard of yet
        for step in itertools.count():
            if not eng.has_unfinished():
                break
            if step == 50:
                eng.add_request(prompts(1, seed=8)[0], greedy(10))
            eng.step()
            if flush_each_step:
                eng.spec_scheduler.flush_plain()
            lag.append(len(eng.spec_scheduler._deferred))
        assert not eng.spec_scheduler._deferred
        assert_pages_free(eng)
        return policy, lag

    deferred, lag = run(flush_each_step=False)
    at_once, no_lag = run(flush_each_step=True)
    assert max(no_lag) == 0 and 20 < max(lag) <= 31  # it deferred, 32 at most
    assert deferred.heard == at_once.heard and deferred.unasked == at_once.unasked > 40
    assert deferred.asked == at_once.asked
