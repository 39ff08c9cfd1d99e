"""The speculative bookkeeping kernels compiled on the GPU equal their torch twins (the CPU
tests in tests/unit/test_spec_kernels.py run them through the interpreter and also check the
twins against the round's Python logic)."""

from __future__ import annotations

import random

import pytest
import torch

pytestmark = pytest.mark.gpu
pytest.importorskip("triton")

from tandem.spec.kernels import torch_ops, triton_ops  # noqa: E402

DEV = torch.device("cuda")


def _trees(rng: random.Random, b: int, n: int, chain: bool):
    par = [[-1] + ([j - 1 for j in range(1, n)] if chain else
                   [rng.randrange(j) for j in range(1, n)]) for _ in range(b)]
    dep = []
    for p in par:
        d = [0] * n
        for j in range(1, n):
            d[j] = d[p[j]] + 1
        dep.append(d)
    return par, dep


@pytest.mark.parametrize("seed", range(20))
def test_spec_kernels_equal_twins_on_cuda(seed):
    rng = random.Random(seed)
    b, n, ps = rng.randint(1, 64), rng.randint(2, 33), rng.choice([1, 16])
    par, dep = _trees(rng, b, n, chain=seed % 2 == 0)
    vocab = rng.choice([2, 3])
    tokens = torch.randint(0, vocab, (b, n), device=DEV)
    target = torch.randint(0, vocab, (b, n), device=DEV)
    parents = torch.tensor(par, dtype=torch.int32, device=DEV)
    depth = max(max(d) for d in dep)
    got = triton_ops.greedy_accept(tokens, target, parents, depth)
    want = torch_ops.greedy_accept(tokens, target, parents, depth)
    for a, w in zip(got, want):
        assert torch.equal(a, w)
    num, path, bonus = got
    nc = torch.randint(0, 3000, (b,), device=DEV)
    pages = -(-(int(nc.max()) + n + 1) // ps)
    table = torch.randperm(b * pages, device=DEV).view(b, pages).to(torch.int32) + 1
    args = (tokens, path, num, bonus, nc, table, ps)
    for a, w in zip(triton_ops.extend_inputs(*args), torch_ops.extend_inputs(*args)):
        assert torch.equal(a, w)
    sizes = [n * (int(c) + n) for c in nc.tolist()]
    offsets = torch.tensor([sum(sizes[:r]) for r in range(b)], device=DEV)
    margs = (parents, nc, offsets, sum(sizes), int(nc.max()))
    assert torch.equal(triton_ops.tree_mask(*margs), torch_ops.tree_mask(*margs))
    # The speculative graphs' one-launch plans (the default; TANDEM_PLAN_KERNELS=0 opts
    # out): the fixed-shape extend's inputs and the decode rows' plan.
    eargs = (tokens, path, num, bonus, depth + 1)
    for a, w in zip(triton_ops.extend_rows(*eargs), torch_ops.extend_rows(*eargs)):
        assert torch.equal(a, w)
    from tandem.engine.kernels import torch_ops as engine_twins
    from tandem.engine.kernels import triton_decode

    for rows in (1, n):
        pargs = (table, nc, rows, ps)
        for a, w in zip(triton_decode.decode_rows_plan(*pargs),
                        engine_twins.decode_rows_plan(*pargs)):
            assert torch.equal(a, w)
    if seed % 2 == 0:  # chains: acceptance into the graphs' buffers (padding rows too)
        outs = []
        for mod in (triton_ops, torch_ops):
            bufs = (torch.full((b + 2,), 7, dtype=torch.int32, device=DEV),
                    torch.full((b + 2, max(n - 1, 1)), 9, dtype=torch.int32, device=DEV),
                    torch.full((b + 2,), 11, dtype=torch.int64, device=DEV),
                    torch.full((b + 2, n), 13, dtype=torch.int64, device=DEV))
            outs.append((mod.accept_chain_into(tokens, target.reshape(-1), *bufs), *bufs))
        for a, w in zip(*outs):
            assert torch.equal(a, w)
        assert torch.equal(outs[0][1][:b], num)
