"""`SpecScheduler` on its own (no model): a round's page reservation in admission order with
preemption of the latest requests, never of one already served; page conservation; the seeds
it keeps (dropped on preemption and near the context end, replaced on commit)."""

from __future__ import annotations

import torch

from tandem.engine import PageAllocator, SamplingParams
from tandem.engine.request import Request
from tandem.engine.scheduler import Scheduler
from tandem.spec import DraftSeed, SpecConfig, SpecScheduler

PAGE = 4
SPEC = SpecConfig(num_steps=3)  # a chain: a round writes 4 slots past num_cached


def _seed(num_cached: int, last: int = 5) -> DraftSeed:
    return DraftSeed(num_cached=num_cached, last_token=last,
                     topk_ids=torch.tensor([last + 1]), topk_logp=torch.tensor([-0.5]),
                     hidden=torch.full((8,), float(num_cached)))


def _setup(num_pages: int, num_reqs: int, prompt_len: int = 7, max_model_len: int = 64):
    """`num_reqs` running requests, each with its prompt and first token committed (prompt in
    the KV, the token not yet) and a seed; pages for exactly those tokens."""
    alloc = PageAllocator(num_pages)
    sched = Scheduler(alloc, PAGE, max_num_seqs=8, max_num_batched_tokens=64)
    spec_sched = SpecScheduler(sched, SPEC, max_model_len)
    reqs = []
    for i in range(num_reqs):
        req = Request(req_id=f"r{i}", prompt_ids=list(range(1, prompt_len + 1)),
                      params=SamplingParams(max_new_tokens=20), max_total_len=max_model_len,
                      output_ids=[5], num_computed=prompt_len,
                      page_ids=alloc.alloc(sched.pages_needed(prompt_len + 1)))
        sched.add_running(req)
        spec_sched.set_seed(req.req_id, _seed(prompt_len))
        reqs.append(req)
    return alloc, sched, spec_sched, reqs


def _assert_pages_conserved(alloc: PageAllocator, sched: Scheduler) -> None:
    held = [p for r in sched.requests.values() for p in r.page_ids]
    assert len(held) == len(set(held)), "a page is held twice"
    assert alloc.num_free + len(held) == alloc.num_usable, "pages leaked"


def test_reserve_covers_the_round_and_preempts_only_later_requests():
    # 3 requests hold 2 pages each (8 tokens); a round needs 7 + 4 = 11 slots: 3 pages each.
    # 7 usable pages: r0 takes the free one, r1 gets r2's (preempted), r2 runs no round.
    alloc, sched, spec_sched, (r0, r1, r2) = _setup(num_pages=8, num_reqs=3)
    served = spec_sched.reserve(exclude=frozenset())
    assert served == [r0, r1]
    for r in served:
        assert len(r.page_ids) * PAGE >= r.num_computed + SPEC.slots_per_round
    assert r2 in sched.waiting and not r2.page_ids and r2.num_computed == 0
    assert set(spec_sched.seeds) == {"r0", "r1"}  # the preempted request's KV (and seed) went
    assert sched.num_preemptions == 1
    _assert_pages_conserved(alloc, sched)
    inp = spec_sched.round_input(served)
    assert inp.req_ids == ("r0", "r1")
    assert inp.draft.page_ids == (tuple(r0.page_ids), tuple(r1.page_ids))
    assert inp.draft.num_cached == (7, 7) and inp.draft.last_token_ids == (5, 5)


def test_a_request_without_pages_for_its_round_is_preempted_itself():
    # 5 usable pages, 2 held by each of 2 requests: r0 takes the free page; for r1 only r0
    # (already served, never preempted) is left, so r1 gives its own pages back and waits.
    alloc, sched, spec_sched, (r0, r1) = _setup(num_pages=6, num_reqs=2)
    assert spec_sched.reserve(exclude=frozenset()) == [r0]
    assert r1 in sched.waiting and not r1.page_ids and set(spec_sched.seeds) == {"r0"}
    _assert_pages_conserved(alloc, sched)


def test_reserve_skips_excluded_and_seedless_requests():
    alloc, sched, spec_sched, (r0, r1, r2) = _setup(num_pages=32, num_reqs=3)
    spec_sched.drop_seed("r2")  # e.g. near the context end: plain decode steps instead
    pages_before = list(r1.page_ids), list(r2.page_ids)
    assert spec_sched.reserve(exclude=frozenset({"r1"})) == [r0]
    assert (list(r1.page_ids), list(r2.page_ids)) == pages_before
    _assert_pages_conserved(alloc, sched)


def test_reserve_never_preempts_an_excluded_request():
    # r2's prompt completed in this step: its first token is sampled, committed after the
    # round (spec/prompt_side.py), so it must keep its pages. 7 usable pages: r0 takes the
    # free one; for r1 the latest request is r2 -- excluded, so r1 gives its own back.
    alloc, sched, spec_sched, (r0, r1, r2) = _setup(num_pages=8, num_reqs=3)
    spec_sched.drop_seed("r2")  # (a prompt completing in this step has no seed yet)
    r2_pages = list(r2.page_ids)
    assert spec_sched.reserve(exclude=frozenset({"r2"})) == [r0]
    assert r1 in sched.waiting and not r1.page_ids
    assert r2 in sched.running and r2.page_ids == r2_pages
    _assert_pages_conserved(alloc, sched)


def test_drop_unrunnable_near_the_context_end_and_after_preemption():
    # A round writes rope positions up to num_cached + num_steps, which must stay < 20.
    _, sched, spec_sched, (r0, r1, r2) = _setup(num_pages=8, num_reqs=3, max_model_len=20)
    spec_sched.set_seed("r0", _seed(16))  # 16 + 3 = 19: the last position a round may use
    spec_sched.set_seed("r1", _seed(17))  # 17 + 3 = 20: past the context
    ok, preempted = sched.reserve(r0, 15, {"r0"})  # plain scheduling takes r2's pages
    assert ok and preempted == ["r2"]
    spec_sched.drop_unrunnable()
    assert set(spec_sched.seeds) == {"r0"}


def test_commit_round_advances_the_kv_or_drops_a_finished_request():
    _, _, spec_sched, (r0, r1) = _setup(num_pages=32, num_reqs=2)
    nxt = _seed(10, last=9)
    spec_sched.commit_round(r0, nxt)
    assert r0.num_computed == 10 and spec_sched.seeds["r0"] is nxt
    spec_sched.commit_round(r1, None)
    assert "r1" not in spec_sched.seeds
