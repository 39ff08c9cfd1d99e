"""Verifying ahead (spec/ahead.py): a greedy round in graphs with device metadata queues the
next round's drafting AND its verify before its host read, from device values alone; the next
step uses that verify only with the drafting it verified and only if no verify replayed since.
Either way the output is plain greedy decoding's and every round verifies the tokens it
verifies with nothing queued ahead. CPU: the runner in eager mode (test_spec_graph_padding),
its metadata on the device (test_device_verify)."""

from __future__ import annotations

import pytest
from spec_helpers import (
    assert_pages_free,
    engine_cfg,
    greedy,
    one_thread,  # noqa: F401 (autouse fixture)
    prompts,
    reference,
    tiny_head,
    tiny_target,
)
from test_draft_ahead import _same_rounds, changing_batch
from test_spec_adaptive import KS, SPEC, ForcedK
from test_spec_graph_padding import _attach_graphs
from test_spec_k_graphs import _attach_k_graphs

from tandem.engine import SamplingParams
from tandem.engine.request import Request
from tandem.spec import SpecConfig, SpecEngine
from tandem.spec.ahead import DraftAhead, may_end, verify_batch_by_env

EOS = 17  # a live token of tiny_target: the target emits it


def _engine(model, spec, monkeypatch, verify_batch: int, kind: str = "eagle",
            policy=None, sizes=(1, 2, 4), **cfg) -> SpecEngine:
    eng = SpecEngine(engine_cfg(**cfg), spec, model, tiny_head(model, kind), policy=policy)
    if policy is None:
        _attach_graphs(eng, monkeypatch, sizes, device_metadata=True)
    else:
        _attach_k_graphs(eng, monkeypatch, device_metadata=True)
    eng.set_draft_ahead(True)
    eng.draft_ahead.verify_batch = verify_batch
    verified, launched = [], []  # per round: (num_cached, tokens); verifies launched in-step
    orig = eng._verify_forward

    def spy(v):
        verified.append((v.num_cached, v.tokens.clone()))
        return orig(v)

    monkeypatch.setattr(eng, "_verify_forward", spy)
    for runner in {id(r): r for r in (eng.spec_graphs, *eng.k_graphs.values())}.values():
        real = runner.verify
        monkeypatch.setattr(runner, "verify", lambda v, real=real: launched.append(1) or real(v))
    eng.verified, eng.launched = verified, launched  # type: ignore[attr-defined]
    return eng


@pytest.mark.parametrize("kind", ["eagle", "eagle-2layer", "eagle3"])
@pytest.mark.parametrize("steps", [4, 2])
@pytest.mark.parametrize("bs", [1, 3])  # 3 runs padded in the bucket of 4
def test_verifying_ahead_gives_the_rounds_of_the_step(bs, steps, kind, monkeypatch):
    """Every round of a request but its first (and those `may_end` keeps from queuing) takes
    the verify queued by the round before; the rounds verify the tokens they verify with
    nothing verified ahead, and the output is plain greedy decoding's."""
    model = tiny_target("llama")
    spec = SpecConfig(num_steps=steps)
    ps, params = prompts(bs, seed=70 + bs), greedy(24)
    want = [c.output_ids for c in reference(model, ps, params)]
    on = _engine(model, spec, monkeypatch, verify_batch=4, kind=kind)
    off = _engine(model, spec, monkeypatch, verify_batch=0, kind=kind)
    assert [c.output_ids for c in on.generate(ps, params)] == want
    assert [c.output_ids for c in off.generate(ps, params)] == want
    _same_rounds(on, off)
    assert on.spec_stats.num_tokens == off.spec_stats.num_tokens  # the same acceptance
    ahead = on.draft_ahead
    assert ahead.verify_used > 0 and off.draft_ahead.verify_used == 0
    # Each round verified once: in its step, or queued ahead and used.
    assert len(on.launched) + ahead.verify_used == len(on.verified)  # type: ignore[attr-defined]
    assert ahead.verify_dropped <= bs - 1  # a request ending: the others' round changes
    if bs == 1:  # it ends by its length: its last round (`may_end`) queued nothing
        assert ahead.verify_queued == ahead.verify_used
    assert_pages_free(on)


def test_a_changed_batch_drops_the_verify_queued_ahead(monkeypatch):
    """Requests ending at different rounds (EOS inside accepted runs, max_new_tokens), one
    aborted between steps and one joining late: the verify queued ahead of a changed batch is
    dropped and the round verifies in its step; outputs are plain greedy's."""
    model = tiny_target("llama", eos_token_id=EOS)
    ps = prompts(5, seed=12)
    params = [SamplingParams(max_new_tokens=n) for n in (6, 30, 17, 30, 25)]
    ref = reference(model, ps, params)
    runs = {}
    for vb in (8, 0):
        eng = _engine(model, SpecConfig(num_steps=4), monkeypatch, verify_batch=vb)
        changing_batch(eng, ps, params, ref)
        runs[vb] = eng
    on, off = runs[8], runs[0]
    assert any(EOS in c.output_ids and len(c.output_ids) < p.max_new_tokens
               for c, p in zip(ref, params))  # an EOS ended a request early
    _same_rounds(on, off)
    assert on.draft_ahead.verify_used > 0 and on.draft_ahead.verify_dropped >= 2


def test_a_verify_replayed_in_between_drops_it(monkeypatch):
    """Another verify between the queuing and the next round overwrites the shared logits:
    the queued one must not be used. Simulated by scribbling over the logits buffer and
    counting a replay right after each launch: every round verifies in its step again, and
    the output stays plain greedy's (with the count ignored, it would not)."""
    model = tiny_target("llama")
    ps, params = prompts(2, seed=81), greedy(20)
    eng = _engine(model, SpecConfig(num_steps=4), monkeypatch, verify_batch=4)
    orig = DraftAhead.launch

    def launch(self, runner, *a):
        orig(self, runner, *a)
        runner.memory.logits.normal_()
        runner.memory.verifies.n += 1

    monkeypatch.setattr(DraftAhead, "launch", launch)
    got = eng.generate(ps, params)
    assert [c.output_ids for c in got] == [c.output_ids for c in reference(model, ps, params)]
    assert eng.draft_ahead.verify_used == 0 and eng.draft_ahead.verify_dropped > 0
    assert len(eng.launched) == len(eng.verified)  # type: ignore[attr-defined]


@pytest.mark.parametrize("bs", [1, 3])
def test_a_changing_k_drops_it_and_stays_lossless(bs, monkeypatch):
    """A k schedule changing k every step, with split steps and k = 0 rounds: a verify
    queued for one k is never used by a round of another; output plain greedy's."""
    model = tiny_target("llama")
    ps = prompts(bs, seed=83 + bs)
    eng = _engine(model, SPEC, monkeypatch, verify_batch=4, policy=ForcedK(KS, split_every=3))
    got = eng.generate(ps, greedy(24))
    assert [c.output_ids for c in got] == [c.output_ids for c in reference(model, ps, greedy(24))]
    assert eng.draft_ahead.verify_dropped > 0
    assert_pages_free(eng)


def test_may_end_foresees_the_length_limits():
    """A round of k drafts commits up to k + 1 tokens: queuing the next verify is left out
    where those may reach max_new_tokens or the context limit."""
    def req(out: int, max_new: int, prompt: int = 8, total: int = 1000) -> Request:
        return Request(req_id="r", prompt_ids=[1] * prompt, params=greedy(max_new),
                       max_total_len=total, generator=None, page_ids=[], num_computed=prompt,
                       output_ids=[2] * out)

    assert not may_end([req(10, 20)], 4)  # 10 + 5 < 20
    assert may_end([req(15, 20)], 4)  # 15 + 5 reaches 20
    assert not may_end([req(14, 20)], 4)
    assert may_end([req(10, 20, prompt=8, total=23)], 4)  # 18 + 5 reaches the context limit
    assert may_end([req(0, 100), req(15, 20)], 4)  # any row


def test_the_cost_profile_times_rounds_without_verifying_ahead(monkeypatch):
    """`cost_profile.profile` prices rounds with verifying ahead off (their short runs priced
    it 25% above service on an H200) and leaves the engine's setting as it found it; the
    drafting ahead still runs."""
    from tandem.spec import cost_profile
    from tandem.spec.adaptive import FixedK

    model = tiny_target("llama")
    eng = _engine(model, SpecConfig(num_steps=4), monkeypatch, verify_batch=1,
                  policy=FixedK(4))
    seen = []
    timed = cost_profile._time_steps

    def spy(e, step, n, samples=1):
        seen.append(e.draft_ahead.verify_batch)
        return timed(e, step, n, samples)

    monkeypatch.setattr(cost_profile, "_time_steps", spy)
    cost_profile.profile(eng, repeats=3, batch_sizes=(1,))
    assert seen and set(seen) == {0}
    assert eng.draft_ahead.verify_batch == 1 and eng.draft_ahead.verify_queued == 0
    assert eng.draft_ahead.used > 0


def test_logprobs_and_page_pressure_with_verifying_ahead(monkeypatch):
    """A request asking logprobs reads them from the verify queued ahead (the shared logits
    buffer, still that verify's): plain decoding's logprobs. Few pages: rounds preempt later
    requests and spare slots are scarce; output stays plain greedy's, every page back."""
    model = tiny_target("llama")
    asking = SamplingParams(max_new_tokens=16, ignore_eos=True, logprobs=True, top_logprobs=2)
    ps = prompts(1, seed=91)
    want = reference(model, ps, [asking])[0]
    eng = _engine(model, SpecConfig(num_steps=4), monkeypatch, verify_batch=4)
    (got,) = eng.generate(ps, [asking])
    assert got.output_ids == want.output_ids and eng.draft_ahead.verify_used > 0
    for a, b in zip(got.logprobs, want.logprobs, strict=True):
        assert (a.token_id, a.top_ids) == (b.token_id, b.top_ids)
        assert a.logprob == pytest.approx(b.logprob, abs=1e-5)
    assert_pages_free(eng)

    ps, params = prompts(6, seed=7, lo=6, hi=20), greedy(14)
    eng = _engine(model, SpecConfig(num_steps=3), monkeypatch, verify_batch=8, num_pages=30)
    got = eng.generate(ps, params)
    assert [c.output_ids for c in got] == [c.output_ids for c in reference(model, ps, params)]
    assert eng.scheduler.num_preemptions > 0
    assert_pages_free(eng)


def test_by_default_any_batch_verifies_ahead(monkeypatch):
    """`TANDEM_VERIFY_AHEAD` unset: batches of any size queue their next verify (measured on an
    H200: rounds 7% / 16% shorter at 13.5 / 36 requests); set, it caps the batch (0: never).
    Six requests (padded to a bucket of 8) verify ahead and decode as plain greedy does."""
    monkeypatch.delenv("TANDEM_VERIFY_AHEAD", raising=False)
    default = verify_batch_by_env()
    assert default >= 1 << 16
    for value, want in (("4", 4), ("0", 0)):
        monkeypatch.setenv("TANDEM_VERIFY_AHEAD", value)
        assert verify_batch_by_env() == want
    model = tiny_target("llama")
    ps, params = prompts(6, seed=91), greedy(20)
    eng = _engine(model, SpecConfig(num_steps=3), monkeypatch, verify_batch=default,
                  sizes=(1, 2, 4, 8))
    got = eng.generate(ps, params)
    assert [c.output_ids for c in got] == [c.output_ids for c in reference(model, ps, params)]
    assert eng.draft_ahead.verify_used > 0
    assert_pages_free(eng)
