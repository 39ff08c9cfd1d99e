"""The speculative bookkeeping kernels (tandem/spec/kernels): each Triton kernel equals its
torch twin and the Python logic of the round (accept._walk_greedy, make_extend_input /
draft_extend's rows, tree_mask + build_metadata's packing) on many random cases, on the CPU
through TRITON_INTERPRET=1. tests/gpu/test_spec_graphs.py runs the engine on CUDA (where the
Triton kernels are dispatched)."""

from __future__ import annotations

import os
import random

import pytest
import torch

from tandem.engine.attention.metadata import SeqSlice, build_metadata
from tandem.engine.attention.metadata import tree_mask as ref_tree_mask
from tandem.spec.accept import _walk_greedy, children_of
from tandem.spec.kernels import torch_ops

if torch.cuda.is_available():  # the interpreter flag is process-wide: tests/gpu covers CUDA
    pytest.skip("CUDA machine: tests/gpu runs the compiled kernels", allow_module_level=True)
os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")
pytest.importorskip("numpy")
if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("triton was imported before TRITON_INTERPRET could be set", allow_module_level=True)

from tandem.spec.kernels import triton_ops  # noqa: E402


def _random_trees(rng: random.Random, b: int, n: int, chain: bool, vocab: int):
    """parents [B, N] (a chain, or random parents before each node), tokens from a small
    vocabulary (so many nodes match the target), depths."""
    parents, depths = [], []
    for _ in range(b):
        par = [-1] + ([j - 1 for j in range(1, n)] if chain
                      else [rng.randrange(j) for j in range(1, n)])
        dep = [0] * n
        for j in range(1, n):
            dep[j] = dep[par[j]] + 1
        parents.append(par)
        depths.append(dep)
    tokens = [[rng.randrange(vocab) for _ in range(n)] for _ in range(b)]
    target = [[rng.randrange(vocab) for _ in range(n)] for _ in range(b)]
    return parents, depths, tokens, target


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("chain", [True, False])
def test_greedy_accept_equals_twin_and_walk(seed, chain):
    rng = random.Random(seed * 2 + chain)
    b, n = rng.randint(1, 9), rng.randint(1, 17)
    parents, depths, tokens, target = _random_trees(rng, b, n, chain, vocab=rng.choice([2, 3, 5]))
    max_depth = max(max(d) for d in depths)
    args = (torch.tensor(tokens), torch.tensor(target), torch.tensor(parents, dtype=torch.int32),
            max_depth)
    got = triton_ops.greedy_accept(*args)
    twin = torch_ops.greedy_accept(*args)
    for a, t in zip(got, twin):
        assert torch.equal(a, t)
    num, path, bonus = (x.tolist() for x in got)
    for r in range(b):
        want_path, want_bonus = _walk_greedy(tokens[r], target[r], children_of(parents[r]))
        assert num[r] == len(want_path)
        assert path[r] == want_path + [-1] * (max_depth - len(want_path))
        assert bonus[r] == want_bonus
    if chain and n > 1:
        assert set(num) <= set(range(n))


@pytest.mark.parametrize("seed", range(8))
def test_accept_chain_into_equals_twin_and_greedy_accept(seed):
    """Chain acceptance into the graphs' buffers: the Triton kernel == the twin == the general
    walk (`greedy_accept`) on the live rows; padding rows accept nothing; the host row packs
    [num, bonus, path, path tokens]."""
    rng = random.Random(500 + seed)
    b, n = rng.randint(1, 6), rng.randint(1, 6)
    rows, width = b + rng.randint(0, 3), max(n - 1, 1) + rng.randint(0, 2)
    _, _, tokens, target = _random_trees(rng, b, n, True, vocab=rng.choice([2, 3]))
    tok, tgt = torch.tensor(tokens), torch.tensor(target)
    parents = torch.tensor([[-1] + list(range(n - 1))] * b, dtype=torch.int32)
    want_num, want_path, want_bonus = torch_ops.greedy_accept(tok, tgt, parents, n - 1)
    outs = []
    for mod in (triton_ops, torch_ops):
        bufs = (torch.full((rows,), 7, dtype=torch.int32),
                torch.full((rows, width), 9, dtype=torch.int32),
                torch.full((rows,), 11, dtype=torch.int64), torch.full((rows, n), 13))
        host = mod.accept_chain_into(tok, tgt.reshape(-1), *bufs)
        outs.append((host, *bufs))
        num, path, bonus, ver = bufs
        assert torch.equal(num[:b], want_num) and torch.equal(bonus[:b], want_bonus)
        assert torch.equal(path[:b, : n - 1], want_path) and (path[:b, n - 1:] == -1).all()
        assert (num[b:] == 0).all() and (path[b:] == -1).all() and (bonus[b:] == 0).all()
        assert torch.equal(ver[:b], tok)
        for r in range(b):
            a = int(want_num[r])
            row = host[r].tolist()
            assert row[:2] == [a, int(want_bonus[r])]
            assert row[2 : 2 + a] == list(range(1, a + 1))
            assert row[n + 1 : n + 1 + a] == tokens[r][1 : a + 1]
    for got, twin in zip(*outs):  # every buffer, padding rows and untouched tokens too
        assert torch.equal(got, twin)


@pytest.mark.parametrize("seed", range(10))
def test_extend_inputs_equal_twin_and_the_round_logic(seed):
    rng = random.Random(100 + seed)
    b, n, ps = rng.randint(1, 8), rng.randint(2, 9), rng.choice([1, 4, 16])
    parents, depths, tokens, target = _random_trees(rng, b, n, rng.random() < 0.5, vocab=3)
    d = max(max(x) for x in depths)
    num, path, bonus = torch_ops.greedy_accept(torch.tensor(tokens), torch.tensor(target),
                                               torch.tensor(parents, dtype=torch.int32), d)
    num_cached = [rng.randint(0, 40) for _ in range(b)]
    pages_per = max(-(-(nc + n + 1) // ps) for nc in num_cached)
    pool = list(range(1, 1 + b * pages_per))
    rng.shuffle(pool)
    table = [pool[r * pages_per : (r + 1) * pages_per] for r in range(b)]
    args = (torch.tensor(tokens), path, num, bonus, torch.tensor(num_cached),
            torch.tensor(table, dtype=torch.int32), ps)
    got = triton_ops.extend_inputs(*args)
    twin = torch_ops.extend_inputs(*args)
    for a, t in zip(got, twin):
        assert torch.equal(a, t)
    toks, feats, pos, slots, last = (x.tolist() for x in got)
    # The round's own logic: new tokens = accepted drafts + bonus, feature rows r*N + (root,
    # path), and the extend metadata's positions and slots.
    paths = [[c for c in p if c >= 0] for p in path.tolist()]
    new_tokens = [[tokens[r][c] for c in paths[r]] + [bonus[r].item()] for r in range(b)]
    rows = [r * n + c for r in range(b) for c in (0, *paths[r])]
    lay = build_metadata([SeqSlice(page_ids=table[r], num_cached=num_cached[r],
                                   num_new=len(new_tokens[r])) for r in range(b)], ps)
    t = len(rows)
    assert toks[:t] == [x for nt in new_tokens for x in nt]
    assert feats[:t] == rows
    assert pos[:t] == lay.positions.tolist()
    assert slots[:t] == lay.attn.slot_ids.tolist()
    assert last == (lay.attn.qo_indptr[1:] - 1).tolist()
    assert toks[t:] == feats[t:] == pos[t:] == slots[t:] == [0] * (len(toks) - t)


@pytest.mark.parametrize("seed", range(10))
def test_extend_rows_equal_twin_and_the_round_logic(seed):
    """The fixed-shape extend's inputs (speculative graphs: R rows per request, filler past the
    bonus) == the twin, and the packed extend's rows where a request has them."""
    rng = random.Random(300 + seed)
    b, n = rng.randint(1, 8), rng.randint(2, 9)
    parents, depths, tokens, target = _random_trees(rng, b, n, rng.random() < 0.5, vocab=3)
    d = max(max(x) for x in depths)
    num, path, bonus = torch_ops.greedy_accept(torch.tensor(tokens), torch.tensor(target),
                                               torch.tensor(parents, dtype=torch.int32), d)
    r = d + 1  # the graph's rows per request (extend_rows for a chain of d drafts)
    args = (torch.tensor(tokens), path, num, bonus, r)
    got = triton_ops.extend_rows(*args)
    twin = torch_ops.extend_rows(*args)
    for a, t in zip(got, twin):
        assert a.dtype == t.dtype == torch.int64 and torch.equal(a, t)
    toks, rows, last = (x.tolist() for x in got)
    for q in range(b):
        accepted = [c for c in path[q].tolist() if c >= 0]
        a = len(accepted)
        assert toks[q * r : q * r + a + 1] == [tokens[q][c] for c in accepted] + [bonus[q].item()]
        assert toks[q * r + a + 1 : (q + 1) * r] == [bonus[q].item()] * (r - a - 1)  # filler
        assert rows[q * r : q * r + a + 1] == [q * n + c for c in (0, *accepted)]
        assert last[q] == q * r + a


@pytest.mark.parametrize("seed", range(10))
def test_tree_mask_equals_twin_and_the_metadata_packing(seed):
    rng = random.Random(200 + seed)
    b, n = rng.randint(1, 6), rng.randint(1, 12)
    parents, _, _, _ = _random_trees(rng, b, n, rng.random() < 0.3, vocab=2)
    num_cached = [rng.choice([0, 1, 5, 37, 1030]) for _ in range(b)]  # > BLOCK_K too
    sizes = [n * (nc + n) for nc in num_cached]
    offsets = [sum(sizes[:r]) for r in range(b)]
    args = (torch.tensor(parents, dtype=torch.int32), torch.tensor(num_cached),
            torch.tensor(offsets), sum(sizes), max(num_cached))
    got = triton_ops.tree_mask(*args)
    assert torch.equal(got, torch_ops.tree_mask(*args))
    lay = build_metadata([SeqSlice(page_ids=list(range(nc + n)), num_cached=nc, num_new=n,
                                   mask=ref_tree_mask(nc, parents[r]))
                          for r, nc in enumerate(num_cached)], page_size=1)
    assert torch.equal(got, lay.attn.custom_mask)
