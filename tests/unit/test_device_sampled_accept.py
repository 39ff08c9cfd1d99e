"""Sampled chains accepted on the device (spec/device_accept.py): the draws of a seeded row do
not depend on what shares its batch, greedy rows of a mixed batch take the greedy rule, and in
the engine a sampled round in graphs queues its draft-extend and the next round's drafting
before its host read -- with the outputs of the same round run without graphs. That the
emitted tokens follow the target distribution is tests/unit/test_spec_sampling.py's (its
chains take this path)."""

from __future__ import annotations

import pytest
import torch
from spec_helpers import (
    assert_pages_free,
    engine_cfg,
    one_thread,  # noqa: F401 (autouse fixture)
    prompts,
    tiny_head,
    tiny_target,
)
from test_spec_graph_padding import _attach_graphs

import tandem.spec.engine as engine_mod
from tandem.engine import SamplingParams
from tandem.spec import SpecConfig, SpecEngine, VerifyInput
from tandem.spec.accept import with_row_faults
from tandem.spec.device_accept import (
    launch_device_accept,
    launch_greedy_accept,
    launch_sampled_chain_accept,
)

V = 40


def _chains(n: int, num_nodes: int, seed: int) -> tuple[VerifyInput, torch.Tensor]:
    """n chains of `num_nodes` nodes whose drafts are often the target's likely tokens (so
    some are accepted and some rejected), and their verify logits [n * N, V]."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(n * num_nodes, V, generator=g) * 2.0
    likely = logits.topk(3, dim=-1).indices.view(n, num_nodes, 3)  # [n, N, 3]
    pick = torch.randint(0, 3, (n, num_nodes), generator=g)
    drafts = likely.gather(2, pick[:, :, None]).squeeze(2)  # [n, N] a likely token per node
    tokens = torch.cat([torch.randint(0, V, (n, 1), generator=g), drafts[:, :-1]], dim=1)
    chain = tuple(range(-1, num_nodes - 1))
    return VerifyInput(page_ids=((),) * n, num_cached=(0,) * n, tokens=tokens,
                       parents=(chain,) * n, depths=(tuple(range(num_nodes)),) * n), logits


def _row(verify: VerifyInput, logits: torch.Tensor, r: int) -> tuple[VerifyInput, torch.Tensor]:
    n = verify.num_nodes
    return VerifyInput(page_ids=((),), num_cached=(0,), tokens=verify.tokens[r : r + 1],
                       parents=verify.parents[r : r + 1], depths=verify.depths[r : r + 1]), \
        logits[r * n : (r + 1) * n]


@pytest.mark.parametrize("num_nodes", [5, 2, 1])  # k = 4, 1 and 0 drafts
def test_a_seeded_row_draws_alike_whatever_shares_its_batch(num_nodes):
    verify, logits = _chains(4, num_nodes, seed=num_nodes)
    params = [SamplingParams(temperature=0.8, seed=1), SamplingParams(),  # greedy
              SamplingParams(temperature=1.3, top_k=5), SamplingParams(temperature=0.8, seed=2)]
    for trial in range(20):
        mine = torch.Generator().manual_seed(100 + trial)  # row 0's own
        shared = torch.Generator().manual_seed(7)  # rows 2 and 3 share the engine's
        both = launch_sampled_chain_accept(verify, logits, params,
                                           [mine, shared, shared, shared]).result()
        alone = torch.Generator().manual_seed(100 + trial)
        v0, l0 = _row(verify, logits, 0)
        one = launch_sampled_chain_accept(v0, l0, params[:1], [alone]).result()
        assert one.new_tokens[0] == both.new_tokens[0] and one.path_nodes[0] == both.path_nodes[0]
        assert torch.equal(alone.get_state(), mine.get_state())  # it drew as many numbers
        v1, l1 = _row(verify, logits, 1)  # the greedy row: the greedy rule, no draws
        greedy = launch_greedy_accept(v1, l1, params[1:2]).result()
        assert greedy.new_tokens[0] == both.new_tokens[1]


def test_every_draft_accepted_or_not_as_the_target_allows():
    """top_k 1 sampling is greedy: drafts accepted exactly where they are the argmax; a draft
    the target gives probability 0 (outside top_k 2) is never accepted."""
    verify, logits = _chains(6, 5, seed=3)
    gen = torch.Generator().manual_seed(0)
    one = launch_sampled_chain_accept(verify, logits, [SamplingParams(temperature=0.9,
                                                                      top_k=1)] * 6, [gen] * 6)
    ref = launch_greedy_accept(verify, logits).result()
    assert one.result().new_tokens == ref.new_tokens
    top2 = logits.topk(2, dim=-1).indices.view(6, 5, 2)
    for _ in range(30):
        res = launch_sampled_chain_accept(verify, logits, [SamplingParams(top_k=2,
                                                                          temperature=1.0)] * 6,
                                          [gen] * 6).result()
        for r, path in enumerate(res.path_nodes):
            for node in path:  # drafted at node - 1: inside that node's top 2
                assert verify.tokens[r, node] in top2[r, node - 1]


def test_sampled_trees_stay_on_the_host():
    verify, logits = _chains(2, 3, seed=4)
    tree = VerifyInput(page_ids=verify.page_ids, num_cached=verify.num_cached,
                       tokens=verify.tokens, parents=((-1, 0, 0),) * 2, depths=((0, 1, 1),) * 2)
    gens = [torch.Generator()] * 2
    assert launch_device_accept(tree, logits, [SamplingParams(temperature=1.0)] * 2, gens) is None
    assert launch_device_accept(tree, logits, [SamplingParams()] * 2, gens) is not None
    assert launch_device_accept(verify, logits, [SamplingParams(temperature=1.0)] * 2,
                                gens) is not None


def _engine(model, monkeypatch, graphs: bool, ahead: bool) -> SpecEngine:
    eng = SpecEngine(engine_cfg(), SpecConfig(num_steps=3), model, tiny_head(model, "eagle"))
    if graphs:
        _attach_graphs(eng, monkeypatch, device_metadata=True)
        eng.set_draft_ahead(ahead)
    return eng


def _device_accept_everywhere(monkeypatch) -> None:
    """Eager rounds accept sampled chains as on a GPU (`accept` walks them on a CPU)."""
    real = engine_mod.accept

    def accept(verify, logits, params, generators, req_ids=(), fault=None):
        pending = launch_device_accept(verify, logits, params, generators)
        if pending is None:
            return real(verify, logits, params, generators, req_ids, fault)
        return with_row_faults(pending.result(), req_ids, fault)

    monkeypatch.setattr(engine_mod, "accept", accept)


def test_sampled_rounds_in_graphs_draft_ahead_with_the_outputs_of_eager_rounds(monkeypatch):
    """Seeded sampled requests (and a greedy one beside them): rounds in graphs accept on
    the device, draft-extend through the graph and draft the next round ahead; the outputs
    are those of the same engine without graphs accepting on the device too (same
    acceptance, same draws)."""
    model = tiny_target("llama")
    ps = prompts(3, seed=21)
    # top_k 4: the live tokens the random head proposes, so drafts get accepted and rejected
    params = [SamplingParams(max_new_tokens=20, ignore_eos=True, temperature=1.0, top_k=4,
                             seed=s) for s in (3, 4)]
    params.append(SamplingParams(max_new_tokens=20, ignore_eos=True))
    _device_accept_everywhere(monkeypatch)
    eager = _engine(model, monkeypatch, False, False)
    want = [c.output_ids for c in eager.generate(ps, params)]
    assert eager.spec_stats.num_tokens > eager.spec_stats.num_rounds  # some drafts accepted
    for ahead in (True, False):
        eng = _engine(model, monkeypatch, True, ahead)
        calls = {"round": 0, "extend": 0}
        for obj, name, key in ((eng, "_spec_round", "round"),
                               (eng.spec_graphs, "extend", "extend")):
            real = getattr(obj, name)
            monkeypatch.setattr(obj, name, lambda *a, _r=real, _k=key, **kw:
                                calls.__setitem__(_k, calls[_k] + 1) or _r(*a, **kw))
        assert [c.output_ids for c in eng.generate(ps, params)] == want
        assert calls["extend"] == calls["round"] > 0  # every round draft-extends in graphs
        assert (eng.draft_ahead.used > 0) == ahead
        assert_pages_free(eng)


def test_sampled_rounds_ahead_through_a_changing_batch(monkeypatch):
    """Seeded sampled requests ending at different rounds (max_new_tokens, an EOS inside an
    accepted run), one aborted between steps, one joining late: each change drops what was
    drafted ahead, and every request that ran to its end got the tokens it gets in a batch
    of its own kind run eagerly (a seeded row draws alike in any batch)."""
    from test_draft_ahead import EOS, changing_batch

    model = tiny_target("llama", eos_token_id=EOS)
    ps = prompts(5, seed=12)
    params = [SamplingParams(max_new_tokens=n, temperature=1.0, top_k=4, seed=60 + i)
              for i, n in enumerate((6, 30, 17, 30, 25))]
    _device_accept_everywhere(monkeypatch)
    ref = _engine(model, monkeypatch, False, False).generate(ps, params)
    eng = _engine(model, monkeypatch, True, True)
    changing_batch(eng, ps, params, ref)
    assert eng.draft_ahead.used > 0 and eng.draft_ahead.dropped >= 3
    assert any(EOS in c.output_ids for c in ref)


def test_sampled_rounds_ahead_under_preemption(monkeypatch):
    """Few pages: rounds preempt later requests (prefilled again, new seeds), spare slots
    are not taken while requests wait; a preempted seeded request re-joins with other round
    boundaries, so its draws land elsewhere (its tokens may differ from an unpreempted run),
    but the run is reproducible, drafts ahead, and gives every page back."""
    model = tiny_target("llama")
    ps = prompts(6, seed=7, lo=6, hi=20)
    params = [SamplingParams(max_new_tokens=14, ignore_eos=True, temperature=1.0, top_k=4,
                             seed=80 + i) for i in range(6)]
    runs = []
    for _ in range(2):
        eng = SpecEngine(engine_cfg(num_pages=30), SpecConfig(num_steps=3), model,
                         tiny_head(model, "eagle"))
        _attach_graphs(eng, monkeypatch, device_metadata=True)
        eng.set_draft_ahead(True)
        runs.append([c.output_ids for c in eng.generate(ps, params)])
        assert eng.scheduler.num_preemptions > 0 and eng.draft_ahead.used > 0
        assert all(len(o) == 14 for o in runs[-1])
        assert_pages_free(eng)
    assert runs[0] == runs[1]
