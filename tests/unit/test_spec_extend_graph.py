"""The draft-extend graph (SpecGraphRunner.extend, fixed R rows per request, inputs gathered on
the device) against the eager ragged draft-extend, and the capacity checks that turn a graph
replay over stale or oversized metadata into a Python error before launch (the batch-16
illegal memory access of benchmarks/gpu_spec.py). CPU: the runner in eager mode, as in
test_spec_graph_padding.py; tests/gpu/test_spec_graphs.py replays the real graphs."""

from __future__ import annotations

import pytest
import torch
from spec_helpers import (
    engine_cfg,
    greedy,
    one_thread,  # noqa: F401 (autouse fixture)
    prompts,
    tiny_head,
    tiny_target,
)
from test_spec_graph_padding import _attach_graphs, _running_input

from tandem.engine import SeqSlice, build_metadata
from tandem.engine.attention.flashinfer_backend import check_graph_metadata
from tandem.engine.cuda_graphs import (
    DecodeGraphRunner,
    check_latest_plan,
    pad_decode_slices,
)
from tandem.spec import SpecConfig, SpecEngine, propose
from tandem.spec.accept import launch_greedy_accept
from tandem.spec.extend import draft_extend, make_extend_input, next_draft_input
from tandem.engine.h2d import layout_to_device
from tandem.spec.phases import VerifyInput, VerifyResult
from tandem.spec.slices import extend_rows, extend_slices, pad_fixed_slices

PS = 4
SPECS = {"chain4": SpecConfig(num_steps=4),
         "tree3x2n5": SpecConfig(num_steps=3, topk=2, num_draft_tokens=5)}


def _scripted_result(verify: VerifyInput, accept_counts: list[int]
                     ) -> tuple[VerifyResult, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Accept the first a_r nodes along each tree's first path (node 1, its first child, ...),
    with a bonus token of our choosing: the host result and the device tensors acceptance
    would leave."""
    depth = max(max(d) for d in verify.depths)
    tokens = verify.tokens.tolist()
    paths, new_tokens = [], []
    path_t = torch.full((verify.batch_size, depth), -1, dtype=torch.int32)
    for r, a in enumerate(accept_counts):
        node, path = 0, []
        for _ in range(a):
            node = next(j for j, p in enumerate(verify.parents[r]) if p == node)
            path.append(node)
        bonus = 7 + r
        paths.append(tuple(path))
        new_tokens.append(tuple(tokens[r][c] for c in path) + (bonus,))
        path_t[r, : len(path)] = torch.tensor(path, dtype=torch.int32)
    result = VerifyResult(path_nodes=tuple(paths), new_tokens=tuple(new_tokens))
    num = torch.tensor([len(p) for p in paths], dtype=torch.int32)
    bonus = torch.tensor([t[-1] for t in new_tokens], dtype=torch.int64)
    return result, num, path_t, bonus


def _first_child_depth(parents) -> int:
    node, d = 0, 0
    while (node := next((j for j, p in enumerate(parents) if p == node), None)) is not None:
        d += 1
    return d


@pytest.mark.parametrize("kind", ["eagle", "eagle-2layer"])
@pytest.mark.parametrize("name", list(SPECS))
@pytest.mark.parametrize("bs", [1, 3])  # 3 runs padded in the bucket of 4
def test_extend_graph_equals_eager_extend_for_every_acceptance(name, bs, kind, monkeypatch):
    model = tiny_target("llama", live=None)
    spec = SPECS[name]
    eng = SpecEngine(engine_cfg(), spec, model, tiny_head(model, kind, live=None))
    graphs = _attach_graphs(eng, monkeypatch)
    inp = _running_input(eng, bs)
    verify = propose(eng.draft, inp, spec)
    saved, eng.spec_graphs = eng.spec_graphs, None
    out = eng._verify_forward(verify)
    eng.spec_graphs = saved
    feats = out.hidden
    depth = max(max(d) for d in verify.depths)
    assert graphs.can_extend(verify) and graphs.extend_rows >= depth + 1
    longest = [_first_child_depth(p) for p in verify.parents]
    for first in range(depth + 1):  # none, partial and all accepted, mixed across the batch
        counts = [(first + r) % (longest[r] + 1) for r in range(bs)]
        result, num, path, bonus = _scripted_result(verify, counts)
        got = graphs.extend(verify, num, path, bonus, feats)
        want = draft_extend(eng.draft, make_extend_input(verify, result, feats), spec.topk)
        torch.testing.assert_close(got.hidden, want.hidden, rtol=1e-5, atol=1e-5)
        assert torch.equal(got.topk_ids, want.topk_ids)
        torch.testing.assert_close(got.topk_logp, want.topk_logp, rtol=1e-5, atol=1e-5)
        nxt = next_draft_input(verify, result, got.hidden, got.topk_ids, got.topk_logp,
                               got.last_tokens)
        assert nxt.num_cached == want.num_cached
        assert torch.equal(nxt.last_tokens, want.last_tokens)
        assert nxt.last_token_ids == tuple(want.last_tokens.tolist())
        # The seeds need no device read: the host knew the last tokens.
        assert [s.last_token for s in nxt.seeds()] == list(nxt.last_token_ids)


@pytest.mark.parametrize("name", list(SPECS))
def test_engine_round_runs_acceptance_and_extend_on_the_device(name, monkeypatch):
    """The engine's graph path (launch acceptance, queue the extend graph, then the one host
    read) commits what plain greedy decoding does."""
    from spec_helpers import reference

    model = tiny_target("llama")
    spec = SPECS[name]
    ps = prompts(3, seed=43)
    params = greedy(12)
    want = [c.output_ids for c in reference(model, ps, params)]
    eng = SpecEngine(engine_cfg(), spec, model, tiny_head(model, "eagle"))
    graphs = _attach_graphs(eng, monkeypatch)
    calls = {"extend": 0}
    orig = graphs.extend

    def spy(*a):
        calls["extend"] += 1
        return orig(*a)

    monkeypatch.setattr(graphs, "extend", spy)
    got = [c.output_ids for c in eng.generate(ps, params)]
    assert got == want
    assert calls["extend"] > 0
    assert eng.spec_stats.num_tokens > eng.spec_stats.num_rounds


def test_launch_greedy_accept_matches_the_host_walk():
    from tandem.spec.accept import _walk_greedy, children_of

    g = torch.Generator().manual_seed(3)
    parents = ((-1, 0, 0, 1, 3), (-1, 0, 1, 2, 3))
    depths = ((0, 1, 1, 2, 3), (0, 1, 2, 3, 4))
    tokens = torch.randint(0, 3, (2, 5), generator=g)
    logits = torch.randn(10, 3, generator=g)
    verify = VerifyInput(page_ids=((1,), (2,)), num_cached=(1, 1), tokens=tokens,
                         parents=parents, depths=depths)
    res = launch_greedy_accept(verify, logits).result()
    argmax = logits.argmax(-1).view(2, 5).tolist()
    for r in range(2):
        path, bonus = _walk_greedy(tokens[r].tolist(), argmax[r], children_of(parents[r]))
        assert res.path_nodes[r] == tuple(path)
        assert res.new_tokens[r] == tuple(tokens[r, c].item() for c in path) + (bonus,)


# ---- fixed-shape extend metadata ---------------------------------------------------------------


def test_extend_rows_and_slices():
    assert extend_rows(4, 5) == 5  # chain k=4: root + 4
    assert extend_rows(4, 16) == 5  # tree: depth bounded by the levels
    assert extend_rows(4, 3) == 3  # a 3-node tree accepts at most 2
    pages = [(5, 6, 7), (9, 10)]
    lay = build_metadata(pad_fixed_slices(extend_slices(pages, (6, 2), 3), 4, 3, PS, False), PS)
    assert lay.positions.tolist() == [6, 7, 8, 2, 3, 4, 0, 1, 2, 0, 1, 2]
    assert lay.attn.kv_lens.tolist() == [9, 5, 3, 3]
    assert lay.attn.custom_mask is None  # causal: real rows see only accepted keys


# ---- host->device layouts without a stream sync ------------------------------------------------


@pytest.mark.parametrize("masked", [False, True])
def test_packed_layout_equals_build_metadata(masked):
    from tandem.engine.attention.metadata import tree_mask

    seqs = [SeqSlice(page_ids=(3, 4, 8), num_cached=5, num_new=3,
                     mask=tree_mask(5, [-1, 0, 0]) if masked else None),
            SeqSlice(page_ids=(1, 2), num_cached=1, num_new=3,
                     mask=tree_mask(1, [-1, 0, 1]) if masked else None)]
    want = build_metadata(seqs, PS)
    got = layout_to_device(build_metadata(seqs, PS), "cpu", pack=True)
    assert torch.equal(got.positions, want.positions)
    for f in ("qo_indptr", "kv_page_indptr", "kv_page_ids", "kv_lens", "kv_last_page_len",
              "slot_ids", "qo_indptr_cpu", "kv_page_indptr_cpu", "kv_lens_cpu"):
        a, b = getattr(got.attn, f), getattr(want.attn, f)
        assert a.dtype == b.dtype and torch.equal(a, b), f
    assert (got.attn.custom_mask is None) == (not masked)
    if masked:
        assert torch.equal(got.attn.custom_mask, want.attn.custom_mask)


# ---- capacity checks: an out-of-bounds replay becomes a Python error ---------------------------


def test_graph_metadata_check_rejects_stale_indptr_tails():
    """What the decode graph of 16 read at batch 16 after a plan of 1 request: indptr[:2] of
    the new plan, the rest of the old one -- a negative page count."""
    meta = build_metadata(pad_decode_slices([], 16), PS).attn
    check_graph_metadata(meta, "ok")  # padding rows alone are consistent
    real = build_metadata([SeqSlice(page_ids=tuple(range(1, 40)), num_cached=130, num_new=1)],
                          PS).attn
    stale = meta.kv_page_indptr_cpu.clone()
    stale[:2] = real.kv_page_indptr_cpu
    import dataclasses

    bad = dataclasses.replace(meta, kv_page_indptr_cpu=stale)
    with pytest.raises(ValueError, match="indptr"):
        check_graph_metadata(bad, "DecodeWrappers.plan")
    last = meta.kv_last_page_len_cpu.clone()
    last[3] = PS + 1
    with pytest.raises(ValueError, match="sequence 3"):
        check_graph_metadata(dataclasses.replace(meta, kv_last_page_len_cpu=last), "x")


def test_replay_only_refuses_a_plan_of_another_size():
    class Planner:
        latest_batch_size = 1

    check_latest_plan(Planner(), 1, "x")
    with pytest.raises(ValueError, match="latest plan is for 1 sequences"):
        check_latest_plan(Planner(), 16, "bench")
    runner = object.__new__(DecodeGraphRunner)
    runner._planner, runner._graphs = Planner(), {}
    with pytest.raises(ValueError, match="plan a batch of this size first"):
        runner.replay_only(16)


@pytest.mark.parametrize("name", list(SPECS))
def test_graph_buffers_hold_the_largest_bucket_at_the_context_end(name, monkeypatch):
    """Capacity of every fixed buffer for the largest bucket (4 here; 16 on the GPU bench)
    with every request at the deepest context a round may reach: pages, tokens, rows."""
    model = tiny_target("llama", live=None)
    spec = SPECS[name]
    eng = SpecEngine(engine_cfg(), spec, model, tiny_head(model, "eagle", live=None))
    caps = {}
    backend = eng.runner.backend

    class Planner:
        def __init__(self, kind, bs, pages, n=1):
            caps[kind] = (bs, pages, n)
            self.kind = kind

        def plan(self, meta):
            bs, pages, n = caps[self.kind]
            assert meta.num_seqs <= bs and meta.kv_page_ids_cpu.numel() <= pages
            assert meta.num_tokens == meta.num_seqs * n
            check_graph_metadata(meta, self.kind)
            return backend.plan(meta)

    monkeypatch.setattr(backend, "graph_decode_planner",
                        lambda bs, pages: Planner("draft", bs, pages), raising=False)
    kinds = iter(["verify", "extend"])
    monkeypatch.setattr(backend, "graph_prefill_planner",
                        lambda bs, n, pages, kv, custom_mask: Planner(next(kinds), bs, pages, n),
                        raising=False)
    from tandem.spec.cuda_graphs import SpecGraphRunner

    max_kv = eng.max_model_len + spec.slots_per_round
    graphs = SpecGraphRunner(eng.runner, eng.draft, spec, (1, 2, 4), max_kv, eng.capture,
                             device_metadata=False)  # the host-planned buffers' capacity
    graphs.capture(eager=True)
    n, r = graphs.num_nodes, graphs.extend_rows
    assert caps["verify"][2] == n and caps["extend"][2] == r
    assert graphs.buf.ver_features.shape[0] == 4 * n and graphs.buf.ext_positions.numel() == 4 * r
    # 4 requests at the last num_cached a round is allowed (engine: nc + num_steps < max_len).
    nc = eng.max_model_len - spec.num_steps - 1
    pages_each = -(-(nc + spec.slots_per_round) // PS)
    tables = [tuple(range(1 + i * pages_each, 1 + (i + 1) * pages_each)) for i in range(4)]
    verify_pages = build_metadata([SeqSlice(page_ids=t, num_cached=nc, num_new=n)
                                   for t in tables], PS).attn.kv_page_ids_cpu.numel()
    assert verify_pages <= caps["verify"][1]
    ext = build_metadata(extend_slices(tables, [nc] * 4, r), PS).attn
    assert ext.kv_page_ids_cpu.numel() <= caps["extend"][1]
    assert ext.num_tokens == 4 * r
