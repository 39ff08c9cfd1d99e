"""Drafting ahead (spec/ahead.py): a greedy round in graphs queues the next round's drafting
before its host read, from device values alone. The next round uses it only if it drafted
exactly that round; either way outputs are plain greedy decoding's, and the drafts verified are
those drafting in the step gives. CPU: the graph runner in eager mode (test_spec_graph_padding),
so every replay runs its body with the same buffers."""

from __future__ import annotations

import pytest
import torch
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
from test_spec_graph_padding import _attach_graphs

from tandem.engine import SamplingParams
from tandem.spec import SpecConfig, SpecEngine

EOS = 17  # a live token of tiny_target: the target emits it


def _engine(model, spec, monkeypatch, ahead: bool, kind: str = "eagle", **cfg) -> SpecEngine:
    eng = SpecEngine(engine_cfg(**cfg), spec, model, tiny_head(model, kind))
    _attach_graphs(eng, monkeypatch)
    eng.set_draft_ahead(ahead)
    assert eng.draft_ahead.enabled == ahead
    verified = []  # per round: (num_cached, tokens) the verify forward got
    orig = eng._verify_forward

    def spy(v):
        verified.append((v.num_cached, v.tokens.clone()))
        return orig(v)

    monkeypatch.setattr(eng, "_verify_forward", spy)
    eng.verified = verified  # type: ignore[attr-defined]
    return eng


def _same_rounds(a: SpecEngine, b: SpecEngine) -> None:
    va, vb = a.verified, b.verified  # type: ignore[attr-defined]
    assert len(va) == len(vb)
    for (nca, ta), (ncb, tb) in zip(va, vb):
        assert nca == ncb and torch.equal(ta, tb)


@pytest.mark.parametrize("kind", ["eagle", "eagle-2layer"])
@pytest.mark.parametrize("steps", [4, 2])
@pytest.mark.parametrize("bs", [1, 3])  # 3 runs padded in the bucket of 4
def test_drafting_ahead_verifies_the_drafts_of_the_step(bs, steps, kind, monkeypatch):
    """Every round after the first takes the drafting queued by the round before (nothing
    changes between them), verifies the very tokens drafting in the step gives, and the
    output is plain greedy decoding's."""
    model = tiny_target("llama")
    spec = SpecConfig(num_steps=steps)
    ps, params = prompts(bs, seed=50 + bs), greedy(24)
    want = [c.output_ids for c in reference(model, ps, params)]
    on = _engine(model, spec, monkeypatch, True, kind)
    off = _engine(model, spec, monkeypatch, False, kind)
    assert [c.output_ids for c in on.generate(ps, params)] == want
    assert [c.output_ids for c in off.generate(ps, params)] == want
    _same_rounds(on, off)
    assert on.spec_stats.num_tokens == off.spec_stats.num_tokens  # the same acceptance
    assert on.spec_stats.num_tokens > on.spec_stats.num_rounds  # some drafts accepted
    assert off.draft_ahead.used == 0
    # Rounds draft in their step only the first time and after a request finished.
    assert on.draft_ahead.dropped <= bs - 1
    assert on.draft_ahead.used >= len(on.verified) - bs  # type: ignore[attr-defined]
    assert_pages_free(on)


def test_a_changed_batch_drops_what_was_drafted_ahead(monkeypatch):
    """Requests finishing at different rounds (max_new_tokens, and an EOS inside accepted
    runs), one aborted between steps and one joining late: each change drops the queued
    drafting and the round drafts in its step. The rounds verify what they verify with drafting
    ahead off, and every request that ran to its end got plain greedy decoding's output."""
    model = tiny_target("llama", eos_token_id=EOS)
    ps = prompts(5, seed=12)
    params = [SamplingParams(max_new_tokens=n) for n in (6, 30, 17, 30, 25)]
    ref = reference(model, ps, params)
    runs = {}
    for ahead in (True, False):
        eng = _engine(model, SpecConfig(num_steps=4), monkeypatch, ahead)
        changing_batch(eng, ps, params, ref)
        runs[ahead] = eng
    on, off = runs[True], runs[False]
    assert any(EOS in c.output_ids and len(c.output_ids) < p.max_new_tokens
               for c, p in zip(ref, params))  # an EOS ended a request early
    _same_rounds(on, off)
    assert on.draft_ahead.used > 0 and on.draft_ahead.dropped >= 3


def changing_batch(eng: SpecEngine, ps, params, ref) -> None:
    """Four of five requests at once, the fourth aborted after step 6, the fifth joining
    after step 8: each that ran to its end gets its `ref` output; every page comes back."""
    ids = [eng.add_request(p, q) for p, q in zip(ps[:4], params[:4])]
    tokens: dict[str, list[int]] = {}
    steps = 0
    while eng.scheduler.has_work():
        for out in eng.step():
            tokens.setdefault(out.req_id, []).extend(out.new_token_ids)
        steps += 1
        if steps == 6:
            assert eng.abort(ids[3])
        if steps == 8:
            ids.append(eng.add_request(ps[4], params[4]))
    for i in (0, 1, 2, 4):
        assert tuple(tokens[ids[i]]) == tuple(ref[i].output_ids), i
    assert_pages_free(eng)


def test_preemption_under_page_pressure_with_drafting_ahead(monkeypatch):
    """Few pages: rounds preempt later requests (which lose their seeds and are prefilled
    again) and spare slots are not taken while requests wait; output stays plain greedy."""
    model = tiny_target("llama")
    ps = prompts(6, seed=7, lo=6, hi=20)
    params = greedy(14)
    ref = reference(model, ps, params)
    eng = _engine(model, SpecConfig(num_steps=3), monkeypatch, True, num_pages=30)
    got = eng.generate(ps, params)
    assert [c.output_ids for c in got] == [c.output_ids for c in ref]
    assert eng.scheduler.num_preemptions > 0  # the pressure was real
    assert eng.draft_ahead.used > 0
    assert_pages_free(eng)


def test_spare_slots_cost_nobody():
    """`reserve_spare` takes free pages only: not while a request waits, never below an
    eighth of the pool, and never by preempting."""
    from tandem.engine.kv_cache import PageAllocator
    from tandem.engine.request import Request
    from tandem.engine.scheduler import Scheduler

    alloc = PageAllocator(17)  # 16 usable, 2 must stay free
    sched = Scheduler(alloc, page_size=4, max_num_seqs=4, max_num_batched_tokens=64)
    req = Request(req_id="a", prompt_ids=[1] * 8, params=greedy(8), max_total_len=64,
                  generator=None, page_ids=alloc.alloc(2), num_computed=8)
    sched.add_running(req)
    assert sched.reserve_spare(req, 8 * 4)  # 6 more pages: 8 free left
    assert len(req.page_ids) == 8
    assert not sched.reserve_spare(req, 15 * 4)  # 7 more would leave 1 < 2
    assert len(req.page_ids) == 8
    assert sched.reserve_spare(req, 14 * 4)  # leaves exactly 2
    waiting = Request(req_id="b", prompt_ids=[1] * 4, params=greedy(4), max_total_len=16,
                      generator=None, page_ids=[], num_computed=0)
    sched.add(waiting)
    alloc.free(req.page_ids[10:])
    del req.page_ids[10:]
    assert not sched.reserve_spare(req, 11 * 4)  # a request waits
    assert sched.reserve_spare(req, 10 * 4)  # nothing to take: covered already
