"""The CPU-checkable parts of the speculative CUDA graphs (tandem/spec/cuda_graphs.py): the
per-step slices, bucket padding on the scratch page, and the graph runner's buffers, step
index and planning run in eager mode (every "replay" runs the captured body) against the
eager round. tests/gpu/test_spec_graphs.py replays the real graphs."""

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

from tandem.engine import SeqSlice, build_metadata
from tandem.engine.attention.device_decode import device_decode_plan
from tandem.engine.attention.metadata import causal_mask, tree_mask
from tandem.engine.cuda_graphs import SCRATCH_PAGE
from tandem.spec import DraftInput, SpecConfig, SpecEngine, VerifyInput, propose
from tandem.spec.cuda_graphs import SpecGraphRunner
from tandem.spec.graph_memory import spec_graph_batch_sizes
from tandem.spec.slices import (
    chain_draft_table,
    chain_step_slices,
    pad_fixed_slices,
    verify_layout,
    verify_slices,
)

PS = 4  # page size of engine_cfg()


def test_chain_step_slices_follow_the_step():
    pages = [(5, 6, 7), (9, 10)]
    for step in (1, 2, 3):
        lay = build_metadata(chain_step_slices(pages, (6, 2), step), PS)
        # Step i consumes its input at position p0 + i - 1, writes that slot only, and attends
        # to num_cached + i keys.
        assert lay.positions.tolist() == [6 + step - 1, 2 + step - 1]
        assert lay.attn.kv_lens.tolist() == [6 + step, 2 + step]
        want = [pages[0][(6 + step - 1) // PS] * PS + (6 + step - 1) % PS,
                pages[1][(2 + step - 1) // PS] * PS + (2 + step - 1) % PS]
        assert lay.attn.slot_ids.tolist() == want
        assert lay.attn.is_decode
    with pytest.raises(ValueError, match="step"):
        chain_step_slices(pages, (6, 2), 0)


@pytest.mark.parametrize("rows", [2, 4])  # 4: two padding rows of a graph bucket
def test_device_chain_plans_equal_the_host_step_slices(rows):
    """What the drafting graph derives on the device for step s (device_decode_plan of the
    round's table at num_cached + s - 1) is what the host builder gives for that step: the
    same positions, slots and key counts, and the pages those keys fill; padding rows stay on
    the scratch page."""
    pages, num_cached = [(5, 6, 7), (9, 10)], (6, 2)
    table, base = chain_draft_table(pages, num_cached, rows=rows)
    assert table.dtype == torch.int32 and base.dtype == torch.int64
    for step in (1, 2, 3):
        positions = base + (step - 1)
        plan = device_decode_plan(table, positions, PS, num_splits=2)
        lay = build_metadata(chain_step_slices(pages, num_cached, step), PS)
        assert positions[:2].tolist() == lay.positions.tolist()
        assert plan.slot_ids[:2].tolist() == lay.attn.slot_ids.tolist()
        assert plan.kv_lens[:2].tolist() == lay.attn.kv_lens.tolist()
        for i in range(2):  # the table's first pages are the sequence's pages
            n = -(-int(plan.kv_lens[i]) // PS)
            assert table[i, :n].tolist() == list(lay.attn.kv_page_ids[
                lay.attn.kv_page_indptr[i] : lay.attn.kv_page_indptr[i + 1]].tolist())
        assert all(s // PS == SCRATCH_PAGE for s in plan.slot_ids[2:].tolist())
    with pytest.raises(ValueError, match="rows"):
        chain_draft_table(pages, num_cached, rows=1)


def _verify(parents, num_cached=(5, 9)) -> VerifyInput:
    n = len(parents)
    depth = [0] * n
    for j, p in enumerate(parents):
        depth[j] = 0 if p < 0 else depth[p] + 1
    return VerifyInput(page_ids=((1, 2, 3, 4, 11, 12), (5, 6, 7, 8, 13, 14)),
                       num_cached=tuple(num_cached),
                       tokens=torch.arange(2 * n).view(2, n),
                       parents=(tuple(parents),) * 2, depths=(tuple(depth),) * 2)


def test_verify_slices_mask_modes():
    chain, tree = _verify([-1, 0, 1, 2]), _verify([-1, 0, 0, 1])
    assert all(s.mask is None for s in verify_slices(chain))  # causal kernels for chains
    forced = verify_slices(chain, masked=True)  # a masked graph verifying a chain
    for s in forced:
        assert torch.equal(s.mask, causal_mask(4, s.kv_len))
    t = verify_slices(tree)
    assert torch.equal(t[0].mask, tree_mask(5, [-1, 0, 0, 1]))
    assert list(t[1].positions) == [9, 10, 10, 11]
    with pytest.raises(ValueError, match="causal"):
        verify_slices(tree, masked=False)
    # Same metadata for a chain, masked or not, except the mask itself.
    a, b = (build_metadata(verify_slices(chain, masked=m), PS) for m in (False, True))
    assert a.positions.tolist() == b.positions.tolist()
    assert a.attn.slot_ids.tolist() == b.attn.slot_ids.tolist()


@pytest.mark.parametrize("num_new", [3, 4, 9])
@pytest.mark.parametrize("masked", [False, True])
def test_padding_rows_write_and_read_only_the_scratch_page(num_new, masked):
    real = verify_slices(_verify(list(range(-1, num_new - 1))), masked=masked)
    padded = pad_fixed_slices(real, 5, num_new, PS, masked)
    assert padded[:2] == real and len(padded) == 5
    lay = build_metadata(padded, PS)
    a = lay.attn
    n_real = 2 * num_new
    scratch = set(range(SCRATCH_PAGE * PS, SCRATCH_PAGE * PS + PS))
    assert set(a.slot_ids.tolist()[n_real:]) <= scratch
    assert not set(a.slot_ids.tolist()[:n_real]) & scratch
    pad_pages = a.kv_page_ids.tolist()[a.kv_page_indptr.tolist()[2]:]
    assert set(pad_pages) == {SCRATCH_PAGE}
    assert lay.positions.tolist()[n_real:] == list(range(num_new)) * 3
    assert a.kv_lens.tolist()[2:] == [num_new] * 3
    assert (a.custom_mask is not None) == masked
    with pytest.raises(ValueError, match="new tokens"):
        pad_fixed_slices(real, 5, num_new + 1, PS, masked)
    with pytest.raises(ValueError, match="batch_size"):
        pad_fixed_slices(real, 1, num_new, PS, masked)


@pytest.mark.parametrize("parents", [[-1, 0, 1, 2], [-1, 0, 0, 1, 3]], ids=["chain", "tree"])
@pytest.mark.parametrize("rows", [None, 4])
def test_verify_layout_device_mask_equals_host_mask(parents, rows):
    """The mask built by the bookkeeping kernel (CUDA's path) is the per-request host mask,
    padding rows included; everything else in the layout is the same."""
    verify = _verify(parents, num_cached=(5, 18))
    host = verify_layout(verify, PS, "cpu", masked=True, rows=rows, device_mask=False)
    dev = verify_layout(verify, PS, "cpu", masked=True, rows=rows, device_mask=True)
    assert torch.equal(dev.attn.custom_mask, host.attn.custom_mask)
    assert dev.positions.tolist() == host.positions.tolist()
    for f in ("qo_indptr", "kv_page_indptr", "kv_page_ids", "kv_lens", "slot_ids"):
        assert torch.equal(getattr(dev.attn, f), getattr(host.attn, f)), f
    want = [SeqSlice(page_ids=p, num_cached=nc, num_new=len(parents), mask=tree_mask(nc, parents),
                     positions=list(s.positions) if s.positions is not None else None)
            for p, nc, s in zip(verify.page_ids, verify.num_cached, verify_slices(verify))]
    if rows is None:
        assert torch.equal(host.attn.custom_mask, build_metadata(want, PS).attn.custom_mask)


def test_spec_graph_buckets():
    assert spec_graph_batch_sizes((1, 2, 4, 8, 16)) == (1, 2, 4, 8, 16)
    assert spec_graph_batch_sizes((4, 1, 2, 8), max_batch_size=4) == (1, 2, 4)
    assert spec_graph_batch_sizes((8, 16), max_batch_size=4) == (8,)


# ---- the graph runner in eager mode --------------------------------------------------------------


class _FakePlanner:
    """Stands in for FlashInfer's fixed-buffer planners on the CPU: plans with the reference
    backend and enforces the same shape contract (fixed tokens per sequence, mask mode)."""

    def __init__(self, backend, decode: bool, tokens_per_seq: int = 1, masked: bool = False):
        self.backend, self.decode = backend, decode
        self.tokens_per_seq, self.masked = tokens_per_seq, masked
        self.num_plans = 0

    def plan(self, meta):
        if self.decode:
            assert meta.is_decode
        else:
            assert meta.num_tokens == meta.num_seqs * self.tokens_per_seq
            assert (meta.custom_mask is not None) == self.masked
        self.num_plans += 1
        return self.backend.plan(meta)


def _attach_graphs(eng: SpecEngine, monkeypatch, sizes=(1, 2, 4),
                   device_metadata: bool = False) -> SpecGraphRunner:
    """The engine's chain runner in eager mode, planning through `_FakePlanner`
    (device_metadata False: the host-planned path; test_device_verify.py covers the
    other, the default on CUDA)."""
    backend = eng.runner.backend
    monkeypatch.setattr(backend, "graph_decode_planner",
                        lambda bs, pages: _FakePlanner(backend, True), raising=False)
    monkeypatch.setattr(backend, "graph_prefill_planner",
                        lambda bs, n, pages, kv, custom_mask: _FakePlanner(backend, False, n,
                                                                           custom_mask),
                        raising=False)
    graphs = SpecGraphRunner(eng.runner, eng.draft, eng.spec, sizes,
                             max_kv_len=eng.max_model_len + eng.spec.slots_per_round,
                             capture_layers=eng.capture, device_metadata=device_metadata)
    graphs.capture(eager=True)
    eng.spec_graphs = graphs
    return graphs


SPECS = {"chain4": SpecConfig(num_steps=4), "chain2": SpecConfig(num_steps=2),
         "tree3x2n5": SpecConfig(num_steps=3, topk=2, num_draft_tokens=5)}


@pytest.mark.parametrize("kind", ["eagle", "eagle-2layer"])  # 2 layers: 2 draft KV layers
@pytest.mark.parametrize("name", list(SPECS))
@pytest.mark.parametrize("bs", [1, 3])  # 3 runs padded in the bucket of 4
def test_graph_runner_round_equals_plain_greedy(name, bs, kind, monkeypatch):
    model = tiny_target("llama")
    spec = SPECS[name]
    ps = prompts(bs, seed=40 + bs)
    params = greedy(12)
    want = [c.output_ids for c in reference(model, ps, params)]
    eng = SpecEngine(engine_cfg(), spec, model, tiny_head(model, kind))
    graphs = _attach_graphs(eng, monkeypatch)
    calls = {"propose": 0, "verify": 0}
    for fn in ("propose", "verify"):
        orig = getattr(graphs, fn)

        def spy(x, orig=orig, fn=fn):
            calls[fn] += 1
            return orig(x)

        monkeypatch.setattr(graphs, fn, spy)
    got = [c.output_ids for c in eng.generate(ps, params)]
    assert got == want
    assert calls["verify"] > 0
    assert (calls["propose"] > 0) == (spec.topk == 1)  # tree drafting stays eager
    assert eng.spec_stats.num_tokens > eng.spec_stats.num_rounds  # some drafts accepted
    assert_pages_free(eng)


def _running_input(eng: SpecEngine, bs: int) -> DraftInput:
    ids = [eng.add_request(p, greedy(30)) for p in prompts(bs, seed=7, lo=5, hi=19)]
    while not all(i in eng.seeds for i in ids):
        eng.step()
    eng.step()
    reqs = [eng.scheduler.requests[i] for i in ids]
    for r in reqs:
        assert eng.scheduler.reserve(r, r.num_computed + eng.spec.slots_per_round, set(ids))[0]
    return DraftInput.from_seeds([eng.seeds[i] for i in ids], [r.page_ids for r in reqs])


@pytest.mark.parametrize("bs", [2, 3])
def test_graph_propose_equals_eager_propose(bs, monkeypatch):
    model = tiny_target("llama", live=None)
    spec = SpecConfig(num_steps=4)
    eng = SpecEngine(engine_cfg(), spec, model, tiny_head(model, "eagle", live=None))
    graphs = _attach_graphs(eng, monkeypatch)
    inp = _running_input(eng, bs)
    saved = [t.clone() for t in (inp.last_tokens, inp.topk_ids, inp.hidden)]
    want = propose(eng.draft, inp, spec)
    got = graphs.propose(inp)
    assert torch.equal(got.tokens, want.tokens)
    assert got.parents == want.parents and got.depths == want.depths
    for before, after in zip(saved, (inp.last_tokens, inp.topk_ids, inp.hidden)):
        assert torch.equal(before, after)  # inputs only read
    # The returned tokens are the caller's: the next round's replays leave them alone.
    kept = got.tokens.clone()
    graphs.propose(inp)
    assert torch.equal(got.tokens, kept)
    # Verify through the runner == the eager verify forward (logits of the real rows).
    g = graphs.verify(want).logits.clone()
    saved_graphs, eng.spec_graphs = eng.spec_graphs, None
    e_logits = eng._verify_forward(want).logits
    eng.spec_graphs = saved_graphs
    torch.testing.assert_close(g, e_logits, rtol=1e-5, atol=1e-5)


def test_runner_refuses_a_backend_without_graph_planners():
    model = tiny_target("llama")
    eng = SpecEngine(engine_cfg(), SpecConfig(num_steps=3), model, tiny_head(model, "eagle"))
    assert eng.spec_graphs is None  # CPU: no graphs
    with pytest.raises(ValueError, match="cannot replay graphs"):
        SpecGraphRunner(eng.runner, eng.draft, eng.spec, (1,), 64, ())
