"""Each Triton kernel equals its torch twin, on the CPU through TRITON_INTERPRET=1.

Skipped when triton is not installed. The same cases run on the GPU in
tests/gpu/test_kernels_gpu.py (compiled kernels, bf16)."""

from __future__ import annotations

import pytest
import torch
from triton_interp import require_triton_interpreter

require_triton_interpreter()  # before triton is first imported

from tandem.engine.kernels import gemv_tuning, torch_ops, triton_gemv, triton_ops

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


@pytest.mark.parametrize("n_cols", [7, 4096, 9000, 3 * 4096 + 5])
def test_row_max_equals_torch_max_with_ties_nan_and_inf(n_cols):
    """The chunked row max picks torch.max's entry: the largest value, its FIRST column on a
    tie (within a chunk and across chunks), a NaN over everything, -inf rows at column 0."""
    g = torch.Generator().manual_seed(n_cols)
    x = torch.randn(6, n_cols, generator=g)
    x[1, :] = 3.0  # all tied: column 0
    x[2, n_cols // 2] = x[2, -1] = 50.0  # a tie across chunks where there are several
    x[3, :] = float("-inf")
    x[4, n_cols - 1] = float("nan")
    x[4, 0] = float("inf")
    x[5, n_cols // 3] = float("nan")
    x[5, n_cols - 1] = float("nan")
    for t in (x, x.to(torch.bfloat16)):
        val, idx = triton_ops.row_max(t)
        ref_val, ref_idx = torch_ops.row_max(t)
        assert torch.equal(idx, ref_idx), (idx, ref_idx)
        torch.testing.assert_close(val, ref_val, equal_nan=True)
        assert val.dtype == t.dtype and idx.dtype == torch.int64


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


# Multi-row GEMV (speculative verify, small batches): every row gets its own prologue and
# epilogue. Odd shapes hit the row, column and K masks; configs cover one and several K steps,
# the interpreter's default (None) and the UNFUSED sentinel (cuBLAS + elementwise kernels).
ROWS_CASES = [(3, 2, "plain"), (5, 8, "norm"), (2, 5, "silu_mul"), (5, 2, "norm_residual"),
              (8, 5, "silu_mul_residual"), (2, 8, "residual")]


@pytest.mark.parametrize("shape", [(24, 64), (19, 100)])  # even blocks; ragged N and K
@pytest.mark.parametrize(("seed", "num_rows", "variant"), ROWS_CASES)
@pytest.mark.parametrize("config", [None, "small", "split", "fma_steps", "fma_one_step",
                                    "grid_steps", "grid_one_step", "unfused"])
def test_gemv_rows_equal_the_twin_row_by_row(shape, seed, num_rows, variant, config):
    g = torch.Generator().manual_seed(seed)
    n, k = shape
    cfg = {None: None, "small": triton_gemv.RowsConfig(8, 32, 4, 2),
           "split": triton_gemv.RowsConfig(8, 32, 4, 2, split_silu=True),
           "fma_steps": triton_gemv.FmaConfig(8, 32, 4),  # several K steps, ragged N
           "fma_one_step": triton_gemv.FmaConfig(4, 128, 4),  # all of K in one masked step
           "grid_steps": triton_gemv.GridConfig(8, 32, 4),  # the one-row kernel per row
           "grid_one_step": triton_gemv.GridConfig(4, 128, 4),
           "unfused": triton_gemv.UNFUSED}[config]
    w = torch.randn(n, k, generator=g)
    silu = variant.startswith("silu_mul")
    x = torch.randn(num_rows, 2 * k if silu else k, generator=g)
    x[-1] *= 10  # rows of very different scale: each needs its own RMSNorm statistics
    norm = (1 + 0.1 * torch.randn(k, generator=g)) if variant.startswith("norm") else None
    res = torch.randn(num_rows, n, generator=g) if variant.endswith("residual") else None
    got = triton_gemv.gemv(x, w, norm_weight=norm, eps=1e-5, silu_mul=silu, residual=res,
                           config=cfg)
    want = torch_ops.fused_linear(x, w, norm, 1e-5, silu, res)
    assert got.shape == (num_rows, n) and got.dtype == torch.float32
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    # Row m of a batch equals that row alone through the one-row kernel.
    one = triton_gemv.gemv(x[-1:].contiguous(), w, norm_weight=norm, eps=1e-5, silu_mul=silu,
                           residual=None if res is None else res[-1:].contiguous())
    torch.testing.assert_close(got[-1:], one, atol=1e-4, rtol=1e-4)
    if isinstance(cfg, triton_gemv.GridConfig):  # each row IS the one-row product, bitwise
        for m in range(num_rows):
            alone = triton_gemv.gemv(
                x[m:m + 1].contiguous(), w, norm_weight=norm, eps=1e-5, silu_mul=silu,
                residual=None if res is None else res[m:m + 1].contiguous(),
                config=(cfg.block_n, cfg.block_k, cfg.num_warps, 0))
            assert torch.equal(got[m:m + 1], alone), m


def test_the_row_grid_is_offered_for_weights_that_stay_in_l2():
    small = torch.empty(3072, 576, dtype=torch.bfloat16)  # SmolLM2's gate_up: 3.5 MB
    large = torch.empty(14336 * 2, 4096, dtype=torch.bfloat16)  # 8B's: 235 MB
    grid = [c for c in triton_gemv.ROWS_CONFIGS if isinstance(c, triton_gemv.GridConfig)]
    assert grid and set(grid) <= set(gemv_tuning.rows_candidates(small, False))
    assert not set(grid) & set(gemv_tuning.rows_candidates(large, False))
    assert not any(getattr(c, "split_silu", False)
                   for c in gemv_tuning.rows_candidates(small, False))
    assert gemv_tuning.rows_candidates(small, True)[0] == triton_gemv.ROWS_CONFIGS[0]
    g = grid[0]  # tagged in the tuning file; never equal to an FmaConfig of the same fields
    assert gemv_tuning._encode(g) == ["grid", g.block_n, g.block_k, g.num_warps]
    assert g != triton_gemv.FmaConfig(g.block_n, g.block_k, g.num_warps)


@pytest.mark.parametrize("num_rows", [2, 5, 8])
@pytest.mark.parametrize("config", [None, "unfused"])
def test_gemv_rows_float32_logits_from_bf16(num_rows, config):
    g = torch.Generator().manual_seed(7)
    w = torch.randn(40, 96, generator=g).bfloat16()
    x = torch.randn(num_rows, 96, generator=g).bfloat16()
    got = triton_gemv.gemv(x, w, out_dtype=torch.float32,
                           config=triton_gemv.UNFUSED if config else None)
    assert got.dtype == torch.float32 and got.shape == (num_rows, 40)
    # The kernel keeps the float32 accumulator; UNFUSED widens the bf16 product, as
    # `ops.linear` does off the GEMV path (bf16 tolerance).
    tol = 2e-2 if config else 2e-3
    torch.testing.assert_close(got, x.float() @ w.float().t(), atol=tol, rtol=tol)


def test_gemv_rows_tuning_key_and_report():
    """Each row count is tuned (and reported) separately; one-row keys keep their form."""
    g = torch.Generator().manual_seed(8)
    w = torch.randn(24, 64, generator=g)
    for m in (1, 3):
        triton_gemv.gemv(torch.randn(m, 64, generator=g), w)
    tuned = triton_gemv.tuned_configs()
    base = (24, 64, "torch.float32", False, False, False, "torch.float32")
    assert tuned[base] in triton_gemv.CONFIGS
    assert tuned[(*base, 3)] == triton_gemv.ROWS_CONFIGS[0]
    assert triton_gemv.UNFUSED in triton_gemv.ROWS_CONFIGS


def test_gemv_rejects_more_rows_than_the_kernel_takes():
    x = torch.randn(triton_gemv.MAX_ROWS + 1, 64)
    with pytest.raises(AssertionError):
        triton_gemv.gemv(x, torch.randn(24, 64))
    with pytest.raises(AssertionError):  # residual must be [M, N]
        triton_gemv.gemv(x[:3], torch.randn(24, 64), residual=torch.randn(1, 24))


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


def test_tuning_cycles_through_weights_that_overflow_l2(monkeypatch):
    """The tuner times each candidate over copies of the weight that together exceed twice
    the L2 cache (a forward's layers do): two for 8B-sized weights, more for small ones."""
    from types import SimpleNamespace

    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda dev: SimpleNamespace(L2_cache_size=50 << 20))
    mb = 1 << 20
    assert gemv_tuning._copies(torch.empty(28672, 4096, dtype=torch.bfloat16)) == 2
    gate_up = torch.empty(3072, 576, dtype=torch.bfloat16)  # SmolLM2: 3.4 MiB
    n = gemv_tuning._copies(gate_up)
    assert n * 3072 * 576 * 2 >= 100 * mb > (n - 1) * 3072 * 576 * 2
    assert gemv_tuning._copies(torch.empty(8, 8)) == 256  # capped
