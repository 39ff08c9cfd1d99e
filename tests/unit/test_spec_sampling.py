"""Sampling fidelity of verification (docs/architecture.md, "Lossless", with sampling): on a toy
vocabulary, the tokens `accept` emits follow the target distribution `target_probs` -- the first
emitted token, and each later one conditioned on the path so far -- for chains and trees, with
temperature / top-k / top-p / min-p, including drafts the target gives probability 0; and so do
the chains accepted on the device (a GPU's path, spec/device_accept.py).

Chi-square goodness of fit with a fixed seed. `test_the_check_catches_wrong_rules` runs the
same check against plausible wrong acceptance rules and requires it to reject each of them, so
the sample size is known to be large enough."""

from __future__ import annotations

import importlib
from collections import Counter

import pytest
import torch
from spec_helpers import one_thread  # noqa: F401 (autouse fixture)

from tandem.engine import SamplingParams, target_probs
from tandem.spec import VerifyInput, accept
from tandem.spec.device_accept import launch_sampled_chain_accept

# The module, not the function of the same name that tandem.spec exports.
accept_mod = importlib.import_module("tandem.spec.accept")

V = 6  # toy vocabulary
SAMPLES = 2000
ALPHA = 1e-3  # a correct rule fails a given check with this probability (fixed seed: never)

# Node logits shared by every tree below (row j = the target's logits after node j).
LOGITS = torch.tensor([
    [2.0, 1.6, 0.9, 0.3, -0.5, -1.0],
    [0.1, 1.5, -0.3, 1.1, 0.6, -2.0],
    [1.2, -0.4, 0.8, 0.0, 1.4, 0.2],
    [-1.0, 0.3, 0.7, 1.9, 0.2, 0.5],
    [0.4, 0.4, 1.0, -0.6, 0.9, 1.3],
])

# (parents incl. root, draft tokens incl. the root's) -- children are in draft-score order.
CHAIN = ((-1, 0, 1, 2), (5, 0, 1, 3))
TREE = ((-1, 0, 0, 1, 2), (5, 0, 1, 3, 4))  # root -> {0, 1}; 0 -> 3; 1 -> 4
TREE3 = ((-1, 0, 0, 0, 2), (5, 4, 1, 0, 2))  # 3 siblings; the first has p = 0 under top_k 3

PARAMS = {
    "t1": SamplingParams(temperature=1.0),
    "t0.7-topk4": SamplingParams(temperature=0.7, top_k=4),
    "t1.3-topp0.8": SamplingParams(temperature=1.3, top_p=0.8),
    "t0.9-topk3-topp0.9-minp0.1": SamplingParams(temperature=0.9, top_k=3, top_p=0.9, min_p=0.1),
}


def _depths(parents):
    d = []
    for p in parents:
        d.append(0 if p < 0 else d[p] + 1)
    return tuple(d)


def _emit(tree, params: SamplingParams, seed: int, n: int = SAMPLES,
          device: bool = False) -> list[tuple[int, ...]]:
    """`accept` on n copies of one tree (one batch): the emitted tokens of each copy. device:
    a chain accepted as on a GPU (spec/device_accept.py; on the CPU `accept` walks it)."""
    parents, tokens = tree
    num = len(parents)
    verify = VerifyInput(page_ids=((),) * n, num_cached=(0,) * n,
                         tokens=torch.tensor([tokens] * n), parents=(parents,) * n,
                         depths=(_depths(parents),) * n)
    logits = LOGITS[:num].repeat(n, 1)  # [n * num, V], request-major
    gen = torch.Generator().manual_seed(seed)
    if device:
        result = launch_sampled_chain_accept(verify, logits, [params] * n, [gen] * n).result()
    else:
        result = accept(verify, logits, [params] * n, [gen] * n)
    return list(result.new_tokens)


def _chi2_pvalue(counts: Counter, probs: torch.Tensor) -> float:
    """Goodness of fit of `counts` to `probs`; a token of probability 0 seen once fails."""
    n = sum(counts.values())
    support = [t for t in range(V) if probs[t] > 0]
    outside = {t: c for t, c in counts.items() if probs[t] == 0}
    assert not outside, f"emitted tokens the target gives probability 0: {outside}"
    if len(support) == 1:
        return 1.0
    exp = probs[support].double() * n
    obs = torch.tensor([counts.get(t, 0) for t in support], dtype=torch.float64)
    stat = float(((obs - exp) ** 2 / exp).sum())
    df = len(support) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2.0, dtype=torch.float64),
                                         torch.tensor(stat / 2.0, dtype=torch.float64)))


def _fidelity_pvalues(tree, params: SamplingParams, seed: int,
                      device: bool = False) -> dict[str, float]:
    """p-values of: the first emitted token ~ p(root); the token after each accepted draft
    node c ~ p(c), conditioned on the walk reaching c. Nodes reached too rarely are skipped."""
    parents, tokens = tree
    emitted = _emit(tree, params, seed, device=device)
    kids = accept_mod.children_of(parents)
    out = {}

    def check(node: int, prefix: tuple[int, ...]):
        # Copies whose emitted tokens start with `prefix` (the tokens of the path to node).
        n = len(prefix)
        rows = [e[n] for e in emitted if e[:n] == prefix and len(e) > n]
        if len(rows) < 200:
            return
        out[f"node{node}"] = _chi2_pvalue(Counter(rows), target_probs(LOGITS[node], params))
        for c in kids[node]:
            check(c, prefix + (tokens[c],))

    check(0, ())
    # Every copy emits at least one token, and never more than the path depth + 1.
    assert all(1 <= len(e) <= max(_depths(parents)) + 1 for e in emitted)
    return out


@pytest.mark.parametrize("params", PARAMS.values(), ids=PARAMS.keys())
@pytest.mark.parametrize("tree", [CHAIN, TREE, TREE3], ids=["chain", "tree", "tree3"])
def test_emitted_tokens_follow_the_target_distribution(tree, params):
    pvalues = _fidelity_pvalues(tree, params, seed=1234)
    assert "node0" in pvalues and len(pvalues) >= 2, pvalues  # root and a deeper node checked
    bad = {k: p for k, p in pvalues.items() if p < ALPHA}
    assert not bad, f"emitted tokens do not follow target_probs: {pvalues}"


@pytest.mark.parametrize("params", PARAMS.values(), ids=PARAMS.keys())
def test_chains_accepted_on_the_device_follow_the_target_distribution(params):
    pvalues = _fidelity_pvalues(CHAIN, params, seed=1234, device=True)
    assert "node0" in pvalues and len(pvalues) >= 2, pvalues
    bad = {k: p for k, p in pvalues.items() if p < ALPHA}
    assert not bad, f"emitted tokens do not follow target_probs: {pvalues}"


def test_zero_probability_drafts_are_never_accepted():
    """Under top_k = 3 the first draft of TREE3 (token 4) has target probability 0."""
    params = SamplingParams(temperature=1.0, top_k=3)
    assert target_probs(LOGITS[0], params)[4] == 0
    emitted = _emit(TREE3, params, seed=5)
    assert all(e[0] != 4 for e in emitted)


# ---- the check has the power to catch wrong rules -------------------------------------------


def _walk_no_renormalize(tokens, logits, kids, params, gen):
    """Wrong: zeroes a rejected draft's probability but does not renormalize."""
    node, path = 0, []
    while True:
        p = target_probs(logits[node], params)
        moved = False
        for c in kids[node]:
            if torch.rand((), generator=gen) < p[tokens[c]]:
                path.append(c)
                node, moved = c, True
                break
            p = p.clone()
            p[tokens[c]] = 0.0
        if not moved:
            return path, int(torch.multinomial(p, 1, generator=gen)[0])


def _walk_no_residual(tokens, logits, kids, params, gen):
    """Wrong: after rejections, draws the bonus token from the unmodified target p."""
    node, path = 0, []
    while True:
        p = target_probs(logits[node], params)
        nxt = next((c for c in kids[node] if torch.rand((), generator=gen) < p[tokens[c]]), None)
        if nxt is None:
            return path, int(torch.multinomial(p, 1, generator=gen)[0])
        path.append(nxt)
        node = nxt


def _walk_wrong_q(tokens, logits, kids, params, gen):
    """Wrong: classic min(1, p/q) acceptance with residual max(p - q, 0), but with q the
    uniform distribution instead of the (deterministic) draft that proposed the token."""
    q = torch.full((V,), 1.0 / V)
    node, path = 0, []
    while True:
        p = target_probs(logits[node], params)
        moved = False
        for c in kids[node]:
            t = tokens[c]
            if torch.rand((), generator=gen) < min(1.0, float(p[t] / q[t])):
                path.append(c)
                node, moved = c, True
                break
            p = torch.clamp(p - q, min=0.0)
            p = p / p.sum()
        if not moved:
            return path, int(torch.multinomial(p, 1, generator=gen)[0])


def _walk_parent_logits(tokens, logits, kids, params, gen):
    """Wrong: keeps using the root's distribution below the first accepted draft."""
    node, path = 0, []
    while True:
        p = target_probs(logits[0], params)
        moved = False
        for c in kids[node]:
            if torch.rand((), generator=gen) < p[tokens[c]]:
                path.append(c)
                node, moved = c, True
                break
            p = p.clone()
            p[tokens[c]] = 0.0
            p = p / p.sum()
        if not moved:
            return path, int(torch.multinomial(p, 1, generator=gen)[0])


WRONG_RULES = [_walk_no_renormalize, _walk_no_residual, _walk_wrong_q, _walk_parent_logits]


@pytest.mark.parametrize("wrong", WRONG_RULES, ids=lambda f: f.__name__)
def test_the_check_catches_wrong_rules(wrong, monkeypatch):
    """The same checks, at the same sample size, reject each wrong rule (p < 1e-6 on some
    tree, where a correct rule stays above ALPHA on all of them)."""
    def walk(tokens, logits, kids, params, gen, lps=None):  # the walk's signature
        return (*wrong(tokens, logits, kids, params, gen), None)

    monkeypatch.setattr(accept_mod, "_walk_sampled", walk)
    configs = [(tree, params) for tree in (TREE, CHAIN, TREE3) for params in PARAMS.values()]
    worst = 1.0
    for tree, params in configs:  # stop at the first tree that exposes it
        worst = min(worst, *_fidelity_pvalues(tree, params, seed=1234).values())
        if worst < 1e-6:
            break
    assert worst < 1e-6, f"{wrong.__name__} slipped through (worst p-value {worst:.2e})"
