"""Each Triton kernel equals its torch twin, on the CPU through TRITON_INTERPRET=1.

Skipped when triton is not installed. The same cases run on the GPU in
tests/gpu/test_kernels_gpu.py (compiled kernels, bf16)."""

from __future__ import annotations

import os

import pytest
import torch

if torch.cuda.is_available():  # the interpreter flag is process-wide: tests/gpu covers CUDA
    pytest.skip("CUDA machine: tests/gpu runs the compiled kernels", allow_module_level=True)
os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is first imported
pytest.importorskip("triton")
pytest.importorskip("numpy")

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("triton was imported before TRITON_INTERPRET could be set", allow_module_level=True)

from tandem.engine.kernels import torch_ops, triton_gemv, triton_ops  # noqa: E402

DTYPES = [torch.float32, torch.bfloat16]


def _close(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> None:
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(a.float(), b.float(), **tol)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_and_fused_add(dtype):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 96, generator=g).to(dtype)
    res = torch.randn(5, 96, generator=g).to(dtype)
    w = (1 + 0.1 * torch.randn(96, generator=g)).to(dtype)
    _close(triton_ops.rms_norm(x, w, 1e-5), torch_ops.rms_norm(x, w, 1e-5), dtype)
    out, summed = triton_ops.add_rms_norm(x, res, w, 1e-5)
    ref_out, ref_sum = torch_ops.add_rms_norm(x, res, w, 1e-5)
    # The interpreter truncates float32 -> bf16 (the GPU rounds to nearest, and the GPU test
    # asserts bitwise equality of the sum); compare within one bf16 step here.
    _close(summed, ref_sum, dtype)
    _close(out, ref_out, dtype)
    # [T, H, D] input (q/k norm), not contiguous over heads: a view of a wider row
    qkv = torch.randn(3, 5 * 16, generator=g).to(dtype)
    q = qkv[:, : 4 * 16].view(3, 4, 16)
    _close(triton_ops.rms_norm(q, w[:16], 1e-6), torch_ops.rms_norm(q, w[:16], 1e-6), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_on_qkv_views(dtype):
    g = torch.Generator().manual_seed(1)
    num_tokens, hq, hk, d = 4, 6, 2, 16
    qkv = torch.randn(num_tokens, (hq + 2 * hk) * d, generator=g).to(dtype)
    q = qkv[:, : hq * d].view(num_tokens, hq, d)  # strided views, like the attention layer's
    k = qkv[:, hq * d : (hq + hk) * d].view(num_tokens, hk, d)
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    freqs = torch.outer(torch.arange(64).float(), inv)
    emb = torch.cat([freqs, freqs], -1)
    cos, sin = emb.cos(), emb.sin()
    positions = torch.tensor([0, 7, 63, 7])
    q1, k1 = triton_ops.rotary(positions, q, k, cos, sin)
    q2, k2 = torch_ops.rotary(positions, q, k, cos, sin)
    _close(q1, q2, dtype)
    _close(k1, k2, dtype)
    assert q1.is_contiguous() and q1.shape == q.shape and k1.shape == k.shape


@pytest.mark.parametrize("page_size", [1, 4])
def test_store_kv_writes_the_slots_and_nothing_else(page_size):
    g = torch.Generator().manual_seed(2)
    num_pages, hkv, d = 6, 2, 8
    cache = torch.randn(num_pages, 2, page_size, hkv, d, generator=g)
    ref = cache.clone()
    kv = torch.randn(3, 3 * hkv * d, generator=g)  # k, v as views of a wider row (qkv output)
    k = kv[:, hkv * d : 2 * hkv * d].view(3, hkv, d)
    v = kv[:, 2 * hkv * d :].view(3, hkv, d)
    slots = torch.tensor([page_size * 5 + page_size - 1, page_size * 1, page_size * 3],
                         dtype=torch.int64)
    triton_ops.store_kv(cache, k, v, slots)
    torch_ops.store_kv(ref, k, v, slots)
    assert torch.equal(cache, ref)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul(dtype):
    g = torch.Generator().manual_seed(3)
    x = (3 * torch.randn(3, 2 * 40, generator=g)).to(dtype)
    _close(triton_ops.silu_and_mul(x), torch_ops.silu_and_mul(x), dtype)


@pytest.mark.parametrize("shape", [(64, 512), (40, 700)])  # even blocks, ragged edges
@pytest.mark.parametrize("variant", ["plain", "norm", "silu_mul", "norm_residual",
                                     "silu_mul_residual"])
@pytest.mark.parametrize("config", [None, (8, 256, 4, 1)])  # one block per program; persistent
def test_gemv_and_fused_prologues(shape, variant, config):
    g = torch.Generator().manual_seed(4)
    n, k = shape
    w = torch.randn(n, k, generator=g)
    silu = variant.startswith("silu_mul")
    x = torch.randn(1, 2 * k if silu else k, generator=g)
    norm = (1 + 0.1 * torch.randn(k, generator=g)) if variant.startswith("norm") else None
    res = torch.randn(1, n, generator=g) if variant.endswith("residual") else None
    got = triton_gemv.gemv(x, w, norm_weight=norm, eps=1e-5, silu_mul=silu, residual=res,
                           config=config)
    want = torch_ops.fused_linear(x, w, norm, 1e-5, silu, res)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_gemv_float32_logits_from_bf16():
    g = torch.Generator().manual_seed(5)
    w = torch.randn(48, 256, generator=g).bfloat16()
    x = torch.randn(1, 256, generator=g).bfloat16()
    got = triton_gemv.gemv(x, w, out_dtype=torch.float32)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, x.float() @ w.float().t(), atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("page_size", [1, 4])
def test_rotary_store_equals_rotary_then_store(page_size):
    g = torch.Generator().manual_seed(6)
    num_tokens, hq, hk, d = 3, 6, 2, 16
    qkv = torch.randn(num_tokens, (hq + 2 * hk) * d, generator=g)
    q = qkv[:, : hq * d].view(num_tokens, hq, d)
    k = qkv[:, hq * d : (hq + hk) * d].view(num_tokens, hk, d)
    v = qkv[:, (hq + hk) * d :].view(num_tokens, hk, d)
    emb = torch.outer(torch.arange(32).float(), 1.0 / (10000 ** (torch.arange(0, d, 2) / d)))
    cos, sin = torch.cat([emb, emb], -1).cos(), torch.cat([emb, emb], -1).sin()
    pos = torch.tensor([3, 31, 0])
    slots = torch.tensor([page_size * 4 + page_size - 1, page_size, page_size * 2])
    cache = torch.randn(5, 2, page_size, hk, d, generator=g)
    ref = cache.clone()
    q_got = triton_ops.rotary_store(pos, q, k, v, cos, sin, cache, slots)
    q_want = torch_ops.rotary_store(pos, q, k, v, cos, sin, ref, slots)
    torch.testing.assert_close(q_got, q_want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(cache, ref, atol=1e-5, rtol=1e-5)
