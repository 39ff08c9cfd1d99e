"""Tree drafting in CUDA graphs (spec/tree_graphs.py), on the CPU with the runner in eager
mode (the graph's body runs at each propose, with its buffers, lanes and bucket padding):

- it proposes the tree the eager host-side drafting proposes (tokens, parents, depths), for
  trees of several shapes, bucket padding and draft heads of 1 and 2 layers;
- it never writes a request's own pages (only lane pages);
- a speculative engine drafting its trees through it stays lossless (== plain greedy);
- the lane arithmetic covers every position a beam writes or reads."""

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
from test_spec_graph_padding import _attach_graphs, _running_input

from tandem.spec import SpecConfig, SpecEngine, propose
from tandem.spec.draft_runner import DRAFT_GROUP
from tandem.spec.tree_graphs import (
    TREE_MAX_BATCH,
    TreeDraftGraphs,
    lane_pages_per_beam,
    lanes_needed,
    tree_buckets,
)

TREES = {"3x2n5": SpecConfig(num_steps=3, topk=2, num_draft_tokens=5),
         "4x3n9": SpecConfig(num_steps=4, topk=3, num_draft_tokens=9),
         "5x2full": SpecConfig(num_steps=5, topk=2)}
SIZES = (1, 2, 4)


def _tree_graphs(eng: SpecEngine, sizes=SIZES) -> tuple[TreeDraftGraphs, list[int]]:
    lanes = eng.allocator.alloc(lanes_needed(eng.spec, eng.cfg.page_size, sizes))
    graphs = TreeDraftGraphs(eng.draft, eng.spec, sizes,
                             max_kv_len=eng.max_model_len + eng.spec.slots_per_round,
                             lane_pages=lanes)
    graphs.capture(eager=True)
    return graphs, lanes


def _kv_of(eng: SpecEngine, pages) -> list[torch.Tensor]:
    idx = torch.tensor(sorted(set(pages)))
    return [eng.kv_pool.layer(g, i)[idx].clone() for g, n in
            ((DRAFT_GROUP, eng.head.cfg.num_layers), ("target", eng.model_cfg.num_layers))
            for i in range(n)]


@pytest.mark.parametrize("kind", ["eagle", "eagle-2layer"])
@pytest.mark.parametrize("name", list(TREES))
@pytest.mark.parametrize("bs", [1, 3])  # 3 runs in the bucket of 4 (one padding row)
def test_graph_tree_equals_eager_tree_and_writes_no_request_page(name, bs, kind):
    model = tiny_target("llama", live=None)
    spec = TREES[name]
    eng = SpecEngine(engine_cfg(), spec, model, tiny_head(model, kind, live=None))
    graphs, lanes = _tree_graphs(eng)
    inp = _running_input(eng, bs)
    request_pages = [p for ps in inp.page_ids for p in ps]
    assert not set(request_pages) & set(lanes)
    want = propose(eng.draft, inp, spec)  # eager: writes scratch slots of the request pages
    before = _kv_of(eng, request_pages)
    saved = [t.clone() for t in (inp.last_tokens, inp.topk_ids, inp.topk_logp, inp.hidden)]
    got = graphs.propose(inp)
    assert torch.equal(got.tokens, want.tokens)
    assert got.parents == want.parents and got.depths == want.depths
    for a, b in zip(before, _kv_of(eng, request_pages)):
        assert torch.equal(a, b), "tree graph drafting wrote a request's page"
    for a, b in zip(saved, (inp.last_tokens, inp.topk_ids, inp.topk_logp, inp.hidden)):
        assert torch.equal(a, b)  # inputs only read
    kept = got.tokens.clone()
    graphs.propose(inp)  # the next replay leaves the returned tensors alone
    assert torch.equal(got.tokens, kept)


@pytest.mark.parametrize("name", ["3x2n5", "4x3n9"])
@pytest.mark.parametrize("bs", [1, 3])
def test_spec_engine_drafting_trees_in_graphs_equals_plain_greedy(name, bs, monkeypatch):
    model = tiny_target("llama")
    spec = TREES[name]
    ps = prompts(bs, seed=60 + bs)
    params = greedy(14)
    want = [c.output_ids for c in reference(model, ps, params)]
    eng = SpecEngine(engine_cfg(), spec, model, tiny_head(model, "eagle"))
    _attach_graphs(eng, monkeypatch, sizes=SIZES)  # verify and extend through their runner
    graphs, lanes = _tree_graphs(eng)
    eng.tree_graphs = graphs
    calls = []
    orig = graphs.launch  # the round verifies the drafted tree before reading its shape
    monkeypatch.setattr(graphs, "launch", lambda inp: calls.append(1) or orig(inp))
    got = [c.output_ids for c in eng.generate(ps, params)]
    assert got == want
    assert calls and eng.spec_stats.num_tokens > eng.spec_stats.num_rounds
    eng.allocator.free(lanes)
    assert_pages_free(eng)


@pytest.mark.parametrize("page_size", [1, 2, 4, 16])
@pytest.mark.parametrize("steps", [2, 3, 5, 8, 17, 20])
def test_lanes_cover_every_position_a_beam_touches(page_size, steps):
    spec = SpecConfig(num_steps=steps, topk=2)
    lane_len = lane_pages_per_beam(spec, page_size)
    for nc in range(3 * page_size + 1):
        f = nc // page_size
        last = nc + steps - 2  # the last step's write (and the furthest key read)
        assert 0 <= last // page_size - f < lane_len, (nc, steps, page_size)
    # Tight: some num_cached needs every lane page.
    assert any((nc + steps - 2) // page_size - nc // page_size == lane_len - 1
               for nc in range(page_size))


def test_buckets_lanes_and_refusals():
    spec = SpecConfig(num_steps=4, topk=2)
    assert tree_buckets((1, 2, 4, 8, 16, 24, 32)) == (1, 2, 4, 8, 16)
    assert tree_buckets((32, 64)) == (32,)
    lane_len = lane_pages_per_beam(spec, 16)
    assert lanes_needed(spec, 16, (1, 2, 16, 32)) == 2 * TREE_MAX_BATCH * 2 * lane_len
    assert lanes_needed(spec, 16, (1, 2, 4)) == 2 * 4 * 2 * lane_len
    assert lanes_needed(SpecConfig(num_steps=4), 16, (1, 2)) == 0  # chains need none
    model = tiny_target("llama", live=None)
    eng = SpecEngine(engine_cfg(), spec, model, tiny_head(model, "eagle", live=None))
    with pytest.raises(ValueError, match="lane_pages"):
        TreeDraftGraphs(eng.draft, spec, (1, 2), max_kv_len=64, lane_pages=[1, 2, 3])
    with pytest.raises(ValueError, match="topk >= 2"):
        TreeDraftGraphs(eng.draft, SpecConfig(num_steps=4), (1,), max_kv_len=64, lane_pages=[])
    graphs, lanes = _tree_graphs(eng, sizes=(1, 2))
    inp = _running_input(eng, 3)  # beyond the largest bucket: no graph
    assert not graphs.can_propose(inp)
    with pytest.raises(ValueError, match="no tree drafting graph"):
        graphs.propose(inp)


@pytest.mark.parametrize("rows", [2, 4])  # 4: two padding requests
def test_device_tree_layout_equals_the_host_tree_layout(rows):
    from tandem.spec.phases import VerifyInput
    from tandem.spec.slices import device_tree_layout, verify_layout

    parents = ((-1, 0, 0, 1, 2, 3), (-1, 0, 1, 1, 0, 4))
    depths = tuple(_depths(ps) for ps in parents)
    page_ids, num_cached = ((3, 4, 5), (7, 8)), (5, 2)
    tokens = torch.arange(12).view(2, 6)
    host = verify_layout(VerifyInput(page_ids=page_ids, num_cached=num_cached, tokens=tokens,
                                     parents=parents, depths=depths), 4, "cpu", masked=True,
                         rows=rows, device_mask=True)
    dev = device_tree_layout(page_ids, num_cached, torch.tensor(parents), torch.tensor(depths),
                             4, "cpu", rows=rows)
    assert torch.equal(dev.positions, host.positions)
    assert torch.equal(dev.attn.custom_mask, host.attn.custom_mask)
    for f in ("slot_ids", "qo_indptr", "kv_page_indptr", "kv_page_ids", "kv_lens"):
        assert torch.equal(getattr(dev.attn, f), getattr(host.attn, f)), f


def _depths(parents) -> tuple[int, ...]:
    out: list[int] = []
    for p in parents:
        out.append(0 if p < 0 else out[p] + 1)
    return tuple(out)
