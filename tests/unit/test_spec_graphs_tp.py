"""The speculative graph runners under TP, on the CPU: 2 gloo ranks of a TP=2 SpecEngine whose
round runs through `SpecGraphRunner` (chain: drafting, verify, extend) and `TreeDraftGraphs`
(tree drafting) in eager mode -- the graphs' code with their static buffers, bucket padding
and device-side bookkeeping, collectives inside -- give exactly the single-rank engine's
greedy tokens in float32, and both ranks the same ones. (On the GPU the same paths run
captured; bf16 there can part only at near-ties.)"""

from __future__ import annotations

import random

import pytest
import torch
from disagg_helpers import tiny_model_and_head
from test_spec_graph_padding import _FakePlanner

from rank_helpers import run_ranks
from tandem.engine import EngineConfig, SamplingParams
from tandem.spec import SpecConfig, SpecEngine

pytestmark = pytest.mark.timeout(240)

SPECS = {"chain": SpecConfig(num_steps=3), "tree": SpecConfig(num_steps=3, topk=2,
                                                            num_draft_tokens=5)}
SIZES = (1, 2, 4)


def _engine(dirs, spec: SpecConfig, par=None, graphs: bool = True) -> SpecEngine:
    from tandem.spec.cuda_graphs import SpecGraphRunner
    from tandem.spec.tree_graphs import TreeDraftGraphs, lanes_needed

    model_dir, head_dir = dirs
    spec = SpecConfig(draft_model=str(head_dir), num_steps=spec.num_steps, topk=spec.topk,
                      num_draft_tokens=spec.num_draft_tokens)
    eng = SpecEngine.from_config(EngineConfig(model=str(model_dir), dtype="float32",
                                              num_pages=96, page_size=4), spec, par)
    if not graphs:
        return eng
    backend = eng.runner.backend
    backend.graph_decode_planner = lambda bs, pages: _FakePlanner(backend, True)
    backend.graph_prefill_planner = (lambda bs, n, pages, kv, custom_mask:
                                     _FakePlanner(backend, False, n, custom_mask))
    runner = SpecGraphRunner(eng.runner, eng.draft, spec, SIZES,
                             max_kv_len=eng.max_model_len + spec.slots_per_round,
                             capture_layers=eng.capture)
    runner.capture(eager=True)
    eng.spec_graphs = runner
    eng.set_draft_ahead(True)  # chains draft the next round ahead (spec/ahead.py)
    if spec.topk > 1:
        lanes = eng.allocator.alloc(lanes_needed(spec, eng.cfg.page_size, SIZES))
        eng.tree_graphs = TreeDraftGraphs(eng.draft, spec, SIZES,
                                          max_kv_len=eng.max_model_len + spec.slots_per_round,
                                          lane_pages=lanes)
        eng.tree_graphs.capture(eager=True)
        eng.lanes = lanes
    return eng


def _requests():
    rng = random.Random(9)
    prompts = [[rng.randrange(256) for _ in range(rng.randint(2, 14))] for _ in range(3)]
    return prompts, [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in (10, 3, 7)]


def _generate(eng: SpecEngine) -> dict:
    prompts, params = _requests()
    calls = {"verify": 0, "tree": 0}
    runner, tree = eng.spec_graphs, getattr(eng, "tree_graphs", None)
    verify = runner.verify
    runner.verify = lambda v: calls.__setitem__("verify", calls["verify"] + 1) or verify(v)
    if tree is not None:
        launch = tree.launch
        tree.launch = lambda i: calls.__setitem__("tree", calls["tree"] + 1) or launch(i)
    tokens = [c.output_ids for c in eng.generate(prompts, params)]
    if tree is not None:
        eng.allocator.free(eng.lanes)
    assert eng.allocator.num_free == eng.allocator.num_usable
    calls["ahead_used"] = eng.draft_ahead.used
    return {"tokens": tokens, "calls": calls}


def _rank(rank: int, port: int, dirs, out) -> None:
    from tandem.worker.ranks import RankInfo, join_group, leave_group

    torch.set_num_threads(1)
    par, _ = join_group(RankInfo(rank=rank, tp=2), "127.0.0.1", port, "cpu")
    out.put((rank, {name: _generate(_engine(dirs, spec, par)) for name, spec in SPECS.items()}))
    leave_group()


def test_spec_graph_runners_under_tp2_equal_one_rank(tmp_path):
    torch.set_num_threads(1)
    dirs = tiny_model_and_head(tmp_path)
    prompts, params = _requests()
    want = {name: [c.output_ids for c in _engine(dirs, spec, graphs=False).generate(
        prompts, params)] for name, spec in SPECS.items()}
    one_rank = {name: _generate(_engine(dirs, spec)) for name, spec in SPECS.items()}
    items, codes = run_ranks(_rank, 2, dirs, timeout_s=200)
    assert codes == [0, 0]
    for name in SPECS:
        assert one_rank[name]["tokens"] == want[name]
        for _, res in items:
            assert res[name]["tokens"] == want[name], name
            assert res[name]["calls"]["verify"] > 0
        assert items[0][1][name]["calls"] == items[1][1][name]["calls"]
    for _, res in items:
        assert res["tree"]["calls"]["tree"] > 0
        assert res["chain"]["calls"]["ahead_used"] > 0  # and the ranks agree (above)
