"""Lossless speculative decoding (docs/architecture.md, "Lossless"): at temperature 0 the
SpecEngine emits exactly the non-speculative engine's tokens, in float32, for every batch size,
chain and tree, EAGLE and EAGLE-3 heads, and every acceptance pattern -- the natural ones of a
random head on a target restricted to a few live tokens, and forced ones from scripted
drafts."""

from __future__ import annotations

from functools import cache

import pytest
from spec_helpers import (
    LIVE,
    ScriptedSpecEngine,
    assert_pages_free,
    chain,
    comb,
    comb_path,
    engine_cfg,
    greedy,
    one_thread,  # noqa: F401 (autouse fixture)
    prompts,
    reference,
    run_ids,
    scripted_engine,
    tiny_head,
    tiny_target,
)

from tandem.engine import SamplingParams
from tandem.spec import SpecConfig, SpecEngine

CONFIGS = {
    "chain1": SpecConfig(num_steps=1),
    "chain2": SpecConfig(num_steps=2),
    "chain3": SpecConfig(num_steps=3),
    "chain4": SpecConfig(num_steps=4),
    "tree2x2n4": SpecConfig(num_steps=2, topk=2, num_draft_tokens=4),
    "tree3x3n6": SpecConfig(num_steps=3, topk=3, num_draft_tokens=6),
    "tree4x2n9": SpecConfig(num_steps=4, topk=2),
}
ARCHS = ("llama", "qwen3", "mixtral")
KINDS = ("eagle", "eagle3", "eagle-subset")
BATCH_SIZES = (1, 3, 8)

CASES = [pytest.param(arch, kind, name, bs, id=f"{arch}-{kind}-{name}-bs{bs}")
         for arch in ARCHS for kind in KINDS for name in CONFIGS for bs in BATCH_SIZES]
# A two-layer EAGLE head (each layer its own draft KV layer), on one architecture.
CASES += [pytest.param("llama", "eagle-2layer", name, bs, id=f"llama-eagle-2layer-{name}-bs{bs}")
          for name in CONFIGS for bs in BATCH_SIZES]


@cache
def _target(arch: str, live: bool = True):
    return tiny_target(arch, live=LIVE if live else None)


@cache
def _case_prompts(bs: int) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(p) for p in prompts(bs, seed=100 + bs))


def _case_params(bs: int) -> list[SamplingParams]:
    # Different lengths: requests leave the batch at different rounds, so the batch shrinks.
    return [greedy(24 - (5 * i) % 13) for i in range(bs)]


@cache
def _reference(arch: str, bs: int) -> tuple[tuple[int, ...], ...]:
    got = reference(_target(arch), _case_prompts(bs), _case_params(bs),
                    max_num_batched_tokens=16)
    return tuple(c.output_ids for c in got)


@pytest.mark.parametrize("arch, kind, config, bs", CASES)
def test_greedy_spec_equals_plain(arch, kind, config, bs):
    model = _target(arch)
    spec = CONFIGS[config]
    # A 16-token budget splits longer prompts into chunks that share steps with spec rounds.
    eng = SpecEngine(engine_cfg(max_num_batched_tokens=16), spec, model, tiny_head(model, kind))
    got = eng.generate(_case_prompts(bs), _case_params(bs))
    assert tuple(c.output_ids for c in got) == _reference(arch, bs)
    assert_pages_free(eng)
    st = eng.spec_stats
    assert st.num_rounds > 0
    # Drafting really ran both ways: some rounds accepted drafts, some rejected some.
    assert st.num_tokens < st.num_rounds * (spec.num_steps + 1), st  # not all accepted
    if bs > 1:  # enough rounds that a random head on the live vocabulary is sometimes right
        assert st.num_tokens > st.num_rounds, st


def test_tree_drafting_accepts_non_first_siblings():
    """With real tree drafting the accepted path is sometimes not nodes 1, 2, 3 (so the
    target KV is compacted) -- and the output is still exact."""
    model = _target("llama")
    spec = SpecConfig(num_steps=3, topk=3, num_draft_tokens=7)
    eng = ScriptedSpecEngine(engine_cfg(), spec, model, tiny_head(model, "eagle"), script=None)
    ps = [list(p) for p in _case_prompts(8)]
    _, reqs = run_ids(eng, ps, greedy(16))
    ref = reference(model, ps, greedy(16))
    assert [tuple(r.output_ids) for r in reqs] == [c.output_ids for c in ref]
    paths = [p for _, p, _ in eng.rounds]
    assert any(p and p != tuple(range(1, len(p) + 1)) for p in paths), paths
    assert_pages_free(eng)


def test_preemption_under_page_pressure_stays_exact():
    """A spec round reserves slots past the committed tokens; when pages run out, later
    requests are preempted, lose their seeds, are prefilled again -- and nothing changes."""
    model = _target("llama")
    ps = prompts(8, seed=7, lo=6, hi=20)
    params = greedy(14)
    ref = reference(model, ps, params)
    eng = SpecEngine(engine_cfg(num_pages=26), SpecConfig(num_steps=3, topk=2), model,
                     tiny_head(model, "eagle"))
    got = eng.generate(ps, params)
    assert [c.output_ids for c in got] == [c.output_ids for c in ref]
    assert eng.scheduler.num_preemptions > 0  # the pressure was real
    assert_pages_free(eng)


def test_top_k_1_sampling_equals_greedy():
    """temperature > 0 with top_k = 1 makes the target distribution one-hot, so the rejection
    sampler (a different code path from greedy acceptance) must reproduce greedy output."""
    model = _target("qwen3")
    ps = [list(p) for p in _case_prompts(3)]
    ref = reference(model, ps, greedy(16))
    for spec in (SpecConfig(num_steps=3), SpecConfig(num_steps=3, topk=2, num_draft_tokens=5)):
        eng = SpecEngine(engine_cfg(), spec, model, tiny_head(model, "eagle"))
        got = eng.generate(ps, SamplingParams(max_new_tokens=16, ignore_eos=True, temperature=0.7,
                                              top_k=1, seed=3))
        assert [c.output_ids for c in got] == [c.output_ids for c in ref]
        assert eng.spec_stats.mean_acceptance_length > 1.0
        assert_pages_free(eng)


# ---- forced acceptance patterns (scripted drafts) ---------------------------------------------

N_NEW = 17  # tokens per request in the scripted tests


@cache
def _full_vocab_refs(bs: int) -> tuple[tuple[tuple[int, ...], ...], tuple[tuple[int, ...], ...]]:
    """(prompts, greedy continuations long enough for any draft of the last round)."""
    ps = tuple(tuple(p) for p in prompts(bs, seed=200 + bs))
    got = reference(_target("llama", live=False), ps, greedy(N_NEW + 8))
    return ps, tuple(c.output_ids for c in got)


def _run_scripted(spec: SpecConfig, bs: int, tree_of, kind: str = "eagle"):
    """tree_of(r, continuation) -> Tree for request r. Returns (engine, requests, refs)."""
    model = _target("llama", live=False)
    ps, refs = _full_vocab_refs(bs)

    def script(rid: str, out: list[int]):
        r = int(rid.split("-")[1])
        assert list(refs[r][: len(out)]) == out  # the committed tokens are the reference's
        return tree_of(r, refs[r][len(out):])

    eng = scripted_engine(model, tiny_head(model, kind, live=None), spec, script)
    _, reqs = run_ids(eng, [list(p) for p in ps], greedy(N_NEW))
    assert [tuple(r.output_ids) for r in reqs] == [ref[:N_NEW] for ref in refs]
    assert_pages_free(eng)
    return eng, reqs, refs


@pytest.mark.parametrize("kind", KINDS)
def test_all_drafts_correct_gives_tau_k_plus_1(kind):
    k = 4
    eng, _, _ = _run_scripted(SpecConfig(num_steps=k), 3, lambda r, ref: chain(ref, k, k),
                                 kind)
    assert all(p == (1, 2, 3, 4) for _, p, _ in eng.rounds)
    assert eng.spec_stats.mean_acceptance_length == k + 1
    assert eng.spec_stats.per_position() == [1.0] * k
    # 1 token from prefill, then rounds of k + 1: the last round is cut by max_new_tokens.
    assert len(eng.rounds) == 3 * -(-(N_NEW - 1) // (k + 1))


def test_no_draft_correct_gives_tau_1():
    eng, _, _ = _run_scripted(SpecConfig(num_steps=4), 3, lambda r, ref: chain(ref, 4, 0))
    assert all(p == () for _, p, _ in eng.rounds)
    assert eng.spec_stats.mean_acceptance_length == 1.0
    assert len(eng.rounds) == 3 * (N_NEW - 1)


@pytest.mark.parametrize("m", [1, 2, 3])
def test_first_m_drafts_correct(m):
    eng, _, _ = _run_scripted(SpecConfig(num_steps=4), 3, lambda r, ref: chain(ref, 4, m))
    assert all(p == tuple(range(1, m + 1)) for _, p, _ in eng.rounds)
    assert eng.spec_stats.mean_acceptance_length == m + 1
    assert eng.spec_stats.per_position() == [1.0] * m + [0.0] * (4 - m)


def test_different_acceptance_per_request_in_one_batch():
    ms = [0, 4, 1, 3, 2, 4, 0, 2]
    eng, _, _ = _run_scripted(SpecConfig(num_steps=4), len(ms),
                                 lambda r, ref: chain(ref, 4, ms[r]))
    for r, m in enumerate(ms):
        paths = eng.paths_of(f"req-{r}")
        assert paths and all(p == tuple(range(1, m + 1)) for p in paths), (r, paths)
        assert len(paths) == -(-(N_NEW - 1) // (m + 1))


TREE_SPEC = SpecConfig(num_steps=3, topk=3)  # reserves 10 slots; the comb trees use 8
TREE_PATTERNS = [  # (sibling index per level, levels with a correct child)
    ((1, 1, 1), 3),  # path 2, 5, 7: every accepted node is a later sibling
    ((0, 0, 0), 3),  # path 1, 4, 6: first siblings, but the decoy shifts levels 2 and 3
    ((0, 1, 0), 2),  # partial: path 1, 5
    ((1, 0, 1), 1),  # partial: path 2
    ((1, 1, 0), 0),  # none
]


@pytest.mark.parametrize("sibling, m", TREE_PATTERNS)
def test_tree_pattern_compacts_the_accepted_path(sibling, m):
    eng, _, _ = _run_scripted(TREE_SPEC, 3, lambda r, ref: comb(ref, 3, 2, m, sibling))
    want = comb_path(3, 2, m, sibling)
    assert len(want) == m
    assert all(p == want for _, p, _ in eng.rounds), eng.rounds
    assert eng.spec_stats.mean_acceptance_length == m + 1


@pytest.mark.parametrize("kind", KINDS)
def test_tree_patterns_differ_per_request_in_one_batch(kind):
    pats = TREE_PATTERNS + TREE_PATTERNS[:3]
    eng, _, _ = _run_scripted(TREE_SPEC, len(pats),
                              lambda r, ref: comb(ref, 3, 2, pats[r][1], pats[r][0]), kind)
    for r, (sibling, m) in enumerate(pats):
        paths = eng.paths_of(f"req-{r}")
        assert paths and all(p == comb_path(3, 2, m, sibling) for p in paths), (r, paths)
