"""Plain decode graphs planned on the device (`DeviceDecodePlanner`, the default on CUDA): each
step gathers its batch's page table on the device from the metadata's page ids and copies key
counts and slots into buffers that never move; attention runs through `DEVICE_DECODE` (on the
CPU its float32 torch twin). The graph runner in eager mode (its body runs at each replay, on
the same buffers and padding): greedy float32 output equals the engine without graphs, with
batches padded into buckets, requests joining and finishing at different steps, overlap
scheduling on and off, every page back."""

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
    tiny_target,
)
from test_spec_graph_padding import _FakePlanner

from tandem.engine import LLMEngine, SamplingParams, SeqSlice, build_metadata
from tandem.engine.attention.device_decode import DeviceDecodePlan, DeviceDecodePlanner
from tandem.engine.cuda_graphs import SCRATCH_PAGE, DecodeGraphRunner, pad_decode_slices


def test_the_planner_fills_fixed_buffers_with_each_row_s_pages_lens_and_slot():
    planner = DeviceDecodePlanner(4, 3, 4, torch.device("cpu"))
    real = [SeqSlice(page_ids=[5, 9, 2], num_cached=9, num_new=1),
            SeqSlice(page_ids=[7], num_cached=0, num_new=1),
            SeqSlice(page_ids=[3, 8], num_cached=4, num_new=1)]
    meta = build_metadata(pad_decode_slices(real, 4), page_size=4).attn
    plan = planner.plan(meta)
    assert isinstance(plan, DeviceDecodePlan) and planner.latest_batch_size == 4
    table = plan.page_table.tolist()
    assert table[0] == [5, 9, 2] and table[1][0] == 7 and table[2][:2] == [3, 8]
    assert table[3][0] == SCRATCH_PAGE  # a padding row's only page
    assert plan.kv_lens.tolist() == [10, 1, 5, 1]
    assert plan.slot_ids.tolist() == [2 * 4 + 1, 7 * 4, 8 * 4, SCRATCH_PAGE * 4]
    again = planner.plan(build_metadata(pad_decode_slices(real[1:], 4), page_size=4).attn)
    for a, b in ((again.page_table, plan.page_table), (again.kv_lens, plan.kv_lens),
                 (again.slot_ids, plan.slot_ids)):
        assert a.data_ptr() == b.data_ptr()  # the same buffers: a graph replays on them
    assert again.kv_lens.tolist() == [1, 5, 1, 1]


def _engine(model, monkeypatch, device_metadata: bool, **cfg) -> LLMEngine:
    eng = LLMEngine(engine_cfg(**cfg), model)
    backend = eng.runner.backend
    monkeypatch.setattr(backend, "graph_decode_planner",
                        lambda bs, pages: _FakePlanner(backend, True), raising=False)
    eng.graphs = DecodeGraphRunner(eng.runner, (1, 2, 4),
                                   max_pages_per_seq=-(-eng.max_model_len // eng.cfg.page_size),
                                   device_metadata=device_metadata)
    eng.graphs.capture(eager=True)
    assert eng.graphs.device_metadata == device_metadata
    runs = eng.graph_runs = []
    run = eng.graphs.run
    eng.graphs.run = lambda batch: runs.append(batch.attn.num_seqs) or run(batch)
    return eng


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("bs", [1, 3])  # 3 rows run in the bucket of 4
def test_device_planned_graphs_decode_like_the_engine_without_graphs(bs, overlap,
                                                                      monkeypatch):
    model = tiny_target("llama")
    ps = prompts(bs, seed=80 + bs, hi=30)  # up to 30 tokens: several pages of 4
    params = [greedy(n) for n in (17, 5, 11)[:bs]]  # finishing at different steps
    want = [c.output_ids for c in reference(model, ps, params)]
    eng = _engine(model, monkeypatch, True, overlap_schedule=overlap)
    assert [c.output_ids for c in eng.generate(ps, params)] == want
    assert eng.graph_runs and set(eng.graph_runs) <= {1, 2, 4}
    assert_pages_free(eng)


def test_a_request_joining_mid_decode_shares_the_buckets(monkeypatch):
    model = tiny_target("llama")
    first, later = prompts(2, seed=90), prompts(2, seed=91)
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    want = [c.output_ids for c in reference(model, first + later, params)]
    eng = _engine(model, monkeypatch, True)
    ids = [eng.add_request(p, params) for p in first]
    out: dict[str, list[int]] = {}
    for step in range(200):
        if step == 4:
            ids += [eng.add_request(p, params) for p in later]
        for o in eng.step():
            out.setdefault(o.req_id, []).extend(o.new_token_ids)
        if not eng.has_unfinished():
            break
    assert [out[r] for r in ids] == [list(w) for w in want]
    assert 4 in eng.graph_runs
    assert_pages_free(eng)


# ---- prefill steps through the graphs (rows are tokens) ------------------------------------


def test_the_planner_makes_each_prompt_token_a_causal_row_of_its_sequence():
    planner = DeviceDecodePlanner(8, 3, 4, torch.device("cpu"))
    real = [SeqSlice(page_ids=[5, 9], num_cached=2, num_new=3),  # positions 2, 3, 4
            SeqSlice(page_ids=[7], num_cached=0, num_new=2),  # a new prompt
            SeqSlice(page_ids=[3, 8], num_cached=4, num_new=1)]  # a decode row beside them
    meta = build_metadata(real + pad_decode_slices([], 1), page_size=4).attn
    plan = planner.plan(meta)
    assert planner.latest_batch_size == 7
    assert plan.kv_lens.tolist() == [3, 4, 5, 1, 2, 5, 1]  # each token sees up to itself
    table = plan.page_table.tolist()
    assert [r[:2] for r in table[:3]] == [[5, 9]] * 3
    assert table[3][0] == table[4][0] == 7 and table[5][:2] == [3, 8]
    assert table[6][0] == SCRATCH_PAGE
    assert plan.slot_ids.tolist() == [22, 23, 36, 28, 29, 32, SCRATCH_PAGE * 4]
    decode = planner.plan(build_metadata(pad_decode_slices(real[2:], 2), page_size=4).attn)
    assert decode.kv_lens.data_ptr() == plan.kv_lens.data_ptr()  # the same buffers
    assert decode.kv_lens.tolist() == [5, 1]
    with pytest.raises(ValueError, match="causal"):
        masked = SeqSlice(page_ids=[7], num_cached=0, num_new=2,
                          mask=torch.tensor([[True, False], [True, True]]))
        planner.plan(build_metadata([masked], page_size=4).attn)


def _prefill_engine(model, monkeypatch, **cfg) -> LLMEngine:
    """Decode graphs of 1, 2, 4 rows and prefill graphs of 8-64 rows (eager mode)."""
    eng = LLMEngine(engine_cfg(**cfg), model)
    eng.graphs = DecodeGraphRunner(eng.runner, (1, 2, 4),
                                   max_pages_per_seq=-(-eng.max_model_len // eng.cfg.page_size),
                                   device_metadata=True, prefill_rows=(8, 16, 32, 64))
    eng.graphs.capture(eager=True)
    assert eng.graphs.batch_sizes == (1, 2, 4, 8, 16, 32, 64)
    runs = eng.graph_runs = []
    run = eng.graphs.run
    eng.graphs.run = lambda batch: runs.append(batch.attn.num_tokens) or run(batch)
    return eng


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("num", [3, 6])  # 6 prompts sample 6 rows: past 4, their step is eager
def test_prompt_steps_replay_graphs_and_decode_like_the_engine_without_graphs(num, overlap,
                                                                            monkeypatch):
    model = tiny_target("llama")
    ps = prompts(num, seed=120 + num, lo=2, hi=19)
    params = [greedy(n) for n in (9, 4, 13, 6, 11, 7)[:num]]
    want = [c.output_ids for c in reference(model, ps, params)]
    eng = _prefill_engine(model, monkeypatch, overlap_schedule=overlap)
    assert [c.output_ids for c in eng.generate(ps, params)] == want
    prefill_runs = [r for r in eng.graph_runs if r > 4]
    assert bool(prefill_runs) == (num == 3), eng.graph_runs
    assert_pages_free(eng)


def test_a_prompt_joining_decode_rows_replays_one_mixed_graph(monkeypatch):
    model = tiny_target("llama")
    first, later = prompts(2, seed=130, lo=3), prompts(1, seed=131, lo=9, hi=20)
    params = SamplingParams(max_new_tokens=10, ignore_eos=True)
    want = [c.output_ids for c in reference(model, first + later, params)]
    eng = _prefill_engine(model, monkeypatch)
    ids = [eng.add_request(p, params) for p in first]
    out: dict[str, list[int]] = {}
    for step in range(100):
        if step == 3:
            ids += [eng.add_request(p, params) for p in later]
            runs_before = len(eng.graph_runs)
        for o in eng.step():
            out.setdefault(o.req_id, []).extend(o.new_token_ids)
        if step == 3:  # the joining prompt's tokens and the two decode rows: one graph
            assert eng.graph_runs[runs_before:] == [16] or eng.graph_runs[runs_before:] == [32]
        if not eng.has_unfinished():
            break
    assert [out[r] for r in ids] == [list(w) for w in want]
    assert_pages_free(eng)


def test_prefill_graph_sizes_follow_the_switch(monkeypatch):
    from tandem.engine.cuda_graphs import prefill_graph_rows

    monkeypatch.setenv("TANDEM_PREFILL_GRAPHS", "0")
    assert prefill_graph_rows((1, 2, 4, 8, 16), 8192) == ()
    monkeypatch.setenv("TANDEM_PREFILL_GRAPHS", "1")
    assert prefill_graph_rows((1, 2, 4, 8, 16), 8192) == (32, 64, 128, 256, 512)
    assert prefill_graph_rows((1, 2, 4, 8, 16), 100) == (32, 64)


@pytest.mark.parametrize("draft_graph", [False, True])  # the draft's prefill in graphs too
@pytest.mark.parametrize("kind", ["eagle", "eagle3"])  # eagle3: features from captured layers
def test_speculative_prompt_steps_replay_graphs_and_stay_lossless(kind, draft_graph):
    """A SpecEngine's prompt steps (target forward, then the draft over the same chunk) take
    the graphs' hidden states and captured streams: greedy speculative output equals plain,
    and the draft sees what it sees after an eager prompt step (the same acceptance)."""
    from spec_helpers import tiny_head

    from tandem.spec import SpecConfig, SpecEngine
    from tandem.spec.draft_prefill import DraftPrefillGraphs

    model = tiny_target("llama")
    head = tiny_head(model, kind)
    ps = prompts(3, seed=140, lo=4, hi=19)
    params = [greedy(n) for n in (12, 7, 15)]
    want = [c.output_ids for c in reference(model, ps, params)]
    eng = SpecEngine(engine_cfg(), SpecConfig(num_steps=3), model, head)
    eng.graphs = DecodeGraphRunner(eng.runner, (1, 2, 4),
                                   max_pages_per_seq=-(-eng.max_model_len // eng.cfg.page_size),
                                   device_metadata=True, prefill_rows=(8, 16, 32, 64),
                                   capture_layers=eng.capture)
    eng.graphs.capture(eager=True)
    runs, drafts = [], []
    run_forward = eng.graphs.run_forward
    eng.graphs.run_forward = lambda batch, **kw: (runs.append(batch.attn.num_tokens)
                                                  or run_forward(batch, **kw))
    if draft_graph:
        eng.draft_prefill = DraftPrefillGraphs(eng.draft, eng.graphs, None)
        eng.draft_prefill.capture(eager=True)
        run_draft = eng.draft_prefill.run
        eng.draft_prefill.run = lambda rows, *a: drafts.append(rows) or run_draft(rows, *a)
    assert [c.output_ids for c in eng.generate(ps, params)] == want
    assert runs and all(r > 4 for r in runs), runs  # the prompt step went through a graph
    assert drafts == (runs if draft_graph else [])
    assert_pages_free(eng)
    # the draft saw the same features and tokens as after an eager prompt step: the same
    # seeds after the first step, the same acceptance after all
    eager = SpecEngine(engine_cfg(), SpecConfig(num_steps=3), model, head)
    for e in (eng, eager):
        for i, prompt in enumerate(ps):
            e.add_request(prompt, params[i], req_id=f"s{i}")
        e.step()
    assert len(eager.spec_scheduler.seeds) == len(ps)  # every prompt done in one step
    for rid, seed in eager.spec_scheduler.seeds.items():
        got = eng.spec_scheduler.seeds[rid]
        torch.testing.assert_close(got.hidden, seed.hidden, rtol=1e-4, atol=1e-5)
        assert torch.equal(got.topk_ids, seed.topk_ids)
    for e in (eng, eager):
        for i in range(len(ps)):
            e.abort(f"s{i}")
        e.step()
    eager.spec_stats = type(eager.spec_stats)()
    eng.spec_stats = type(eng.spec_stats)()
    assert [c.output_ids for c in eager.generate(ps, params)] == want
    assert [c.output_ids for c in eng.generate(ps, params)] == want
    for field in ("accepted_at", "num_rounds", "num_tokens"):
        assert getattr(eng.spec_stats, field) == getattr(eager.spec_stats, field), field
    assert sum(eng.spec_stats.accepted_at) > 0


def test_which_steps_a_graph_takes(monkeypatch):
    eng = _prefill_engine(tiny_target("llama"), monkeypatch)
    over = eng.graphs.batch_sizes[-1] + 1  # no graph
    rows_for = eng.graphs.rows_for
    assert rows_for([(1, 900)] * 3, 3, False) == 3  # decode rows: however long their context
    assert rows_for([(20, 0), (1, 50)], 2, False) == 21  # a prompt beside a decode row
    assert rows_for([(20, 0)], 1, True) == over  # prompts under DP attention: eager
    assert rows_for([(30, 9000)], 1, False) == over  # prompt rows over a long cached prefix
    assert rows_for([(1, 1)] * 5, 5, False) == over  # more sampled rows than logits
    assert rows_for([(70, 0)], 1, False) == 70  # past every graph: padded_batch_size says so


@pytest.mark.parametrize("graphs", [False, True])  # True: target and draft prefill in graphs
def test_every_prompt_of_a_step_seeds_as_if_it_were_alone(graphs):
    """Prompts completing in one step each get the seed (draft hidden, first guesses) their
    prompt gets alone: no row of the batched draft prefill or of the batched topk is mixed up."""
    from spec_helpers import tiny_head

    from tandem.spec import SpecConfig, SpecEngine
    from tandem.spec.draft_prefill import DraftPrefillGraphs

    model = tiny_target("llama")
    head = tiny_head(model, "eagle")
    ps = prompts(3, seed=150, lo=5, hi=17)

    def seeds(batch: list[list[int]]) -> dict:
        eng = SpecEngine(engine_cfg(), SpecConfig(num_steps=3, topk=2, num_draft_tokens=4),
                         model, head)
        if graphs:
            eng.graphs = DecodeGraphRunner(
                eng.runner, (1, 2, 4), max_pages_per_seq=-(-eng.max_model_len // 4),
                device_metadata=True, prefill_rows=(8, 16, 32, 64), capture_layers=eng.capture)
            eng.graphs.capture(eager=True)
            eng.draft_prefill = DraftPrefillGraphs(eng.draft, eng.graphs, None)
            eng.draft_prefill.capture(eager=True)
        for p in batch:
            eng.add_request(p, greedy(5), req_id=f"r{ps.index(p)}")
        eng.step()
        return dict(eng.spec_scheduler.seeds)

    together = seeds(ps)
    assert len(together) == 3
    for p in ps:
        (rid, alone), = seeds([p]).items()
        torch.testing.assert_close(together[rid].hidden, alone.hidden, rtol=1e-4, atol=1e-5)
        assert torch.equal(together[rid].topk_ids, alone.topk_ids)
        torch.testing.assert_close(together[rid].topk_logp, alone.topk_logp)
