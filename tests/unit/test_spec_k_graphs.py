"""CUDA graphs for every k a policy may choose (spec/graph_set.py): a round of any k runs in the
runner of its k -- drafting, verify and (greedy) draft-extend, none of them eagerly -- and the
engine stays lossless under a k schedule that changes k every step, in float32. CPU: the
runners in eager mode over fake fixed-buffer planners (test_spec_graph_padding.py);
tests/gpu/test_spec_graphs.py replays the real graphs."""

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
from test_spec_adaptive import KS, SPEC, ForcedK
from test_spec_graph_padding import _attach_graphs, _running_input

import tandem.spec.engine as spec_engine
from tandem.engine import SamplingParams
from tandem.spec import SpecConfig, SpecEngine, propose
from tandem.spec.cuda_graphs import SpecGraphRunner
from tandem.spec.graph_set import capture_k_graphs, graphs_for, policy_ks, verify_drafts


def _attach_k_graphs(eng: SpecEngine, monkeypatch, device_metadata: bool = False
                     ) -> dict[int, SpecGraphRunner]:
    full = _attach_graphs(eng, monkeypatch, device_metadata=device_metadata)
    eng.k_graphs = capture_k_graphs(full, policy_ks(eng.spec), eager=True)
    return eng.k_graphs


def _spy(monkeypatch, calls: dict, k: int, runner: SpecGraphRunner) -> None:
    for fn in ("propose", "verify", "extend"):
        orig = getattr(runner, fn)

        def spy(*a, orig=orig, fn=fn):
            calls[fn, k] = calls.get((fn, k), 0) + 1
            return orig(*a)

        monkeypatch.setattr(runner, fn, spy)


def test_policy_ks_and_dispatch():
    assert policy_ks(SpecConfig(num_steps=4)) == (0, 1, 2, 3)
    assert policy_ks(SpecConfig(num_steps=3, topk=2, num_draft_tokens=5)) == (0,)
    chain, tree = SpecConfig(num_steps=4), SpecConfig(num_steps=3, topk=2, num_draft_tokens=5)
    assert [verify_drafts(chain, n) for n in (1, 2, 5)] == [0, 1, 4]
    assert [verify_drafts(tree, n) for n in (1, 5)] == [0, 3]
    full = object.__new__(SpecGraphRunner)
    full.num_drafts = 4
    others = {0: "k0", 2: "k2"}
    assert graphs_for(full, others, 4) is full
    assert graphs_for(full, others, 2) == "k2"
    assert graphs_for(full, others, 3) is None  # not captured: the round runs eagerly
    assert graphs_for(None, {}, 4) is None  # no graphs at all (CPU, cuda_graphs off)


def test_a_cpu_engine_has_no_graphs_for_any_k():
    model = tiny_target("llama")
    eng = SpecEngine(engine_cfg(), SPEC, model, tiny_head(model, "eagle"), policy=ForcedK(KS))
    assert eng.spec_graphs is None and eng.k_graphs == {}


def test_k_runners_share_memory_and_take_their_shapes(monkeypatch):
    """Each k's runner: N = R = k + 1, 1-token forwards (k = 0) through the decode planner,
    k = 1 proposes without a draft step, every runner writes its logits into one buffer."""
    model = tiny_target("llama", live=None)
    spec = SpecConfig(num_steps=4)
    eng = SpecEngine(engine_cfg(), spec, model, tiny_head(model, "eagle", live=None))
    runners = _attach_k_graphs(eng, monkeypatch)
    full = eng.spec_graphs
    assert sorted(runners) == [0, 1, 2, 3]
    for k, r in runners.items():
        assert (r.num_drafts, r.num_nodes, r.extend_rows) == (k, k + 1, k + 1)
        assert r.memory is full.memory and r.batch_sizes == full.batch_sizes
        assert r._verify_planner.decode == (k == 0) and r._extend_planner.decode == (k == 0)
        assert r.chain_drafting == (k > 1) and r._draft_graphs.keys() == (
            set(r.batch_sizes) if k > 1 else set())
    assert full.memory.logits.shape == (4 * 5, model.cfg.vocab_size)
    inp = _running_input(eng, 3)
    for k, r in runners.items():
        verify = propose(eng.draft, inp, spec, k)
        if k >= 1:  # the graph proposes what eager drafting does
            assert torch.equal(r.propose(inp).tokens, verify.tokens)
        logits = r.verify(verify).logits
        assert logits.data_ptr() == full.memory.logits.data_ptr()  # a view of the shared rows
        saved, eng.k_graphs = eng.k_graphs, {}
        eager = eng._verify_forward(verify).logits
        eng.k_graphs = saved
        torch.testing.assert_close(logits, eager, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("device", [False, True], ids=["planned", "device-metadata"])
@pytest.mark.parametrize("bs", [1, 3])  # 3 runs padded in the bucket of 4
def test_every_k_runs_in_its_graphs_and_greedy_equals_plain(bs, device, monkeypatch):
    """A schedule with k in {0, 1, 2, 3} and split steps: every round's drafting, verify and
    draft-extend go through the runner of its k (eager drafting only proposes k = 0's root,
    no eager draft-extend at all), and the output is plain greedy's, token for token -- with
    verify and extend planned on the host or with their metadata on the device."""
    model = tiny_target("llama")
    ps = prompts(bs, seed=61 + bs)
    policy = ForcedK(KS, split_every=3)
    eng = SpecEngine(engine_cfg(), SPEC, model, tiny_head(model, "eagle"), policy=policy)
    calls: dict = {}
    for k, runner in {**_attach_k_graphs(eng, monkeypatch, device),
                      3: eng.spec_graphs}.items():
        assert runner.device_metadata == device
        _spy(monkeypatch, calls, k, runner)
    eager_ks = []
    real_propose = spec_engine.propose
    monkeypatch.setattr(spec_engine, "propose",
                        lambda d, i, s, k: eager_ks.append(k) or real_propose(d, i, s, k))
    monkeypatch.setattr(spec_engine, "draft_extend", None)  # eager extend: would raise
    got = eng.generate(ps, greedy(24))
    assert [c.output_ids for c in got] == [c.output_ids for c in reference(model, ps, greedy(24))]
    assert set(eager_ks) == {0}  # k = 0 proposes the root alone, on the host
    for k in set(KS):
        assert calls["verify", k] > 0 and calls["extend", k] > 0, (k, calls)
        assert (calls.get(("propose", k), 0) > 0) == (k > 0), (k, calls)
    if bs > 1:
        assert any(p.splits for p in policy.plans)
    assert_pages_free(eng)


def test_logprobs_equal_plain_under_a_k_schedule_with_graphs(monkeypatch):
    """float32: the graphed rounds of every k (on-device acceptance, logprobs read with the
    round's tokens) give each asking request plain decoding's logprobs."""
    model = tiny_target("llama")
    ps = prompts(3, seed=64)
    asking = SamplingParams(max_new_tokens=20, ignore_eos=True, logprobs=True, top_logprobs=3)
    params = [asking, greedy(20), asking]
    want = reference(model, ps, params)
    eng = SpecEngine(engine_cfg(), SPEC, model, tiny_head(model, "eagle"),
                     policy=ForcedK(KS, split_every=3))
    _attach_k_graphs(eng, monkeypatch)
    got = eng.generate(ps, params)
    assert got[1].logprobs == ()
    for g, w in zip(got, want):
        assert g.output_ids == w.output_ids
        for i, (a, b) in enumerate(zip(g.logprobs, w.logprobs, strict=True)):
            assert (a.token_id, a.top_ids) == (b.token_id, b.top_ids), i
            assert a.logprob == pytest.approx(b.logprob, abs=1e-5), i
    assert_pages_free(eng)


def test_a_k_runner_refuses_another_k_and_too_small_memory(monkeypatch):
    model = tiny_target("llama", live=None)
    eng = SpecEngine(engine_cfg(), SpecConfig(num_steps=3), model,
                     tiny_head(model, "eagle", live=None))
    full = _attach_graphs(eng, monkeypatch)
    with pytest.raises(ValueError, match="num_drafts: must be in"):
        SpecGraphRunner(eng.runner, eng.draft, eng.spec, (1, 2), 64, (), num_drafts=4)
    with pytest.raises(ValueError, match="logits rows"):  # buckets past full's
        SpecGraphRunner(eng.runner, eng.draft, eng.spec, (1, 8), 64, (), num_drafts=2,
                        memory=full.memory)
    inp = _running_input(eng, 2)
    k1 = capture_k_graphs(full, (1,), eager=True)[1]
    with pytest.raises(ValueError, match="no verify graph"):
        k1.verify(propose(eng.draft, inp, eng.spec, 2))  # 3 nodes in the 2-node graphs
