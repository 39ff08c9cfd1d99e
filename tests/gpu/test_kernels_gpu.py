"""Compiled Triton kernels equal their torch twins on the GPU (bf16, model-sized rows)."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu
pytest.importorskip("triton")

from tandem.engine.kernels import torch_ops

DEV = "cuda"


@pytest.fixture(scope="module")
def tri():
    from tandem.engine.kernels import triton_ops

    return triton_ops


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


@pytest.mark.parametrize("hidden", [576, 4096])
def test_norms(tri, hidden):
    g = torch.Generator(DEV).manual_seed(0)
    x = torch.randn(33, hidden, device=DEV, generator=g).bfloat16()
    res = torch.randn(33, hidden, device=DEV, generator=g).bfloat16()
    w = (1 + 0.1 * torch.randn(hidden, device=DEV, generator=g)).bfloat16()
    out, summed = tri.add_rms_norm(x, res, w, 1e-5)
    ref_out, ref_sum = torch_ops.add_rms_norm(x, res, w, 1e-5)
    assert torch.equal(summed, ref_sum)  # one bf16 rounding of the sum, like torch
    assert _rel(out, ref_out) < 4e-3
    assert _rel(tri.rms_norm(x, w, 1e-5), torch_ops.rms_norm(x, w, 1e-5)) < 4e-3


@pytest.mark.parametrize("heads", [(9, 3, 64), (32, 8, 128)])
def test_rotary(tri, heads):
    hq, hk, d = heads
    g = torch.Generator(DEV).manual_seed(1)
    qkv = torch.randn(17, (hq + 2 * hk) * d, device=DEV, generator=g).bfloat16()
    q = qkv[:, : hq * d].view(17, hq, d)
    k = qkv[:, hq * d : (hq + hk) * d].view(17, hk, d)
    from tandem.engine.layers.rotary import RotaryEmbedding

    rope = RotaryEmbedding(d, 4096, 500000.0, None).to(DEV)
    pos = torch.randint(0, 4096, (17,), device=DEV, generator=g)
    q1, k1 = tri.rotary(pos, q, k, rope.cos, rope.sin)
    q2, k2 = torch_ops.rotary(pos, q, k, rope.cos, rope.sin)
    assert _rel(q1, q2) < 8e-3 and _rel(k1, k2) < 8e-3


@pytest.mark.parametrize("page_size", [1, 16])
def test_store_kv_exact(tri, page_size):
    g = torch.Generator(DEV).manual_seed(2)
    cache = torch.randn(40, 2, page_size, 8, 128, device=DEV, generator=g).bfloat16()
    ref = cache.clone()
    kv = torch.randn(9, 24 * 128, device=DEV, generator=g).bfloat16()
    k, v = kv[:, 8 * 128 : 16 * 128].view(9, 8, 128), kv[:, 16 * 128 :].view(9, 8, 128)
    slots = torch.randperm(39 * page_size, device=DEV, generator=g)[:9] + page_size
    tri.store_kv(cache, k, v, slots)
    torch_ops.store_kv(ref, k, v, slots)
    assert torch.equal(cache, ref)


def test_silu_and_mul(tri):
    g = torch.Generator(DEV).manual_seed(3)
    x = (2 * torch.randn(5, 2 * 14336, device=DEV, generator=g)).bfloat16()
    assert _rel(tri.silu_and_mul(x), torch_ops.silu_and_mul(x)) < 4e-3


@pytest.mark.parametrize("shape", [(6144, 4096), (4096, 14336), (1000, 576)])
@pytest.mark.parametrize("variant", ["plain", "norm", "silu_mul_residual", "norm_residual"])
def test_gemv(shape, variant):
    from tandem.engine.kernels import triton_gemv

    g = torch.Generator(DEV).manual_seed(4)
    n, k = shape
    w = (0.02 * torch.randn(n, k, device=DEV, generator=g)).bfloat16()
    silu = variant.startswith("silu_mul")
    x = torch.randn(1, 2 * k if silu else k, device=DEV, generator=g).bfloat16()
    norm = ((1 + 0.1 * torch.randn(k, device=DEV, generator=g)).bfloat16()
            if variant.startswith("norm") else None)
    res = (torch.randn(1, n, device=DEV, generator=g).bfloat16()
           if variant.endswith("residual") else None)
    got = triton_gemv.gemv(x, w, norm_weight=norm, eps=1e-5, silu_mul=silu, residual=res)
    want = torch_ops.fused_linear(x.double(), w.double(), None if norm is None else
                                  norm.double(), 1e-5, silu, None if res is None else
                                  res.double())
    assert got.dtype == torch.bfloat16 and _rel(got, want) < 6e-3


@pytest.mark.parametrize("num_rows", [2, 5, 8])
@pytest.mark.parametrize("shape", [(6144, 4096), (4096, 14336), (1000, 576)])
@pytest.mark.parametrize("variant", ["plain", "norm", "silu_mul_residual", "norm_residual",
                                     "f32"])
def test_gemv_rows(num_rows, shape, variant):
    """x of 2..8 rows (speculative verify, small batches): the tuned choice and every
    multi-row kernel config equal the float64 twin row by row, in bf16."""
    from tandem.engine.kernels import triton_gemv

    g = torch.Generator(DEV).manual_seed(6)
    n, k = shape
    w = (0.02 * torch.randn(n, k, device=DEV, generator=g)).bfloat16()
    silu = variant.startswith("silu_mul")
    x = torch.randn(num_rows, 2 * k if silu else k, device=DEV, generator=g).bfloat16()
    x[-1] *= 8  # rows of different scale: each needs its own RMSNorm statistics
    norm = ((1 + 0.1 * torch.randn(k, device=DEV, generator=g)).bfloat16()
            if variant.startswith("norm") else None)
    res = (torch.randn(num_rows, n, device=DEV, generator=g).bfloat16()
           if variant.endswith("residual") else None)
    out_dtype = torch.float32 if variant == "f32" else None
    want = torch_ops.fused_linear(x.double(), w.double(), None if norm is None else
                                  norm.double(), 1e-5, silu, None if res is None else
                                  res.double())  # [M, N] float64
    configs = [None, *triton_gemv.ROWS_CONFIGS]
    for cfg in configs:
        got = triton_gemv.gemv(x, w, norm_weight=norm, eps=1e-5, silu_mul=silu, residual=res,
                               out_dtype=out_dtype, config=cfg)
        assert got.shape == (num_rows, n) and got.dtype == (out_dtype or torch.bfloat16)
        for m in range(num_rows):
            assert _rel(got[m], want[m]) < 6e-3, (cfg, m)
        if variant == "f32" and cfg != triton_gemv.UNFUSED:  # float32 accumulator kept
            assert _rel(got, want) < 1e-4, cfg
    key = (n, k, "torch.bfloat16", norm is not None, silu, res is not None,
           str(out_dtype or torch.bfloat16), num_rows)
    assert triton_gemv.tuned_configs()[key] in triton_gemv.ROWS_CONFIGS


def test_fused_linear_routes_up_to_max_rows():
    """ops.fused_linear takes the GEMV kernels for 1..gemv_max_rows rows and equals the
    layered sequence; gemv_max_rows=1 sends 5 rows to the unfused sequence again."""
    from tandem.engine import kernels

    g = torch.Generator(DEV).manual_seed(7)
    w = (0.02 * torch.randn(6144, 4096, device=DEV, generator=g)).bfloat16()
    nw = (1 + 0.1 * torch.randn(4096, device=DEV, generator=g)).bfloat16()
    x = torch.randn(5, 4096, device=DEV, generator=g).bfloat16()
    want = torch_ops.fused_linear(x.double(), w.double(), nw.double(), 1e-5)
    with (torch.inference_mode(),  # outside it (autograd recording) ops take the twins
          kernels.kernel_policy(triton=True, gemv=True, fused_decode=True, gemv_max_rows=8)):
        assert kernels.decode_fusion_ok(x)
        fused = kernels.fused_linear(x, w, norm_weight=nw, eps=1e-5)
        with kernels.kernel_policy(gemv_max_rows=1):
            assert not kernels.decode_fusion_ok(x)
            layered = kernels.fused_linear(x, w, norm_weight=nw, eps=1e-5)
    assert _rel(fused, want) < 6e-3 and _rel(layered, want) < 6e-3


@pytest.mark.parametrize("page_size", [1, 16])
def test_rotary_store(tri, page_size):
    from tandem.engine.layers.rotary import RotaryEmbedding

    g = torch.Generator(DEV).manual_seed(5)
    hq, hk, d = 32, 8, 128
    qkv = torch.randn(7, (hq + 2 * hk) * d, device=DEV, generator=g).bfloat16()
    q = qkv[:, : hq * d].view(7, hq, d)
    k = qkv[:, hq * d : (hq + hk) * d].view(7, hk, d)
    v = qkv[:, (hq + hk) * d :].view(7, hk, d)
    rope = RotaryEmbedding(d, 4096, 500000.0, None).to(DEV)
    pos = torch.randint(0, 4096, (7,), device=DEV, generator=g)
    slots = torch.randperm(20 * page_size, device=DEV, generator=g)[:7] + page_size
    cache = torch.randn(21, 2, page_size, hk, d, device=DEV, generator=g).bfloat16()
    ref = cache.clone()
    q1 = tri.rotary_store(pos, q, k, v, rope.cos, rope.sin, cache, slots)
    q2, k2 = tri.rotary(pos, q, k, rope.cos, rope.sin)
    tri.store_kv(ref, k2, v, slots)
    assert torch.equal(q1, q2) and torch.equal(cache, ref)  # same kernel code, same bits


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("heads", [(32, 8, 128), (9, 3, 64)])
@pytest.mark.parametrize("num_splits", [1, 4, 32])
def test_paged_decode(dtype, heads, num_splits):
    """The device-metadata decode kernel (chain draft steps) == its float32 twin, and a CUDA
    graph of it replayed after the lengths changed on the device == a fresh call."""
    from tandem.engine.kernels import triton_decode as tri

    hq, hkv, d = heads
    ps, pages = 16, 64
    g = torch.Generator(DEV).manual_seed(num_splits)
    kv = torch.randn(pages, 2, ps, hkv, d, device=DEV, generator=g).to(dtype)
    q = torch.randn(3, hq, d, device=DEV, generator=g).to(dtype)
    table = torch.randperm(pages - 1, device=DEV, generator=g)[:3 * 20].add(1).view(3, 20)
    table = table.to(torch.int32)
    lens = torch.tensor([1, 37, 300], device=DEV)
    got = tri.paged_decode(q, kv, table, lens, d ** -0.5, num_splits)
    want = torch_ops.paged_decode(q, kv, table, lens, d ** -0.5, num_splits)
    assert _rel(got, want) < (1e-2 if dtype == torch.bfloat16 else 1e-5)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        tri.paged_decode(q, kv, table, lens, d ** -0.5, num_splits)  # compiled before capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = tri.paged_decode(q, kv, table, lens, d ** -0.5, num_splits)
    lens.add_(5)  # the device lengths move; the graph reads them at replay
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, tri.paged_decode(q, kv, table, lens, d ** -0.5, num_splits))


@pytest.mark.parametrize("shape", [(1, 8192), (5, 49152), (64, 128256), (3, 100)])
def test_row_max_equals_torch_max(tri, shape):
    """Ties at the first column (within and across chunks), NaN the largest: torch.max's."""
    g = torch.Generator(device=DEV).manual_seed(shape[1])
    x = torch.randn(*shape, device=DEV, generator=g)
    x[0, shape[1] // 2] = x[0, -1] = 99.0
    if shape[0] > 1:
        x[1, -1] = float("nan")
        x[-1, :] = float("-inf")
    for t in (x, x.to(torch.bfloat16)):
        val, idx = tri.row_max(t)
        ref_val, ref_idx = torch_ops.row_max(t)
        assert torch.equal(idx, ref_idx)
        torch.testing.assert_close(val, ref_val, equal_nan=True)
