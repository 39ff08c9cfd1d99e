"""The fused-MoE Triton kernels (triton_moe) equal their torch twins (torch_moe), on the CPU
through TRITON_INTERPRET=1, and the whole fused path on the Triton kernels equals the expert
loop it replaced (float32). Ragged shapes hit the row, column and K masks; routings leave
experts without tokens and blocks unused; EP shards leave other ranks' pairs out.
benchmarks/gpu_fused_moe.py runs the compiled kernels on a GPU (bf16, graphs)."""

from __future__ import annotations

import pytest
import torch
from triton_interp import require_triton_interpreter

require_triton_interpreter()  # before triton is first imported

from tandem.engine import kernels  # noqa: E402
from tandem.engine.kernels import ops, torch_moe, triton_moe  # noqa: E402
from tandem.engine.kernels.moe_blocks import align_blocks  # noqa: E402
from tandem.engine.kernels.moe_reference import expert_loop  # noqa: E402

HIDDEN, INTER, EXPERTS, TOP_K = 40, 72, 6, 2  # K not a multiple of BLOCK_K, I not of BLOCK_N


def _case(num_tokens: int, dtype: torch.dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, HIDDEN, generator=g).to(dtype)
    w13 = (torch.randn(EXPERTS, 2 * INTER, HIDDEN, generator=g) / HIDDEN**0.5).to(dtype)
    w2 = (torch.randn(EXPERTS, HIDDEN, INTER, generator=g) / INTER**0.5).to(dtype)
    logits = torch.randn(num_tokens, EXPERTS, generator=g)
    logits[:, -1] = -1e9  # the last expert gets no token
    weights, experts = torch.topk(torch.softmax(logits, -1), TOP_K, dim=-1)
    return x, w13, w2, weights.to(dtype), experts


def _close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    # The interpreter truncates float32 -> bf16 where the twin rounds to nearest: one bf16
    # step apart at most in bf16.
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(got.float(), want.float(), **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("num_tokens", "expert_start", "num_local", "block"),
                         [(1, 0, 6, 16), (9, 0, 6, 16), (21, 3, 3, 16), (30, 0, 6, 64)])
def test_grouped_gemm_kernels_equal_the_twins(dtype, num_tokens, expert_start, num_local,
                                              block):
    x, w13, w2, _, experts = _case(num_tokens, dtype, seed=num_tokens)
    w13, w2 = w13[expert_start : expert_start + num_local], w2[expert_start : expert_start
                                                               + num_local]
    blocks = align_blocks(experts, expert_start, num_local, block)
    h = triton_moe.moe_gate_up(x, w13, blocks)
    h_ref = torch_moe.moe_gate_up(x, w13, blocks)
    used = (blocks.block_expert >= 0).repeat_interleave(block)  # rows the kernel writes
    _close(h[used], h_ref[used], dtype)
    # down from the same h, so the comparison is the down kernel's alone
    _close(triton_moe.moe_down(h_ref, w2, blocks), torch_moe.moe_down(h_ref, w2, blocks), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens", [1, 5])
def test_weighted_sum_kernel_equals_the_twin(dtype, num_tokens):
    g = torch.Generator().manual_seed(num_tokens)
    y = torch.randn(num_tokens, 3, 1100, generator=g).to(dtype)  # two column blocks
    weights = torch.rand(num_tokens, 3, generator=g).to(dtype)
    order = torch.rand(num_tokens, 3, generator=g).argsort(-1)
    got = triton_moe.moe_weighted_sum(y, weights, order)
    want = torch_moe.moe_weighted_sum(y, weights, order)
    if dtype == torch.float32:  # same adds in the same order
        assert torch.equal(got, want)
    _close(got, want, dtype)


@pytest.mark.parametrize("num_tokens", [1, 7, 64])
def test_fused_path_on_triton_equals_the_expert_loop(monkeypatch, num_tokens):
    monkeypatch.setattr(ops, "_on_triton_device", lambda x: True)  # "CUDA with Triton"
    x, w13, w2, weights, experts = _case(num_tokens, torch.float32, seed=100 + num_tokens)
    with torch.no_grad():
        assert ops._moe_for(x) is triton_moe
        for start, num in ((0, EXPERTS), (3, 3)):  # whole, and rank 1 of EP 2
            y = kernels.moe_experts(x, w13[start : start + num], w2[start : start + num],
                                    experts, start)
            got = kernels.moe_weighted_sum(y, weights, experts)
            want = expert_loop(x, w13[start : start + num], w2[start : start + num], weights,
                               experts, start)
            _close(got, want, torch.float32)
