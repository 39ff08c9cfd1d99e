"""Adaptive speculation (spec/adaptive.py, spec/cost_profile.py): the policy's maths on its own,
and the engine under any k schedule -- greedy output equal to plain decoding token for token
(float32, chain), k = 0 steps leaving every seed and cache exact, seeded sampling reproducible,
and the cost table given, profiled and cached."""

from __future__ import annotations

import dataclasses
import itertools
import json
import random
from collections.abc import Sequence

import pytest
from spec_fresh_prefill import assert_seeds_equal_a_fresh_prefill
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

import tandem.spec.cost_profile as cost_profile
from tandem.engine import SamplingParams
from tandem.spec import SpecConfig, SpecEngine
from tandem.spec.adaptive import (
    AdaptivePolicy,
    AdaptiveSettings,
    RoundPlan,
    StepCostTable,
    break_even,
    ewma_update,
    expected_tokens,
    plan_round,
    relax,
)

# ---- the policy, pure ---------------------------------------------------------------------------

# Memory-bound at 1..4 rows (a draft costs 10% of a plain step), compute-bound by 64 (each
# verified token costs as much as a plain row's).
# The pure choice, without trying a k never served (tested in test_spec_served_prices.py)
NO_EXPLORE = AdaptiveSettings(explore_band=0.0)
TABLE = StepCostTable(batch_sizes=(1, 4, 64),
                      seconds=((1.0, 1.1, 1.2, 1.3), (1.0, 1.1, 1.2, 1.3),
                               (4.0, 8.0, 12.0, 16.0)))


def test_expected_tokens_is_one_plus_the_accepted_prefix_sums():
    assert expected_tokens([0.5, 0.5, 0.5], 0) == 1.0
    assert expected_tokens([0.5, 0.5, 0.5], 3) == pytest.approx(1 + 0.5 + 0.25 + 0.125)
    assert expected_tokens([1.0, 0.0, 1.0], 3) == 2.0  # nothing past a sure rejection


def test_ewma_observes_the_cumulative_acceptance_of_every_proposed_position():
    p = (0.5, 0.5, 0.5, 0.5)  # q = P(at least j accepted) = .5, .25, .125, .0625
    # one of four accepted: q -> .75, .125, .0625, .03125; p_j = q_j / q_{j-1}
    assert ewma_update(p, 4, 1, 0.5) == pytest.approx((0.75, 0.125 / 0.75, 0.5, 0.5))
    # both of two accepted: q -> .75, .625; position 3, 4 keep their conditional
    assert ewma_update(p, 2, 2, 0.5) == pytest.approx((0.75, 0.625 / 0.75, 0.5, 0.5))
    assert ewma_update(p, 0, 0, 0.5) == p  # a plain step teaches nothing
    assert ewma_update((1.0, 1.0), 2, 2, 0.5) == (1.0, 1.0)
    assert ewma_update((0.0, 0.5), 2, 0, 0.5) == (0.0, 0.5)  # q_1 = 0: p_2 unobservable
    assert relax((0.0, 1.0), (0.5, 0.5), 0.5) == (0.25, 0.75)


def test_the_estimate_of_a_late_position_converges_as_fast_as_the_first():
    """Rounds of k = 4 whose drafts land with conditional probabilities .55 .55 .46 .27 (the
    shipped SmolLM2 head on an H200): E(4) = 2.03. From the prior 0.6 (E(4) = 2.31), 100
    rounds at the engine-wide alpha bring the estimate within 0.05 of it, on average over 50
    runs (0.03). Each conditional p_j updated on its own rounds -- p_4 seen in ~14% of them
    -- read 0.08 high."""
    rng = random.Random(0)
    cond = (0.55, 0.55, 0.46, 0.27)
    truth = expected_tokens(cond, 4)
    errors = []
    for _ in range(50):
        p = (0.6,) * 4
        for _ in range(100):
            a = 0
            while a < 4 and rng.random() < cond[a]:
                a += 1
            p = ewma_update(p, 4, a, 0.02)
        errors.append(expected_tokens(p, 4) - truth)
    assert abs(sum(errors) / len(errors)) < 0.05


def test_cost_table_interpolates_and_round_trips():
    assert TABLE.cost(2, 1) == TABLE.cost(2, 0) == 1.2  # below the grid: its first row
    assert TABLE.cost(1, 34) == pytest.approx(1.1 + (8.0 - 1.1) * 30 / 60)
    assert TABLE.cost(0, 124) == pytest.approx(7.0)  # past the grid: the last slope
    assert StepCostTable.from_json(TABLE.to_json()) == TABLE
    assert break_even(TABLE, 3, 64) == 4.0
    with pytest.raises(ValueError, match="k: must be in"):
        TABLE.cost(4, 1)
    with pytest.raises(ValueError, match="batch_sizes"):
        StepCostTable(batch_sizes=(4, 1), seconds=((1.0,), (1.0,)))
    with pytest.raises(ValueError, match="seconds"):
        StepCostTable(batch_sizes=(1,), seconds=((1.0, 0.0),))


def test_plan_picks_the_k_of_highest_expected_rate():
    good, bad = (0.9, 0.9, 0.9), (0.05, 0.05, 0.05)
    assert plan_round(TABLE, [good] * 2, 3).num_drafts == 3  # cheap drafts, likely accepted
    assert plan_round(TABLE, [bad] * 2, 3) == RoundPlan(num_drafts=0, drafting=(False, False))
    assert plan_round(TABLE, [good] * 2, 2).num_drafts == 2  # capped by max_k
    # one likely draft, then nothing: k = 1
    assert plan_round(TABLE, [(0.9, 0.0, 0.0)] * 2, 3).num_drafts == 1
    # compute-bound: 4 tokens per row would be needed for k = 3, 2 for k = 1
    assert plan_round(TABLE, [good] * 64, 3).num_drafts == 0


def test_plan_splits_off_requests_below_break_even_only_where_it_pays():
    good, bad = (1.0, 1.0, 1.0), (0.0, 0.0, 0.0)
    mid = StepCostTable(batch_sizes=(1, 8), seconds=((1.0, 1.2, 1.4, 1.6), (2.0, 3.0, 4.0, 5.0)))
    rows = [good] * 4 + [bad] * 4
    plan = plan_round(mid, rows, 3)
    assert plan.splits and plan.drafting == (True,) * 4 + (False,) * 4
    assert plan_round(mid, rows, 3, allow_split=False).drafting in ((True,) * 8, (False,) * 8)
    # memory-bound: one round over everybody is cheaper than two forwards
    assert not plan_round(TABLE, [good, bad], 3).splits


def test_the_policy_keeps_its_k_unless_another_wins_by_the_switch_margin():
    """A change of k drops the drafting queued ahead for the old k (spec/ahead.py), so the
    last step's k stands unless another beats it by `k_switch_margin`."""
    p = (0.6, 0.6, 0.6)  # at 1 row: k = 2 gives 1.96 / 1.2 = 1.633 a second, k = 3 1.674
    assert plan_round(TABLE, [p], 3).num_drafts == 3
    assert plan_round(TABLE, [p], 3, keep_k=2, keep_margin=0.03).num_drafts == 2
    assert plan_round(TABLE, [p], 3, keep_k=2, keep_margin=0.02).num_drafts == 3
    kept = AdaptivePolicy(table=TABLE, max_k=3, overall=p, last_k=2, settings=NO_EXPLORE)
    assert kept.plan(["a"], True).num_drafts == 2  # 2.5% better: not worth the switch
    assert kept.last_k == 2
    free = AdaptivePolicy(table=TABLE, max_k=3, overall=p, last_k=2,
                          settings=AdaptiveSettings(k_switch_margin=0.0, explore_band=0.0))
    assert free.plan(["a"], True).num_drafts == 3 and free.last_k == 3
    good = AdaptivePolicy(table=TABLE, max_k=3, overall=(0.9, 0.9, 0.9), last_k=2,
                          settings=NO_EXPLORE)
    assert good.plan(["a"], True).num_drafts == 3  # 2.645 against 2.258: switch
    bad = AdaptivePolicy(table=TABLE, max_k=3, overall=(0.05, 0.05, 0.05), last_k=3,
                         settings=NO_EXPLORE)
    assert bad.plan(["a"], True).num_drafts == 0 and bad.last_k == 0  # k = 0 is never held off
    with pytest.raises(ValueError, match="k_switch_margin"):
        AdaptiveSettings(k_switch_margin=-0.01)


def test_policy_learns_per_request_and_a_muted_request_comes_back():
    pol = AdaptivePolicy(table=TABLE, max_k=3,
                         settings=AdaptiveSettings(alpha=0.5, relax=0.01, explore_band=0.0))
    assert pol.plan(["a"], True).num_drafts == 3  # prior 0.6: drafting pays
    for _ in range(8):
        pol.observe("a", 3, 0)
    assert pol.plan(["a"], True).num_drafts == 0  # its drafts keep failing: plain steps
    steps = 0
    while pol.plan(["a"], True).num_drafts == 0:  # unobserved, back toward the prior
        steps += 1
        assert steps < 100
    assert steps > 5
    pol.forget("a")
    assert "a" not in pol.per_request


# ---- the engine under a forced k schedule ------------------------------------------------------


class ForcedK:
    """A k policy that follows a schedule, step by step; every `split_every`-th step splits the
    batch (even rows draft, odd rows run the plain round)."""

    def __init__(self, ks: Sequence[int], split_every: int = 0) -> None:
        self.ks, self.step, self.split_every = itertools.cycle(ks), 0, split_every
        self.plans: list[RoundPlan] = []
        self.seen: list[tuple[str, int, int]] = []

    def plan(self, req_ids, allow_split):
        self.step += 1
        k = next(self.ks)
        split = bool(self.split_every) and self.step % self.split_every == 0 and allow_split
        drafting = tuple(not split or r % 2 == 0 for r in range(len(req_ids)))
        self.plans.append(RoundPlan(num_drafts=k, drafting=drafting))
        return self.plans[-1]

    def observe(self, req_id, num_drafts, num_accepted):
        assert 0 <= num_accepted <= num_drafts
        self.seen.append((req_id, num_drafts, num_accepted))

    def forget(self, req_id):
        pass


SPEC = SpecConfig(num_steps=3)
KS = (3, 0, 1, 0, 0, 2, 3, 1)


@pytest.mark.parametrize("bs", [1, 3])
def test_greedy_equals_plain_whatever_k_each_step_picks(bs):
    model = tiny_target("llama")
    ps = prompts(bs, seed=41 + bs)
    policy = ForcedK(KS, split_every=3)
    eng = SpecEngine(engine_cfg(), SPEC, model, tiny_head(model, "eagle"), policy=policy)
    got = eng.generate(ps, greedy(24))
    assert [c.output_ids for c in got] == [c.output_ids for c in reference(model, ps, greedy(24))]
    assert_pages_free(eng)
    assert {p.num_drafts for p in policy.plans} == set(KS)
    if bs > 1:  # enough rounds that the random head on the live vocabulary is sometimes right
        assert any(a > 0 for _, _, a in policy.seen)
        assert any(p.splits for p in policy.plans)


def test_logprobs_equal_plain_whatever_k_each_step_picks():
    """k = 0 steps (the plain sampler's logprobs) and split steps (two rounds, each with its
    own rows) give every request the logprobs plain decoding gives it, in float32; a request
    that does not ask beside them gets none."""
    model = tiny_target("llama")
    ps = prompts(3, seed=44)
    asking = SamplingParams(max_new_tokens=24, ignore_eos=True, logprobs=True, top_logprobs=4)
    params = [asking, greedy(24), asking]
    want = reference(model, ps, params)
    policy = ForcedK(KS, split_every=3)
    eng = SpecEngine(engine_cfg(), SPEC, model, tiny_head(model, "eagle"), policy=policy)
    got = eng.generate(ps, params)
    assert any(p.splits for p in policy.plans) and {p.num_drafts for p in policy.plans} == set(KS)
    assert got[1].logprobs == () and want[1].logprobs == ()
    assert len(got[0].logprobs) == len(got[0].output_ids) > 0
    for g, w in zip(got, want):
        assert g.output_ids == w.output_ids
        assert len(g.logprobs) == len(w.logprobs)
        for i, (a, b) in enumerate(zip(g.logprobs, w.logprobs)):
            assert (a.token_id, a.top_ids) == (b.token_id, b.top_ids), i
            assert a.logprob == pytest.approx(b.logprob, abs=1e-5), i
            assert a.top_logprobs == pytest.approx(b.top_logprobs, abs=1e-5), i
    assert_pages_free(eng)


def test_seeded_sampling_is_reproducible_under_a_k_schedule():
    model = tiny_target("llama")
    ps = prompts(3, seed=5)
    params = SamplingParams(max_new_tokens=20, ignore_eos=True, temperature=0.8, seed=11)
    assert_seeded_runs_equal(lambda: SpecEngine(engine_cfg(), SPEC, model,
                                                tiny_head(model, "eagle"),
                                                policy=ForcedK(KS, split_every=2)), ps, params)


def test_a_plain_step_leaves_seed_and_caches_as_a_fresh_prefill():
    """After a k = 0 step (verify of the root, draft-extend of its token) following a
    drafting round, every request's target KV, draft KV and seed equal a prefill of its
    committed tokens: the next round drafts from a valid seed."""
    model = tiny_target("llama", live=None)
    head = tiny_head(model, "eagle", live=None)
    eng = SpecEngine(engine_cfg(), SPEC, model, head, policy=ForcedK((3, 0)))
    for r, p in enumerate(prompts(3, seed=9, lo=3, hi=12)):
        eng.add_request(p, greedy(30), req_id=f"req-{r}")
    for _ in range(3):  # prefill, a k = 3 round, a k = 0 round
        eng.step()
    assert [p.num_drafts for p in eng.spec_scheduler.policy.plans] == [3, 0]
    assert_seeds_equal_a_fresh_prefill(eng, SPEC, model, head)


# ---- the adaptive policy in the engine, and its cost table -------------------------------------


def test_adaptive_engine_with_a_given_table_is_lossless(tmp_path):
    path = tmp_path / "costs.json"
    path.write_text(TABLE.to_json())
    model = tiny_target("llama")
    ps = prompts(3, seed=77)
    spec = SpecConfig(num_steps=3, adaptive=True, cost_table=str(path))
    head = tiny_head(model, "eagle")
    head.cfg = dataclasses.replace(head.cfg, acceptance=(0.7, 0.35))  # its measured prior
    eng = SpecEngine(engine_cfg(), spec, model, head)
    assert isinstance(eng.spec_scheduler.policy, AdaptivePolicy)
    assert eng.spec_scheduler.policy.overall == pytest.approx((0.7, 0.5, 0.6))
    got = eng.generate(ps, greedy(20))
    assert [c.output_ids for c in got] == [c.output_ids for c in reference(model, ps, greedy(20))]
    assert eng.spec_scheduler.policy.per_request == {}  # finished requests forgotten
    assert_pages_free(eng)


def test_profiled_table_is_cached_and_a_second_start_reads_it(tmp_path, monkeypatch):
    monkeypatch.setenv("TANDEM_CACHE", str(tmp_path))
    monkeypatch.delenv(cost_profile.CACHE_ENV, raising=False)
    model = tiny_target("llama")
    spec = SpecConfig(num_steps=2, adaptive=True)
    eng = SpecEngine(engine_cfg(), spec, model, tiny_head(model, "eagle"))
    table = eng.spec_scheduler.policy.table
    assert table.max_k == 2 and table.batch_sizes == cost_profile.CPU_BATCH_SIZES
    # the plain engine's step is priced too (the plain regime's input), per batch size
    assert len(table.plain) == len(table.batch_sizes) and all(s > 0 for s in table.plain)
    assert cost_profile.cache_file(eng).is_file()
    assert eng.spec_stats.num_rounds == 0 and not eng.scheduler.requests  # profiling left
    assert_pages_free(eng)

    def no_profiling(*a, **kw):
        raise AssertionError("profiled again despite the cache")

    monkeypatch.setattr(cost_profile, "profile", no_profiling)
    again = SpecEngine(engine_cfg(), spec, model, tiny_head(model, "eagle"))
    assert again.spec_scheduler.policy.table == table


def test_adaptive_needs_a_chain():
    with pytest.raises(ValueError, match="adaptive"):
        SpecConfig(num_steps=2, topk=2, adaptive=True)


def test_adaptive_from_yaml_and_cli():
    import argparse

    from tandem.cli import serve
    from tandem.deploy.config import ConfigError, parse_deploy

    cfg = parse_deploy({"spec": {"num_steps": 3, "adaptive": True, "cost_table": "t.json"}})
    assert cfg.spec.adaptive and cfg.spec.cost_table == "t.json"
    with pytest.raises(ConfigError, match="spec.adaptive"):
        parse_deploy({"spec": {"adaptive": "yes"}})
    parser = argparse.ArgumentParser()
    serve.add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["serve", "--adaptive-spec"])
    assert serve._spec_flags_over(args, parse_deploy({})).spec.adaptive
    args = parser.parse_args(["serve"])
    assert serve._spec_flags_over(args, cfg).spec.adaptive  # no flag: the config's stands


def test_a_profiled_cost_is_the_least_of_its_runs():
    """A disturbed run (a first use's capture or compilation, a collection) only adds time:
    the profile keeps the least mean of its runs, after two warm-up calls."""
    import time as _time
    from types import SimpleNamespace

    import torch

    from tandem.spec.cost_profile import _time_steps

    calls = []

    def step():
        calls.append(1)
        _time.sleep(0.05 if len(calls) in (1, 2, 4) else 0.001)  # warm-ups, then one spike
        return []

    eng = SimpleNamespace(device=torch.device("cpu"))
    got = _time_steps(eng, step, n=2, samples=3)
    assert len(calls) == 2 + 3 * 2
    # the least run (~1 ms a call): not the run with the spike (~25 ms), nor a mean over runs
    assert got < 0.005


def test_the_profiled_table_is_its_monotone_envelope():
    """More work never costs less: an entry above one of more drafts or more requests is noise
    and is taken down to it; an entry below its neighbours stays (noise only adds time)."""
    measured = StepCostTable(
        batch_sizes=(1, 4, 16),
        seconds=((1.3, 2.95, 1.8, 1.99), (1.6, 1.8, 1.9, 2.0), (1.9, 3.26, 2.2, 2.79)),
        plain=(0.76, 0.74, 1.2))
    env = measured.envelope()
    assert env.seconds == ((1.3, 1.8, 1.8, 1.99), (1.6, 1.8, 1.9, 2.0), (1.9, 2.2, 2.2, 2.79))
    assert env.plain == (0.74, 0.74, 1.2)
    for i in range(3):  # monotone in k and in the batch size
        assert list(env.seconds[i]) == sorted(env.seconds[i])
        assert all(env.seconds[i][k] <= env.seconds[i + 1][k] for k in range(4) if i < 2)
    assert env.envelope() == env  # idempotent
    assert TABLE.envelope() == TABLE  # an already monotone table is left as it is


def test_profile_returns_the_envelope(monkeypatch):
    """cost_profile.profile hands the policy (and the cache) the envelope of what it timed."""
    seen = {}
    real = StepCostTable.envelope

    def spy(self):
        seen["measured"] = self
        return real(self)

    monkeypatch.setattr(StepCostTable, "envelope", spy)
    model = tiny_target("llama")
    eng = SpecEngine(engine_cfg(), SpecConfig(num_steps=2), model, tiny_head(model, "eagle"))
    table = cost_profile.profile(eng, repeats=1, batch_sizes=(1, 2))
    assert table == real(seen["measured"]) and table.batch_sizes == (1, 2)
    assert_pages_free(eng)


def test_each_profiling_sample_times_every_k_in_turn(monkeypatch):
    """A drift of the host's speed while profiling must touch every k alike: each sample
    times k = 0 .. num_steps in turn, over requests of its own, and each k keeps its least (an H200 priced a batch-1
    round of k=4 23% over k=3 when every k's samples ran back to back; served: 6%)."""
    timed: list[int | None] = []
    contexts: list[int] = []  # the longest request's tokens at each timing
    drift = iter(range(1, 1000))

    def fake(eng, step, n, samples=1):
        k = getattr(eng.spec_scheduler.policy, "k", None) if step == eng.step else None
        timed.append(k)
        contexts.append(max(r.num_tokens for r in eng.scheduler.running))
        for _ in range(2):  # the requests grow as timed steps would grow them
            step()
        return next(drift) * 1e-3  # every run slower than the one before

    monkeypatch.setattr(cost_profile, "_time_steps", fake)
    model = tiny_target("llama")
    eng = SpecEngine(engine_cfg(), SpecConfig(num_steps=2), model, tiny_head(model, "eagle"))
    table = cost_profile.profile(eng, repeats=1, batch_sizes=(1,), samples=2)
    assert timed[:6] == [0, 1, 2, 0, 1, 2] and timed[6:] == [None]  # then plain steps
    # each sample, and the plain steps, over fresh requests: the same contexts again (kept
    # through every sample, requests had grown ~500 tokens by the plain steps on a GPU)
    assert contexts[3:6] == contexts[:3] and contexts[6] == contexts[0]
    assert table.seconds == ((1e-3, 2e-3, 3e-3),)  # each k's least: its first sample's
    assert_pages_free(eng)


def test_positions_past_k_relax_toward_the_prior_so_a_low_tail_is_no_trap():
    """A round of k observes positions 1..k only; those past k relax toward the prior. Kept
    as they were, a low estimate at position k + 1 held k below it for good (an H200 run:
    4th-position conditional 0.35 against the head's 0.66, k <= 3 for 50 requests)."""
    # alpha 0: the observed position stays; the two past k = 1 move halfway to the prior
    assert ewma_update((0.0, 0.0, 1.0), 1, 0, 0.0, (0.5, 0.5, 0.5), 0.5) == (0.0, 0.25, 0.75)
    p = (0.5, 0.5, 0.5, 0.5)  # as the ewma test below, k = 2, and positions 3, 4 relaxed
    assert ewma_update(p, 2, 2, 0.5, (0.5, 0.5, 0.9, 0.1), 0.5) == pytest.approx(
        (0.75, 0.625 / 0.75, 0.7, 0.3))
    table = StepCostTable(batch_sizes=(1,), seconds=((1.0, 1.205, 1.275, 1.35, 1.414),))
    pol = AdaptivePolicy(table=table, max_k=4, measured=(0.62, 0.40, 0.24, 0.16),
                         overall=(0.9, 0.9, 0.9, 0.05), settings=NO_EXPLORE)
    assert pol.plan(["a"], True).num_drafts == 3
    ks = []
    for _ in range(60):
        k = pol.plan(["a"], True).num_drafts
        ks.append(k)
        pol.observe("a", k, k)  # every draft accepted
    first = ks.index(4)  # the 4th position came back toward 0.16 / 0.24 = 0.667
    assert 20 < first < 45 and set(ks[first:]) == {4}
    assert pol.overall[3] > 0.3  # the engine-wide estimate too


def test_the_prior_is_the_heads_measured_acceptance():
    """A head whose config gives its measured P(draft j accepted) starts the policy (and
    relaxes it) toward those conditionals; positions past them, and heads without, at
    `settings.prior`. The shipped SmolLM2 head carries its own."""
    from tandem.spec.head_config import DraftHeadConfig, DraftHeadError
    from tandem.spec.shipped import SHIPPED_HEADS

    table = StepCostTable(batch_sizes=(1,), seconds=((1.0, 1.2, 1.3, 1.4, 1.5),))
    pol = AdaptivePolicy(table=table, max_k=4, measured=(0.6, 0.3, 0.15))
    assert pol.overall == pytest.approx((0.6, 0.5, 0.5, 0.6))  # 0.6 past the measured ones
    assert expected_tokens(pol.overall, 3) == pytest.approx(1 + 0.6 + 0.3 + 0.15)
    assert AdaptivePolicy(table=table, max_k=4).overall == (0.6,) * 4
    pol.overall = (0.1,) * 4
    pol.plain_step()  # relaxes toward the measured prior, not 0.6 everywhere
    assert pol.overall[1] == pytest.approx(0.1 + pol.settings.plain_relax * (0.5 - 0.1))
    raw = json.loads((SHIPPED_HEADS["default"] / "config.json").read_text())
    assert raw["tandem_acceptance"] == [0.62, 0.40, 0.24, 0.16]
    cfg = DraftHeadConfig.like_target(tiny_target("llama").cfg)
    for bad in ((0.5, 0.6), (1.2,), (-0.1,)):  # rising, or not a probability
        with pytest.raises(DraftHeadError, match="tandem_acceptance"):
            dataclasses.replace(cfg, acceptance=bad)
