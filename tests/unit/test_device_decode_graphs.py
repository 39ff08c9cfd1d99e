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
