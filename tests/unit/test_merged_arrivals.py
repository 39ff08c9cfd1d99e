"""Prompts merged with the round's verify (`SpecEngine.merge_arrivals`, TANDEM_MERGED_ARRIVALS=1):
a step with prompts and a round runs one target forward over both -- the round's chains as
chunks of root + drafts at num_cached after the prompts' rows. Outputs stay plain greedy
decoding's (float32, token for token), through arrivals, chunked prompts, requests ending,
preemption and drafting ahead; the merged steps really ran one target forward."""

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
from test_spec_graph_padding import _attach_graphs

from tandem.engine import SamplingParams
from tandem.engine.cuda_graphs import DecodeGraphRunner
from tandem.spec import SpecConfig, SpecEngine
from tandem.spec.draft_prefill import DraftPrefillGraphs


def _merged(model, spec, kind="eagle", graphs=False, monkeypatch=None, target_graphs=False,
            **cfg) -> SpecEngine:
    eng = SpecEngine(engine_cfg(**cfg), spec, model, tiny_head(model, kind))
    if target_graphs:  # the prompt graphs (eager mode) and the draft prefill's, as on a GPU
        eng.graphs = DecodeGraphRunner(
            eng.runner, (1, 2, 4), max_pages_per_seq=-(-eng.max_model_len // eng.cfg.page_size),
            device_metadata=True, prefill_rows=(8, 16, 32, 64), capture_layers=eng.capture)
        eng.graphs.capture(eager=True)
        eng.draft_prefill = DraftPrefillGraphs(eng.draft, eng.graphs, None)
        eng.draft_prefill.capture(eager=True)
    if graphs:
        _attach_graphs(eng, monkeypatch, device_metadata=True)
        eng.set_draft_ahead(True)
    eng.merge_arrivals = True
    calls = {"merged": 0, "verify": 0}
    for name, key in (("_merged_prefill_step", "merged"), ("_verify_forward", "verify")):
        real = getattr(eng, name)
        setattr(eng, name, lambda *a, _r=real, _k=key, **kw:
                calls.__setitem__(_k, calls[_k] + 1) or _r(*a, **kw))
    eng.calls = calls  # type: ignore[attr-defined]
    return eng


def _staggered(eng: SpecEngine, ps, params, every: int = 2,
               logprobs: dict | None = None) -> dict[str, list[int]]:
    """The prompts arriving one every `every` steps, so most arrive next to a round (and
    each request's returned logprobs into `logprobs`)."""
    tokens: dict[str, list[int]] = {}
    ids, pending, steps = [], list(zip(ps, params)), 0
    while pending or eng.has_unfinished():
        if pending and steps % every == 0:
            p, q = pending.pop(0)
            ids.append(eng.add_request(p, q))
        for out in eng.step():
            tokens.setdefault(out.req_id, []).extend(out.new_token_ids)
            if logprobs is not None:
                logprobs.setdefault(out.req_id, []).extend(out.logprobs)
        steps += 1
    return {i: tokens[i] for i in ids}


@pytest.mark.parametrize("kind", ["eagle", "eagle-2layer", "eagle3"])
@pytest.mark.parametrize("graphs", ["eager", "graph-runner", "all-graphs"])
def test_merged_arrivals_keep_plain_greedy_output(kind, graphs, monkeypatch):
    """all-graphs: the merged forward through the prompt graphs (the draft prefill's graph
    then writes draft KV on the chains' rows too, which the extend graph rewrites)."""
    model = tiny_target("llama")
    ps = prompts(5, seed=31, lo=3, hi=30)
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in (20, 9, 25, 14, 18)]
    want = [c.output_ids for c in reference(model, ps, params)]
    eng = _merged(model, SpecConfig(num_steps=3), kind, graphs != "eager", monkeypatch,
                  target_graphs=graphs == "all-graphs",
                  max_num_batched_tokens=16)  # long prompts arrive in chunks
    replays, eager = [], []  # graph replays of prompt steps; eager forwards in merged ones
    if eng.graphs is not None:
        run_forward, forward = eng.graphs.run_forward, eng.runner.forward
        merged = eng._merged_prefill_step
        eng.graphs.run_forward = lambda batch, **kw: (replays.append(batch.attn.num_tokens)
                                                      or run_forward(batch, **kw))

        def merging(plan, verify):
            eng.runner.forward = lambda batch: eager.append(1) or forward(batch)
            try:
                return merged(plan, verify)
            finally:
                eng.runner.forward = forward

        eng._merged_prefill_step = merging
    got = _staggered(eng, ps, params)
    assert [tuple(t) for t in got.values()] == [tuple(w) for w in want]
    # arrivals next to a round took the merged forward (with graphs, not where the round's
    # verify was queued ahead by the round before: spec/ahead.py)
    assert eng.calls["merged"] >= (1 if graphs != "eager" else 3)
    if eng.graphs is not None:  # every prompt step replayed a graph, merged ones included
        assert len(replays) >= eng.calls["merged"] and not eager  # merged: a graph replay
    assert_pages_free(eng)


def test_merged_arrivals_under_preemption_and_at_k_zero(monkeypatch):
    """Few pages: rounds preempt later requests (which arrive again, merged or not); and a
    plain (k = 0) round merges too (its chain is the root alone)."""
    from test_spec_adaptive import ForcedK

    model = tiny_target("llama")
    ps = prompts(6, seed=7, lo=6, hi=20)
    params = greedy(14)
    want = [c.output_ids for c in reference(model, ps, params)]
    eng = SpecEngine(engine_cfg(num_pages=30), SpecConfig(num_steps=3), model,
                     tiny_head(model, "eagle"), policy=ForcedK((3, 0, 2)))
    eng.merge_arrivals = True
    got = _staggered(eng, ps, [params] * 6, every=1)
    assert [tuple(t) for t in got.values()] == [tuple(w) for w in want]
    assert eng.scheduler.num_preemptions > 0
    assert_pages_free(eng)


def test_sampled_requests_merge_too(monkeypatch):
    """Seeded sampled requests: the merged engine's tokens are the unmerged one's (the same
    logits, the same draws)."""
    model = tiny_target("llama")
    ps = prompts(4, seed=41, lo=3, hi=20)
    params = [SamplingParams(max_new_tokens=16, ignore_eos=True, temperature=1.0, top_k=4,
                             seed=i) for i in range(4)]
    plain = SpecEngine(engine_cfg(), SpecConfig(num_steps=3), model, tiny_head(model, "eagle"))
    want = _staggered(plain, ps, params)
    eng = _merged(model, SpecConfig(num_steps=3))
    got = _staggered(eng, ps, params)
    assert list(got.values()) == list(want.values())
    assert eng.calls["merged"] > 0


def test_a_merged_forward_lays_out_prompt_rows_then_each_chain(monkeypatch):
    """The merged forward's metadata: the prompt chunks' rows first, at their positions;
    then per round request its chain -- N rows at num_cached .. num_cached + N - 1, written
    at those slots of its own pages, attending to num_cached + N keys, causal -- as the
    verify forward it replaces lays them out; the input ids of those rows are the chain's."""
    model = tiny_target("llama")
    eng = _merged(model, SpecConfig(num_steps=3))
    page = eng.cfg.page_size
    seen = []
    merged, forward = eng._merged_prefill_step, eng.runner.forward

    def merging(plan, verify):
        seen.append([plan, verify, None])
        return merged(plan, verify)

    def forwarding(batch):
        if seen and seen[-1][2] is None:
            seen[-1][2] = batch
        return forward(batch)

    monkeypatch.setattr(eng, "_merged_prefill_step", merging)
    monkeypatch.setattr(eng.runner, "forward", forwarding)
    _staggered(eng, prompts(4, seed=5, lo=3, hi=12), [greedy(10)] * 4)
    assert seen
    for plan, verify, batch in seen:
        attn, pos = batch.attn, batch.positions.tolist()
        qo, kv = attn.qo_indptr_cpu.tolist(), attn.kv_lens_cpu.tolist()
        slots, ids = attn.slot_ids.tolist(), batch.input_ids.tolist()
        for s, c in enumerate(plan.chunks):
            assert pos[qo[s] : qo[s + 1]] == list(range(c.num_cached, c.num_cached + len(
                c.token_ids)))
        n, first = verify.num_nodes, len(plan.chunks)
        for r, (pages, nc) in enumerate(zip(verify.page_ids, verify.num_cached)):
            s = first + r
            rows = range(qo[s], qo[s + 1])
            assert len(rows) == n and kv[s] == nc + n
            assert [pos[q] for q in rows] == list(range(nc, nc + n))
            assert [slots[q] for q in rows] == [pages[p // page] * page + p % page
                                                for p in range(nc, nc + n)]
            assert [ids[q] for q in rows] == verify.tokens[r].tolist()
        assert attn.custom_mask is None  # causal: each chain's rows see their own prefix


def test_a_prompt_in_chunks_merges_with_the_rounds_instead_of_verifying_ahead(monkeypatch):
    """Drafting ahead queues the next verify too (small batches); a queued verify keeps the
    prompts' forward apart. While a prompt waits or is part-done, the round queues only the
    drafting, so each later chunk of a long prompt rides with the round's verify."""
    model = tiny_target("llama")
    ps = prompts(2, seed=61, lo=4, hi=8) + prompts(1, seed=62, lo=60, hi=60)
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in (30, 30, 8)]
    want = [c.output_ids for c in reference(model, ps, params)]
    eng = _merged(model, SpecConfig(num_steps=3), "eagle", True, monkeypatch,
                  max_num_batched_tokens=12)  # the long prompt: 5 chunks, 4 of them later
    assert eng.draft_ahead.verify_batch >= 2
    ids = [eng.add_request(p, q) for p, q in zip(ps[:2], params[:2])]
    while len(eng.seeds) < 2:
        eng.step()
    for _ in range(2):  # rounds drafting and verifying ahead
        eng.step()
    assert eng.draft_ahead.verify_used > 0
    merged_before = eng.calls["merged"]
    ids.append(eng.add_request(ps[2], params[2]))
    tokens: dict[str, list[int]] = {}
    while eng.has_unfinished():
        for out in eng.step():
            tokens.setdefault(out.req_id, []).extend(out.new_token_ids)
    assert eng.calls["merged"] - merged_before >= 4  # every chunk after the first
    assert tokens[ids[2]] == list(want[2])
    assert_pages_free(eng)


def test_logprobs_of_merged_steps_equal_the_unmerged_engine(monkeypatch):
    """Requests asking for logprobs (greedy and seeded sampled): the merged engine returns
    the unmerged one's tokens and, within float32 rounding, their logprobs (the chains'
    logits come from the LM head over the merged forward's rows)."""
    model = tiny_target("llama")
    ps = prompts(4, seed=71, lo=3, hi=20)
    params = [SamplingParams(max_new_tokens=12, ignore_eos=True, logprobs=True, top_logprobs=3,
                             **kw) for kw in ({}, {"temperature": 1.0, "top_k": 4, "seed": 5},
                                              {}, {"temperature": 0.8, "seed": 6})]
    runs = []
    for merge in (False, True):
        eng = SpecEngine(engine_cfg(), SpecConfig(num_steps=3), model, tiny_head(model, "eagle"))
        eng.merge_arrivals = merge
        seen = []
        real = eng._merged_prefill_step
        monkeypatch.setattr(eng, "_merged_prefill_step",
                            lambda *a, _r=real, _s=seen: _s.append(1) or _r(*a))
        logprobs: dict[str, list] = {}
        tokens = _staggered(eng, ps, params, logprobs=logprobs)
        assert bool(seen) == merge
        runs.append((tokens, logprobs))
    (t0, lp0), (t1, lp1) = runs
    assert list(t0.values()) == list(t1.values())
    for a_rows, b_rows in zip(lp0.values(), lp1.values()):
        assert len(a_rows) == len(b_rows) == 12
        for a, b in zip(a_rows, b_rows):
            assert a.token_id == b.token_id
            assert a.logprob == pytest.approx(b.logprob, abs=1e-5)
            assert a.top_logprobs == pytest.approx(b.top_logprobs, abs=1e-5)
