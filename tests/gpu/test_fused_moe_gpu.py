"""Compiled fused-MoE kernels on the GPU: the Triton path equals the per-expert loop it replaced
(float32 within 1e-5 relative; bf16 within a few bf16 steps of a float32 loop, like the loop
itself), and one SparseMoE layer (router + fused experts) captures in a CUDA graph whose replay
equals the eager layer bitwise, for new inputs too. benchmarks/gpu_fused_moe.py times it."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu
pytest.importorskip("triton")

from tandem.engine import ParallelGroup, kernels  # noqa: E402
from tandem.engine.kernels.moe_reference import expert_loop  # noqa: E402

DEV = "cuda"
H, INTER, EXPERTS, TOP_K = 512, 192, 32, 4


def _layer(dtype: torch.dtype):
    from tandem.engine.layers.mlp import SparseMoE

    with torch.device(DEV):
        moe = SparseMoE(H, INTER, EXPERTS, TOP_K, True, ParallelGroup(), ParallelGroup(), dtype)
    g = torch.Generator(DEV).manual_seed(0)
    moe.router.load_weight("router", torch.randn(EXPERTS, H, device=DEV, generator=g).to(dtype))
    moe.w13.data.copy_(torch.randn(moe.w13.shape, device=DEV, generator=g) * H**-0.5)
    moe.w2.data.copy_(torch.randn(moe.w2.shape, device=DEV, generator=g) * INTER**-0.5)
    return moe


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Max abs difference over b's scale; a zero reference (EP rank 1 gets no token of a batch
    of 1 when both of its experts live on rank 0) must give exactly zero."""
    diff, scale = (a.float() - b.float()).abs().max(), b.float().abs().max()
    return float(diff / scale) if scale > 0 else float(diff)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens", [1, 8, 64, 300])  # 300 * 4 >= 32 * 32: 64-row blocks
@pytest.mark.parametrize("ep_rank", [None, 1])  # the whole layer; rank 1 of EP 2's experts
def test_triton_equals_the_expert_loop(dtype, num_tokens, ep_rank):
    moe = _layer(dtype)
    x = torch.randn(num_tokens, H, device=DEV).to(dtype)
    weights, experts = moe.route(x)
    start, num = (0, EXPERTS) if ep_rank is None else (EXPERTS // 2, EXPERTS // 2)
    w13, w2 = moe.w13[start : start + num], moe.w2[start : start + num]
    y = kernels.moe_experts(x, w13, w2, experts, start)
    got = kernels.moe_weighted_sum(y, weights, experts)
    ref = expert_loop(x.float(), w13.float(), w2.float(), weights.float(), experts, start)
    loop = expert_loop(x, w13, w2, weights, experts, start)
    if dtype == torch.float32:
        assert _rel(got, ref) < 1e-5
    else:  # no further from float32 than the bf16 loop is, within a bf16 step
        assert _rel(got, ref) <= _rel(loop, ref) + 8e-3


@pytest.mark.parametrize("num_tokens", [1, 8, 64])
def test_the_layer_captures_and_replays(num_tokens):
    moe = _layer(torch.bfloat16)
    x = torch.randn(num_tokens, H, device=DEV).bfloat16()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        moe(x)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = moe(x)
    for _ in range(2):  # the captured inputs, then new ones in the same buffer
        graph.replay()
        assert torch.equal(out, moe(x))
        x.copy_(torch.randn_like(x))
