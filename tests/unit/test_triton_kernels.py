"""Each Triton kernel equals its torch twin, on the CPU through TRITON_INTERPRET=1.

Skipped when triton is not installed. The same cases run on the GPU in
tests/gpu/test_kernels_gpu.py (compiled kernels, bf16)."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is first imported
pytest.importorskip("triton")
pytest.importorskip("numpy")

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("triton was imported before TRITON_INTERPRET could be set", allow_module_level=True)

from tandem.engine.kernels import torch_ops, triton_ops  # noqa: E402

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
def test_gemv(shape):
    g = torch.Generator().manual_seed(4)
    n, k = shape
    w = torch.randn(n, k, generator=g)
    x = torch.randn(1, k, generator=g)
    torch.testing.assert_close(triton_ops.gemv(x, w), torch_ops.linear(x, w), atol=1e-4,
                               rtol=1e-4)
