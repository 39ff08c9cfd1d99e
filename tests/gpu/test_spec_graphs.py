"""Speculative CUDA graphs (tandem/spec/cuda_graphs.py) on the GPU: a replay equals the eager
forward planned into the same buffers bit for bit, graph drafting proposes the eager tokens,
the draft-extend graph proposes what the eager extend does, and a SpecEngine with graphs
(draft steps, verify, acceptance and extend on the device) stays lossless (divergences from
plain greedy only at bf16 near-ties, checked against a stated margin).

    python -m pytest -q tests/gpu -k spec
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu
pytest.importorskip("flashinfer")

from tandem.engine import EngineConfig, LLMEngine, ParallelContext, SamplingParams
from tandem.engine.attention import build_metadata
from tandem.engine.loader import DTYPES, build_model, resolve_model
from tandem.engine.runner import ForwardBatch
from tandem.spec import (
    DraftHeadConfig,
    DraftInput,
    SpecConfig,
    SpecEngine,
    dummy_head,
    propose,
)
from tandem.spec.evaluate import parting_gap
from near_ties import assert_parts_only_at_near_ties  # noqa: E402 (tests/gpu on sys.path)
from tandem.spec.propose import chain_steps
from tandem.spec.slices import pad_fixed_slices, verify_slices

DEV = torch.device("cuda")
CHAIN = SpecConfig(num_steps=4)
TREE = SpecConfig(num_steps=3, topk=3, num_draft_tokens=8)


def _cfg(graphs: bool) -> EngineConfig:
    return EngineConfig(model="smollm2-135m", load_format="dummy", device="cuda",
                        dtype="bfloat16", cuda_graphs=graphs, max_num_seqs=8,
                        max_model_len=1024, kv_cache_bytes=512 << 20)


@pytest.fixture(scope="module")
def target():
    cfg = _cfg(True)
    model_cfg, path = resolve_model(cfg)
    model = build_model(model_cfg, path, cfg, ParallelContext(), 1024)
    head = dummy_head(DraftHeadConfig.like_target(model_cfg), model, DTYPES["bfloat16"], DEV,
                      1024)
    return model, head


def _planned(make):
    """An engine whose chain verify and draft-extend are planned on the host (FlashInfer
    plans; TANDEM_DEVICE_VERIFY=0): what the replay == eager-of-the-same-plan tests compare
    (`_verify_planner`, "plan a batch of this size first"). The default, device metadata, is
    checked end to end below (float32 equality with drafting ahead, the k schedule)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TANDEM_DEVICE_VERIFY", "0")
        return make()


@pytest.fixture(scope="module")
def chain_engine(target):
    return _planned(lambda: SpecEngine(_cfg(True), CHAIN, *target))


@pytest.fixture(scope="module")
def tree_engine(target):
    return SpecEngine(_cfg(True), TREE, *target)


@pytest.fixture(scope="module")
def two_layer_engine(target):
    """A chain engine whose head has two decoder layers, as the shipped SmolLM2 head does."""
    model = target[0]
    head = dummy_head(DraftHeadConfig.like_target(model.cfg, num_layers=2), model,
                      DTYPES["bfloat16"], DEV, 1024)
    return SpecEngine(_cfg(True), CHAIN, model, head)


def _input(eng: SpecEngine, bs: int, seed: int) -> tuple[list[str], DraftInput]:
    g = torch.Generator().manual_seed(seed)
    ids = [eng.add_request(torch.randint(3, 49152, (int(n),), generator=g).tolist(),
                           SamplingParams(max_new_tokens=200, ignore_eos=True))
           for n in torch.randint(5, 90, (bs,), generator=g)]
    while not all(i in eng.seeds for i in ids):
        eng.step()
    eng.step()
    reqs = [eng.scheduler.requests[i] for i in ids]
    for r in reqs:
        assert eng.scheduler.reserve(r, r.num_computed + eng.spec.slots_per_round, set(ids))[0]
    return ids, DraftInput.from_seeds([eng.seeds[i] for i in ids], [r.page_ids for r in reqs])


def _abort(eng: SpecEngine, ids: list[str]) -> None:
    for i in ids:
        eng.abort(i)
    assert eng.allocator.num_free == eng.allocator.num_usable


@pytest.mark.parametrize("bs", [1, 4, 8])  # captured sizes: no padding difference
def test_spec_graph_propose_equals_eager(chain_engine, bs):
    eng = chain_engine
    assert eng.spec_graphs is not None
    ids, inp = _input(eng, bs, seed=bs)
    assert eng.spec_graphs.can_propose(inp)
    want = propose(eng.draft, inp, eng.spec).tokens
    got = eng.spec_graphs.propose(inp).tokens
    assert torch.equal(got, want)
    _abort(eng, ids)


@pytest.mark.parametrize("bs", [1, 3])
def test_two_layer_head_graph_drafting_and_output_equal_eager(two_layer_engine, target, bs):
    """Each draft step of a two-layer head runs both layers, each over its own draft KV
    layer, inside the drafting graph: the graph proposes what eager drafting does, and the
    engine's greedy output stays plain's up to bf16 near-ties."""
    eng = two_layer_engine
    assert eng.draft.head.cfg.num_layers == 2 and eng.spec_graphs is not None
    ids, inp = _input(eng, bs, seed=30 + bs)
    want = propose(eng.draft, inp, eng.spec).tokens
    assert torch.equal(eng.spec_graphs.propose(inp).tokens, want)
    _abort(eng, ids)
    g = torch.Generator().manual_seed(6)
    prompts = [torch.randint(3, 49152, (7 + 13 * i,), generator=g).tolist() for i in range(bs)]
    params = SamplingParams(max_new_tokens=16, ignore_eos=True)
    plain = LLMEngine(_cfg(True), target[0])
    want_out = [c.output_ids for c in plain.generate(prompts, params)]
    got = [c.output_ids for c in eng.generate(prompts, params)]
    assert_parts_only_at_near_ties(plain, prompts, got, want_out)


@pytest.mark.parametrize("bs", [3, 4])  # 3 runs in the graph of 4
def test_spec_drafting_replay_equals_eager_of_the_same_padded_batch(chain_engine, bs):
    """The drafting graph (all k-1 steps, metadata derived on the device) == `chain_steps`
    run eagerly on the same padded inputs, bit for bit."""
    eng, graphs = chain_engine, chain_engine.spec_graphs
    ids, inp = _input(eng, bs, seed=10 + bs)
    rows = graphs.bucket(bs)
    got = graphs.propose(inp).tokens  # buffers now hold this round's padded inputs
    tokens = graphs.buf.tokens[:rows].clone()
    table, base = graphs.buf.draft_table[:rows].clone(), graphs.buf.draft_base[:rows].clone()
    hidden = chain_steps(eng.draft, tokens, graphs.buf.hidden[:rows].clone(), table, base)
    assert hidden.shape == graphs.buf.hidden[:rows].shape
    graphs.buf.tokens[:rows, 2:].fill_(-1)  # the replay must write the drafts itself
    graphs.replay_phase_only("propose", rows)
    torch.cuda.synchronize()
    assert torch.equal(graphs.buf.tokens[:rows], tokens)
    assert torch.equal(got, tokens[:bs])
    _abort(eng, ids)


@pytest.mark.parametrize("which", ["chain", "tree"])
@pytest.mark.parametrize("bs", [1, 3])
def test_spec_verify_replay_equals_eager_of_the_same_plan(chain_engine, tree_engine, which, bs):
    eng = chain_engine if which == "chain" else tree_engine
    graphs = eng.spec_graphs
    ids, inp = _input(eng, bs, seed=20 + bs)
    verify = propose(eng.draft, inp, eng.spec)
    assert graphs.can_verify(verify)
    rows = graphs.bucket(bs)
    got = graphs.verify(verify)
    got_logits, got_hidden = got.logits.clone(), got.hidden.clone()
    slices = pad_fixed_slices(verify_slices(verify, masked=graphs.masked), rows,
                              graphs.num_nodes, eng.cfg.page_size, graphs.masked)
    lay = build_metadata(slices, eng.cfg.page_size, DEV)
    plan = graphs._verify_planner.plan(lay.attn)
    n = rows * graphs.num_nodes
    ids_in = torch.zeros(n, dtype=torch.int64, device=DEV)
    ids_in[: verify.tokens.numel()] = verify.tokens.reshape(-1)
    eager = eng.runner.forward_planned(ids_in, lay.positions, plan, None, eng.capture)
    m = got_logits.shape[0]
    assert torch.equal(got_logits, eager.logits[:m])
    assert torch.equal(got_hidden, eager.hidden[:m])
    # And close to the eager prefill wrapper's forward (another split of the work).
    lay2 = build_metadata(verify_slices(verify, masked=graphs.masked), eng.cfg.page_size, DEV)
    ref = eng.runner.forward(ForwardBatch(
        input_ids=verify.tokens.reshape(-1), positions=lay2.positions, attn=lay2.attn,
        logits_indices=torch.arange(m, device=DEV))).logits
    assert float((got_logits - ref).norm() / ref.norm()) < 2e-2
    _abort(eng, ids)



# The default kernel paths (multi-row GEMVs for verify and small batches, the fused draft
# head) and the batch-1-only GEMV without the fused head: captured into the graphs when the
# engines are built under the policy.
POLICIES = {"default": {}, "rows1-layered-draft": {"gemv_max_rows": 1, "fused_draft": False}}


@pytest.mark.parametrize("policy", list(POLICIES))
@pytest.mark.parametrize("which", ["chain", "tree"])
def test_spec_with_graphs_is_lossless_up_to_bf16_near_ties(target, which, policy):
    from tandem.engine import kernels

    spec = CHAIN if which == "chain" else TREE
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 49152, (7 + 13 * i,), generator=g).tolist() for i in range(5)]
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    with kernels.kernel_policy(**POLICIES[policy]):
        plain = LLMEngine(_cfg(True), target[0])
        want = [c.output_ids for c in plain.generate(prompts, params)]
        eng = SpecEngine(_cfg(True), spec, *target)
        assert eng.spec_graphs is not None
        eng.draft_ahead.verify_batch = 8  # the five rows' next verify queued ahead too
        got = [c.output_ids for c in eng.generate(prompts, params)]
    assert (eng.draft_ahead.used > 0) == (which == "chain")  # chains draft ahead (spec/ahead.py)
    assert (eng.draft_ahead.verify_used > 0) == (which == "chain")  # ... and verify ahead
    # bf16: a verify over N tokens and a 1-token decode round differently; they may part
    # only where the two best candidates are within 2% of the logit scale.
    assert_parts_only_at_near_ties(plain, prompts, got, want)


@pytest.mark.parametrize("which", ["chain", "tree"])
@pytest.mark.parametrize("bs", [1, 3])  # 3 runs in the graph of 4
def test_spec_extend_graph_equals_eager_extend(chain_engine, tree_engine, which, bs):
    """The draft-extend graph (fixed R rows per request, inputs gathered on the device from
    acceptance's outputs) proposes what the eager ragged extend does: the same top-k ids and
    next-round inputs, hidden states equal up to bf16 rounding of other row counts."""
    from tandem.spec.accept import launch_greedy_accept
    from tandem.spec.extend import draft_extend, make_extend_input, next_draft_input

    eng = chain_engine if which == "chain" else tree_engine
    graphs = eng.spec_graphs
    ids, inp = _input(eng, bs, seed=30 + bs)
    verify = propose(eng.draft, inp, eng.spec)
    assert graphs.can_extend(verify)
    out = graphs.verify(verify)
    feats = out.hidden.clone()
    pending = launch_greedy_accept(verify, out.logits)
    result = pending.result()
    got = graphs.extend(verify, pending.num_accepted, pending.path, pending.bonus, feats)
    want = draft_extend(eng.draft, make_extend_input(verify, result, feats), eng.spec.topk)
    nxt = next_draft_input(verify, result, got.hidden, got.topk_ids, got.topk_logp,
                           got.last_tokens)
    assert nxt.num_cached == want.num_cached
    assert torch.equal(nxt.last_tokens, want.last_tokens)
    assert torch.equal(got.topk_ids, want.topk_ids)
    err = float((got.hidden.float() - want.hidden.float()).norm() / want.hidden.float().norm())
    assert err < 2e-2, err
    # Replaying the same plan again gives the same result bit for bit.
    again = graphs.extend(verify, pending.num_accepted, pending.path, pending.bonus, feats)
    assert torch.equal(again.hidden, got.hidden)
    # A replay over another bucket's plan is refused before launch (the bs-16 OOB).
    other = next(b for b in graphs.batch_sizes if b != graphs.bucket(bs))
    with pytest.raises(ValueError, match="plan a batch of this size first"):
        graphs.replay_phase_only("extend", other)
    _abort(eng, ids)


# ---- logprobs on the device acceptance path (launch_greedy_accept / _emitted_logprobs /
# HostCopy): the CUDA-graph greedy round computes them on the device before its one host read.

TOP = 5


def _target_drafts(graphs, verify):
    """`verify` with every draft replaced by its parent's target argmax (one verify replay per
    tree level), so acceptance takes a full path: emitted positions past the root are
    accepted drafts, not only bonus tokens."""
    from dataclasses import replace

    parents = torch.tensor(verify.parents, device=DEV).clamp(min=0)  # [bs, N]
    for _ in range(max(max(d) for d in verify.depths)):
        argmax = graphs.verify(verify).logits.argmax(-1).view(verify.batch_size, -1)
        tokens = torch.cat([verify.tokens[:, :1], argmax.gather(1, parents)[:, 1:]], dim=1)
        verify = replace(verify, tokens=tokens)
    return verify


@pytest.mark.parametrize("drafts", ["head", "target"])  # target: every draft accepted
@pytest.mark.parametrize("which", ["chain", "tree"])
@pytest.mark.parametrize("bs", [1, 3])  # 3: rows that ask beside one that does not
def test_graph_greedy_accept_logprobs_equal_the_verify_logits(chain_engine, tree_engine,
                                                               which, bs, drafts):
    """Each emitted token's logprob and top-K are the float32 log-softmax of the verify
    logits at the node it came from ((0, *path)[j]), read with the round's tokens while the
    extend graph is queued behind them; a row that does not ask gets ()."""
    from tandem.spec.accept import launch_greedy_accept

    eng = chain_engine if which == "chain" else tree_engine
    graphs = eng.spec_graphs
    ids, inp = _input(eng, bs, seed=40 + bs)
    verify = propose(eng.draft, inp, eng.spec)
    if drafts == "target":
        verify = _target_drafts(graphs, verify)
    assert graphs.can_extend(verify)
    out = graphs.verify(verify)
    logits, feats = out.logits.clone(), out.hidden.clone()
    asking = SamplingParams(max_new_tokens=8, logprobs=True, top_logprobs=TOP)
    params = [asking if r != 1 else SamplingParams(max_new_tokens=8) for r in range(bs)]
    pending = launch_greedy_accept(verify, logits, params)
    graphs.extend(verify, pending.num_accepted, pending.path, pending.bonus, feats)
    result = pending.result()
    ref = torch.log_softmax(logits.float(), dim=-1).cpu()  # [bs * N, V]
    n = verify.num_nodes
    for r in range(bs):
        lps = result.logprobs_of(r)
        if not params[r].logprobs:
            assert lps == ()
            continue
        toks, nodes = result.new_tokens[r], (0, *result.path_nodes[r])
        assert len(lps) == len(toks)
        for j, (tok, lp) in enumerate(zip(toks, lps)):
            row = ref[r * n + nodes[j]]  # [V] the distribution token j came from
            assert lp.token_id == tok
            assert lp.logprob == pytest.approx(row[tok].item(), abs=1e-5), (r, j)
            want, _ = row.topk(TOP)
            assert lp.top_logprobs == pytest.approx(want.tolist(), abs=1e-5), (r, j)
            assert [row[t].item() for t in lp.top_ids] == pytest.approx(lp.top_logprobs,
                                                                         abs=1e-5)
            # greedy: every emitted token (accepted draft or bonus) is its node's argmax
            assert lp.logprob == pytest.approx(lp.top_logprobs[0], abs=1e-5), (r, j)
    if drafts == "target":  # the accepted-draft positions were checked, not only bonuses
        # a chain takes every draft; a tree walks first children, which may end in a leaf
        depth = max(max(d) for d in verify.depths) if which == "chain" else 1
        assert all(len(p) >= depth for p in result.path_nodes), result.path_nodes
    _abort(eng, ids)


@pytest.mark.parametrize("which", ["chain", "tree"])
def test_graph_spec_logprobs_equal_plain_up_to_bf16(target, which):
    """End to end: a graph-captured SpecEngine's logprobs (logprobs=True, top_logprobs=5)
    equal the plain graph engine's, token for token up to a bf16 near-tie parting (checked as
    in the lossless test). bf16: a verify over N tokens and a 1-token decode round
    differently, so values agree within a stated margin: 2% of the position's top-K spread
    plus 0.05 nats."""
    spec = CHAIN if which == "chain" else TREE
    g = torch.Generator().manual_seed(6)
    prompts = [torch.randint(3, 49152, (9 + 11 * i,), generator=g).tolist() for i in range(4)]
    params = SamplingParams(max_new_tokens=20, ignore_eos=True, logprobs=True,
                            top_logprobs=TOP)
    plain = LLMEngine(_cfg(True), target[0])
    want = plain.generate(prompts, params)
    eng = SpecEngine(_cfg(True), spec, *target)
    assert eng.spec_graphs is not None
    got = eng.generate(prompts, params)
    for p, a, b in zip(prompts, got, want):
        assert len(a.logprobs) == len(a.output_ids) and len(b.logprobs) == len(b.output_ids)
        d = next((i for i, (x, y) in enumerate(zip(a.output_ids, b.output_ids)) if x != y),
                 len(a.output_ids))
        if d < len(a.output_ids):
            tie = parting_gap(plain, p + list(b.output_ids[:d]), (a.output_ids[d],
                                                                  b.output_ids[d]))
            assert tie.both_in_top2 and tie.rel_gap <= 0.02, (d, tie)
        for i, (x, y) in enumerate(zip(a.logprobs[:d], b.logprobs[:d])):
            tol = 0.05 + 0.02 * (y.top_logprobs[0] - y.top_logprobs[-1])
            assert x.token_id == y.token_id
            assert len(x.top_ids) == len(y.top_ids) == TOP
            assert x.logprob == pytest.approx(y.logprob, abs=tol), (i, x, y)
            assert x.top_logprobs == pytest.approx(y.top_logprobs, abs=tol), (i, x, y)


# ---- every k in CUDA graphs (spec/graph_set.py): the runners an adaptive policy's rounds replay


class _Schedule:
    """A k policy that follows `ks` step by step; every third step splits the batch (even rows
    draft, odd rows run the plain round), as tests/unit/test_spec_adaptive.py's ForcedK."""

    def __init__(self, ks) -> None:
        self.ks, self.step = list(ks), 0
        self.used: set[int] = set()

    def plan(self, req_ids, allow_split):
        from tandem.spec.adaptive import RoundPlan

        k = self.ks[self.step % len(self.ks)]
        self.step += 1
        split = allow_split and self.step % 3 == 0 and len(req_ids) > 1
        self.used.add(k)
        return RoundPlan(num_drafts=k, drafting=tuple(not split or r % 2 == 0
                                                      for r in range(len(req_ids))))

    def observe(self, req_id, num_drafts, num_accepted):
        pass

    def forget(self, req_id):
        pass


KS = (4, 0, 1, 0, 2, 3, 1, 4, 0, 3)


@pytest.fixture(scope="module")
def k_engine(target):
    return _planned(lambda: SpecEngine(_cfg(True), CHAIN, *target, policy=_Schedule(KS)))


@pytest.mark.parametrize("k", [0, 1, 2, 3])
@pytest.mark.parametrize("bs", [1, 3])  # 3 runs in the graphs of 4
def test_k_graphs_replay_equals_eager_and_propose_and_extend_agree(k_engine, k, bs):
    """The runner of k: drafting == eager drafting of k; the verify replay == the eager forward
    planned into the same buffers, bit for bit (k = 0: the decode planner); the draft-extend
    graph proposes the eager extend's top-k."""
    from tandem.spec.accept import launch_greedy_accept
    from tandem.spec.extend import draft_extend, make_extend_input

    eng = k_engine
    graphs = eng.k_graphs[k]
    assert graphs.num_nodes == k + 1 and graphs.memory is eng.spec_graphs.memory
    ids, inp = _input(eng, bs, seed=50 + 4 * k + bs)
    verify = propose(eng.draft, inp, eng.spec, k)
    if k >= 1:
        assert torch.equal(graphs.propose(inp).tokens, verify.tokens)
    rows = graphs.bucket(bs)
    got = graphs.verify(verify)
    got_logits, feats = got.logits.clone(), got.hidden.clone()
    slices = pad_fixed_slices(verify_slices(verify, masked=False), rows, k + 1,
                              eng.cfg.page_size, False)
    lay = build_metadata(slices, eng.cfg.page_size, DEV)
    plan = graphs._verify_planner.plan(lay.attn)
    ids_in = torch.zeros(rows * (k + 1), dtype=torch.int64, device=DEV)
    ids_in[: verify.tokens.numel()] = verify.tokens.reshape(-1)
    eager = eng.runner.forward_planned(ids_in, lay.positions, plan, None, eng.capture)
    m = got_logits.shape[0]
    assert torch.equal(got_logits, eager.logits[:m]) and torch.equal(feats, eager.hidden[:m])
    pending = launch_greedy_accept(verify, got_logits)
    result = pending.result()
    ext = graphs.extend(verify, pending.num_accepted, pending.path, pending.bonus, feats)
    want = draft_extend(eng.draft, make_extend_input(verify, result, feats), eng.spec.topk)
    assert torch.equal(ext.topk_ids, want.topk_ids)
    _abort(eng, ids)


def test_adaptive_schedule_with_graphs_is_lossless_up_to_bf16_near_ties(target, monkeypatch):
    """k changes every step (0..4, split steps too); every round runs in the graphs of its k
    (no eager draft-extend; eager drafting only proposes k = 0's root) and the output equals
    plain greedy's up to bf16 near-ties. (FlashInfer has no float32 kernels: the float32
    equality of the same schedule is test_float32_k_schedule_equals_plain below, with the
    runners in eager mode, and tests/unit/test_spec_k_graphs.py on the CPU.)"""
    import tandem.spec.engine as spec_engine

    g = torch.Generator().manual_seed(8)
    prompts = [torch.randint(3, 49152, (7 + 13 * i,), generator=g).tolist() for i in range(5)]
    params = SamplingParams(max_new_tokens=32, ignore_eos=True)
    plain = LLMEngine(_cfg(True), target[0])
    want = [c.output_ids for c in plain.generate(prompts, params)]
    policy = _Schedule(KS)
    eng = SpecEngine(_cfg(True), CHAIN, *target, policy=policy)
    assert sorted(eng.k_graphs) == [0, 1, 2, 3]
    replays = {k: 0 for k in range(5)}
    for k, runner in {**eng.k_graphs, 4: eng.spec_graphs}.items():
        orig = runner.extend

        def spy(*a, orig=orig, k=k):
            replays[k] += 1
            return orig(*a)

        monkeypatch.setattr(runner, "extend", spy)
    eager_ks = []
    real = spec_engine.propose
    monkeypatch.setattr(spec_engine, "propose",
                        lambda d, i, s, k: eager_ks.append(k) or real(d, i, s, k))
    monkeypatch.setattr(spec_engine, "draft_extend", None)  # an eager extend would raise
    got = [c.output_ids for c in eng.generate(prompts, params)]
    assert policy.used == set(KS) and all(replays[k] > 0 for k in range(5)), replays
    assert set(eager_ks) <= {0}
    assert_parts_only_at_near_ties(plain, prompts, got, want)


class _EagerPlanner:
    """A fixed-buffer planner stand-in over the torch reference backend (float32): the runners
    in eager mode (capture(eager=True)) run their fixed-shape bodies at every replay."""

    def __init__(self, backend) -> None:
        self.backend = backend

    def plan(self, meta):
        return self.backend.plan(meta)


def _float32_smollm2():
    """(cfg, model, head): SmolLM2-shaped dummy target and head in float32 on the GPU, torch
    attention, no decode graphs (the speculative runners are attached eagerly)."""
    cfg = EngineConfig(model="smollm2-135m", load_format="dummy", device="cuda",
                       dtype="float32", attention_backend="torch", cuda_graphs=False,
                       max_num_seqs=8, max_model_len=1024, kv_cache_bytes=512 << 20)
    model_cfg, path = resolve_model(cfg)
    model = build_model(model_cfg, path, cfg, ParallelContext(), 1024)
    head = dummy_head(DraftHeadConfig.like_target(model_cfg), model, DTYPES["float32"], DEV,
                      1024)
    return cfg, model, head


def _eager_chain_runner(eng, monkeypatch, device_metadata: bool | None = None):
    """The engine's chain runner in eager mode, planning through `_EagerPlanner`."""
    from tandem.spec.cuda_graphs import SpecGraphRunner

    backend = eng.runner.backend
    monkeypatch.setattr(backend, "graph_decode_planner",
                        lambda bs, pages: _EagerPlanner(backend), raising=False)
    monkeypatch.setattr(backend, "graph_prefill_planner",
                        lambda *a, **kw: _EagerPlanner(backend), raising=False)
    eng.spec_graphs = SpecGraphRunner(eng.runner, eng.draft, CHAIN, (1, 2, 4),
                                      1024 + CHAIN.slots_per_round, eng.capture,
                                      device_metadata=device_metadata)
    eng.spec_graphs.capture(eager=True)
    return eng.spec_graphs


def test_float32_k_schedule_equals_plain(target, monkeypatch):
    """float32 on the GPU (torch attention, Triton acceptance kernels): the runner of every k
    in eager mode, under the schedule with splits, gives plain greedy's tokens exactly."""
    from tandem.spec.graph_set import capture_k_graphs, policy_ks

    cfg, model, head = _float32_smollm2()
    g = torch.Generator().manual_seed(9)
    prompts = [torch.randint(3, 49152, (7 + 13 * i,), generator=g).tolist() for i in range(4)]
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    want = [c.output_ids for c in LLMEngine(cfg, model).generate(prompts, params)]
    eng = SpecEngine(cfg, CHAIN, model, head, policy=_Schedule(KS))
    full = _eager_chain_runner(eng, monkeypatch)
    eng.k_graphs = capture_k_graphs(full, policy_ks(CHAIN), eager=True)
    got = [c.output_ids for c in eng.generate(prompts, params)]
    assert got == want


@pytest.mark.parametrize("device_metadata", [False, True], ids=["planned", "device-metadata"])
def test_float32_drafting_ahead_equals_plain_and_drafting_in_the_step(target, monkeypatch,
                                                                     device_metadata):
    """float32 on the GPU, the chain runner in eager mode: drafting ahead (queued on the stream
    before the round's host read, spec/ahead.py) gives plain greedy's tokens exactly, and its
    rounds verify the same drafts as drafting in the step; also with verify and extend through
    the device-decode kernel (device metadata, the Triton kernel over k+1 rows per request),
    where the next round's verify is queued ahead too."""
    cfg, model, head = _float32_smollm2()
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(3, 49152, (5 + 11 * i,), generator=g).tolist() for i in range(3)]
    params = SamplingParams(max_new_tokens=20, ignore_eos=True)
    want = [c.output_ids for c in LLMEngine(cfg, model).generate(prompts, params)]
    verified = {}
    for ahead in (True, False):
        eng = SpecEngine(cfg, CHAIN, model, head)
        _eager_chain_runner(eng, monkeypatch, device_metadata)
        eng.set_draft_ahead(ahead)
        eng.draft_ahead.verify_batch = 4  # verify ahead too, where the metadata is the device's
        eng.merge_arrivals = False  # every verify through `_verify_forward` (on: no graphs here)
        seen = verified[ahead] = []
        orig = eng._verify_forward
        monkeypatch.setattr(eng, "_verify_forward",
                            lambda v, orig=orig, seen=seen: seen.append(v.tokens.cpu()) or orig(v))
        assert [c.output_ids for c in eng.generate(prompts, params)] == want
        assert (eng.draft_ahead.used > 0) == ahead
        assert (eng.draft_ahead.verify_used > 0) == (ahead and device_metadata)
    assert len(verified[True]) == len(verified[False])
    assert all(torch.equal(a, b) for a, b in zip(verified[True], verified[False]))


def test_draft_prefill_graphs_seed_like_the_eager_draft_and_stay_lossless(target, monkeypatch):
    """Draft prefill graphs (spec/draft_prefill.py, on by default): a prompt step's draft runs
    in a graph over the target graph's outputs. Its seeds are the eager draft's up to bf16
    (another attention kernel), and greedy output is plain's up to bf16 near-ties."""
    g = torch.Generator().manual_seed(8)
    prompts = [torch.randint(3, 49152, (9 + 17 * i,), generator=g).tolist() for i in range(4)]
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    engines = {}
    for flag in ("0", "1"):
        monkeypatch.setenv("TANDEM_DRAFT_PREFILL_GRAPHS", flag)
        engines[flag] = eng = SpecEngine(_cfg(True), CHAIN, *target)
        assert (eng.draft_prefill is not None) == (flag == "1")
        for i, p in enumerate(prompts):
            eng.add_request(p, params, req_id=f"p{i}")
        eng.step()  # the prompt step: every prompt completes, every request gets its seed
    seeds = [e.spec_scheduler.seeds for e in engines.values()]
    assert set(seeds[0]) == set(seeds[1]) == {f"p{i}" for i in range(len(prompts))}
    for rid in seeds[0]:
        torch.testing.assert_close(seeds[1][rid].hidden.float(), seeds[0][rid].hidden.float(),
                                   rtol=0.05, atol=0.05)
    for eng in engines.values():
        for i in range(len(prompts)):
            eng.abort(f"p{i}")
        eng.step()
    plain = LLMEngine(_cfg(True), target[0])
    want = [c.output_ids for c in plain.generate(prompts, params)]
    got = [c.output_ids for c in engines["1"].generate(prompts, params)]
    assert_parts_only_at_near_ties(plain, prompts, got, want)


def _sampled_params(n: int) -> list[SamplingParams]:
    """Seeded sampled requests (top_k 8: the dummy head's drafts are sometimes among the
    target's likely tokens, so some are accepted) and one greedy request beside them."""
    return [SamplingParams(max_new_tokens=20, ignore_eos=True, temperature=1.0, top_k=8,
                           seed=40 + i) for i in range(n - 1)] + [
        SamplingParams(max_new_tokens=20, ignore_eos=True)]


def test_float32_sampled_rounds_through_the_runner_equal_eager_rounds(target, monkeypatch):
    """float32 on the GPU: seeded sampled chains accept on the device (spec/device_accept.py)
    and draft-extend through the runner (eager mode, planned like the eager forward), with
    the next round drafted ahead or not: the outputs of the engine without the runner (the
    same acceptance, the same draws, on the CUDA generators)."""
    cfg, model, head = _float32_smollm2()
    g = torch.Generator().manual_seed(12)
    prompts = [torch.randint(3, 49152, (6 + 9 * i,), generator=g).tolist() for i in range(3)]
    params = _sampled_params(3)
    want = [c.output_ids for c in SpecEngine(cfg, CHAIN, model, head).generate(prompts, params)]
    for ahead in (True, False):
        eng = SpecEngine(cfg, CHAIN, model, head)
        _eager_chain_runner(eng, monkeypatch, device_metadata=False)
        eng.set_draft_ahead(ahead)
        assert [c.output_ids for c in eng.generate(prompts, params)] == want
        assert (eng.draft_ahead.used > 0) == ahead


def test_sampled_rounds_in_graphs_are_reproducible_and_draft_ahead(target):
    """bf16, captured graphs: seeded sampled requests give the same tokens in two engines,
    their rounds drafted ahead (no host walk, no eager draft-extend any more)."""
    g = torch.Generator().manual_seed(13)
    prompts = [torch.randint(3, 49152, (8 + 7 * i,), generator=g).tolist() for i in range(4)]
    params = _sampled_params(4)
    runs = []
    for _ in range(2):
        eng = SpecEngine(_cfg(True), CHAIN, *target)
        assert eng.spec_graphs is not None
        runs.append([c.output_ids for c in eng.generate(prompts, params)])
        assert eng.draft_ahead.used > 0
    assert runs[0] == runs[1]


def _arrivals(eng, prompts, params, every: int = 2):
    """The prompts arriving one every `every` steps (most next to a round): outputs in order."""
    tokens, ids, pending, steps = {}, [], list(prompts), 0
    while pending or eng.has_unfinished():
        if pending and steps % every == 0:
            ids.append(eng.add_request(pending.pop(0), params))
        for out in eng.step():
            tokens.setdefault(out.req_id, []).extend(out.new_token_ids)
        steps += 1
    return [tokens[i] for i in ids]


def _count_merged(eng, monkeypatch) -> list:
    seen = []
    real = eng._merged_prefill_step
    monkeypatch.setattr(eng, "_merged_prefill_step",
                        lambda *a, **kw: seen.append(1) or real(*a, **kw))
    return seen


def test_float32_merged_arrivals_equal_plain(target, monkeypatch):
    """float32 on the GPU (torch attention, the chain runner eager, device metadata): prompts
    merged into the round's verify forward (TANDEM_MERGED_ARRIVALS) give plain greedy's
    tokens exactly."""
    cfg, model, head = _float32_smollm2()
    g = torch.Generator().manual_seed(14)
    prompts = [torch.randint(3, 49152, (5 + 9 * i,), generator=g).tolist() for i in range(5)]
    params = SamplingParams(max_new_tokens=20, ignore_eos=True)
    want = [c.output_ids for c in LLMEngine(cfg, model).generate(prompts, params)]
    eng = SpecEngine(cfg, CHAIN, model, head)
    _eager_chain_runner(eng, monkeypatch, device_metadata=True)
    eng.merge_arrivals = True
    seen = _count_merged(eng, monkeypatch)
    assert [tuple(t) for t in _arrivals(eng, prompts, params)] == [tuple(w) for w in want]
    assert seen


def test_merged_arrivals_in_graphs_stay_lossless_up_to_bf16_near_ties(target, monkeypatch):
    """bf16, captured graphs: the merged forward replays a prompt graph (prompt rows, then
    the chains' rows); output parts from plain only at near-ties."""
    g = torch.Generator().manual_seed(15)
    prompts = [torch.randint(3, 49152, (9 + 13 * i,), generator=g).tolist() for i in range(5)]
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    eng = SpecEngine(_cfg(True), CHAIN, *target)
    eng.merge_arrivals = True
    # A round's verify is queued ahead in the step before when no prompt is known to wait;
    # one queued and taken rides in no forward. Verifying ahead off, every arrival step here
    # merges (in service, the arrival after a request ended: the queued round is dropped).
    eng.draft_ahead.verify_batch = 0
    seen = _count_merged(eng, monkeypatch)
    replays = []
    real = eng.graphs.run_forward
    monkeypatch.setattr(eng.graphs, "run_forward",
                        lambda *a, **kw: replays.append(1) or real(*a, **kw))
    got = _arrivals(eng, prompts, params)
    assert seen and len(replays) >= len(seen)
    plain = LLMEngine(_cfg(True), target[0])
    want = [c.output_ids for c in plain.generate(prompts, params)]
    assert_parts_only_at_near_ties(plain, prompts, got, want)
