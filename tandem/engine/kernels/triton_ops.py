"""Triton kernels, one launch each where torch needs several. Imported only when a CUDA tensor
(or a CPU test under TRITON_INTERPRET=1) asks for them; never at tandem import time.

Every kernel has a twin in `torch_ops` with the same signature and semantics; arithmetic runs
in float32 and rounds once, so results equal the twin within bf16 rounding (not bitwise).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from tandem.engine.kernels import pdl

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


# ---- RMSNorm, optionally fused with the residual add ----------------------------------------

@triton.jit
def _rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, sum_ptr,
    stride_x, stride_r, stride_o, stride_s, n_cols, eps,
    HAS_RES: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RES:
        # The sum is rounded to the model dtype before the statistics, as HF does.
        x = (x.to(tl.float32) + tl.load(res_ptr + row * stride_r + cols, mask=mask,
                                        other=0.0).to(tl.float32)).to(x.dtype)
        tl.store(sum_ptr + row * stride_s + cols, x, mask=mask)
    x32 = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x32 * x32, axis=0) / n_cols + eps)
    normed = (x32 * rstd).to(x.dtype).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (w * normed).to(x.dtype), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., H] (last dim contiguous), weight [H] -> new [..., H]."""
    x2 = x.reshape(-1, x.shape[-1])  # [R, H]
    out = torch.empty_like(x2)
    _launch_norm(x2, None, weight, out, None, eps)
    return out.view(x.shape)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """x, residual [T, H] -> (rms_norm(x + residual), x + residual), both new tensors."""
    out, summed = torch.empty_like(x), torch.empty_like(x)
    _launch_norm(x, residual, weight, out, summed, eps)
    return out, summed


def _launch_norm(x, res, w, out, summed, eps: float) -> None:
    rows, cols = x.shape
    if rows == 0:
        return
    assert x.stride(-1) == 1 and w.is_contiguous()
    block = triton.next_power_of_2(cols)
    _rms_norm_kernel[(rows,)](
        x, res if res is not None else x, w, out, summed if summed is not None else out,
        x.stride(0), res.stride(0) if res is not None else 0, out.stride(0),
        summed.stride(0) if summed is not None else 0, cols, eps,
        HAS_RES=res is not None, BLOCK=block, num_warps=min(16, max(1, block // 256)),
    )


# ---- rotary embedding (rotate-half layout) ---------------------------------------------------

@triton.jit
def _rope_heads(
    x_ptr, out_ptr, cos, sin, stride_xh, n_heads, HALF: tl.constexpr, BLOCK_H: tl.constexpr,
):
    """Rotate one token's n_heads heads from x_ptr (head stride stride_xh) into out_ptr
    (heads contiguous)."""
    d = tl.arange(0, HALF)[None, :]
    h = tl.arange(0, BLOCK_H)[:, None]
    mask = h < n_heads
    src = x_ptr + h * stride_xh + d
    x1 = tl.load(src, mask=mask, other=0.0)
    x2 = tl.load(src + HALF, mask=mask, other=0.0)
    a, b = x1.to(tl.float32), x2.to(tl.float32)
    dst = out_ptr + h * (2 * HALF) + d
    tl.store(dst, (a * cos - b * sin).to(x1.dtype), mask=mask)
    tl.store(dst + HALF, (b * cos + a * sin).to(x1.dtype), mask=mask)


@triton.jit
def _rope_kernel(
    q_ptr, k_ptr, v_ptr, q_out_ptr, k_out_ptr, pos_ptr, cos_ptr, sin_ptr, slot_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, n_q_heads, n_k_heads, stride_cos,
    page_size, HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_V: tl.constexpr,
    STORE: tl.constexpr, PDL: tl.constexpr = False,
):
    """Program (t, 0) rotates token t's query heads, (t, 1) its key heads. With STORE the
    rotated keys and the values go straight into the KV pages (k_out_ptr = the layer's
    [num_pages, 2, page_size, Hk, D] cache, slot_ptr = each token's slot). PDL: launched as a
    programmatic dependent (kernels/pdl.py)."""
    if PDL:
        tl.extra.cuda.gdc_wait()
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t)
    d = tl.arange(0, HALF)
    cos = tl.load(cos_ptr + pos * stride_cos + d)[None, :]  # [1, HALF] float32
    sin = tl.load(sin_ptr + pos * stride_cos + d)[None, :]
    if tl.program_id(1) == 0:
        _rope_heads(q_ptr + t * stride_qt, q_out_ptr + t * n_q_heads * 2 * HALF, cos, sin,
                    stride_qh, n_q_heads, HALF, BLOCK_H)
    else:
        row = n_k_heads * 2 * HALF  # elements of one token's K (or V) in a page
        if STORE:
            slot = tl.load(slot_ptr + t)
            page, offset = slot // page_size, slot % page_size
            k_dst = k_out_ptr + (page * 2 * page_size + offset) * row
        else:
            k_dst = k_out_ptr + t * row
        _rope_heads(k_ptr + t * stride_kt, k_dst, cos, sin, stride_kh, n_k_heads, HALF,
                    BLOCK_H)
        if STORE:
            cols = tl.arange(0, BLOCK_V)
            vmask = cols < row
            vals = tl.load(v_ptr + t * stride_vt + cols, mask=vmask)
            tl.store(k_dst + page_size * row + cols, vals, mask=vmask)


def rotary(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
    sin: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [T] int64; q [T, Hq, D], k [T, Hk, D] (views of the qkv output are fine: only
    the last dim must be contiguous); cos/sin [max_position, D] float32 -> new q, k."""
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)  # [T, Hk, D]
    return _rope(positions, q, k, None, cos, sin, k_out, None), k_out


def rotary_store(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    cos: torch.Tensor, sin: torch.Tensor, kv_cache: torch.Tensor, slot_ids: torch.Tensor,
) -> torch.Tensor:
    """Like `rotary`, but the rotated k and v are written into kv_cache
    [num_pages, 2, page_size, Hk, D] at slot_ids [T] int64; returns the new q only."""
    assert kv_cache.is_contiguous() and slot_ids.dtype == torch.int64
    assert v.stride(2) == 1 and v.stride(1) == v.shape[2], "each token's V must be contiguous"
    return _rope(positions, q, k, v, cos, sin, kv_cache, slot_ids)


def _rope(positions, q, k, v, cos, sin, k_dst, slot_ids) -> torch.Tensor:
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # [T, Hq, D] contiguous
    num_tokens, _, d = q.shape
    if num_tokens == 0:
        return q_out
    assert q.stride(-1) == 1 and k.stride(-1) == 1 and cos.is_contiguous()
    assert rotary_supported(d), f"head_dim {d}: the Triton rope needs a power of two"
    store = slot_ids is not None
    _rope_kernel[(num_tokens, 2)](
        q, k, v if store else k, q_out, k_dst, positions, cos, sin,
        slot_ids if store else positions, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        v.stride(0) if store else 0, q.shape[1], k.shape[1], cos.stride(0),
        k_dst.shape[2] if store else 1,
        HALF=d // 2, BLOCK_H=triton.next_power_of_2(max(q.shape[1], k.shape[1])),
        BLOCK_V=triton.next_power_of_2(k.shape[1] * d), STORE=store,
        PDL=pdl.ENABLED, num_warps=4, **pdl.launch_options(),
    )
    return q_out


def rotary_supported(head_dim: int) -> bool:
    return head_dim >= 4 and head_dim & (head_dim - 1) == 0


# ---- writing new K/V into pages ---------------------------------------------------------------

@triton.jit
def _store_kv_kernel(
    k_ptr, v_ptr, cache_ptr, slot_ptr, stride_kt, stride_vt, page_size,
    ROW: tl.constexpr, BLOCK: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t)  # int64
    page, offset = slot // page_size, slot % page_size
    # [num_pages, 2, page_size, Hkv*D]: K plane then V plane inside each page.
    base = cache_ptr + (page * 2 * page_size + offset) * ROW
    cols = tl.arange(0, BLOCK)
    mask = cols < ROW
    tl.store(base + cols, tl.load(k_ptr + t * stride_kt + cols, mask=mask), mask=mask)
    tl.store(base + page_size * ROW + cols, tl.load(v_ptr + t * stride_vt + cols, mask=mask),
             mask=mask)


def store_kv(
    kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_ids: torch.Tensor
) -> None:
    """kv_cache [num_pages, 2, page_size, Hkv, D] contiguous (written); k, v [T, Hkv, D] with
    each token's [Hkv, D] block contiguous; slot_ids [T] int64."""
    num_tokens, hkv, d = k.shape
    if num_tokens == 0:
        return
    assert kv_cache.is_contiguous() and slot_ids.dtype == torch.int64
    for x in (k, v):
        assert x.stride(2) == 1 and x.stride(1) == d, "each token's [Hkv, D] must be contiguous"
    row = hkv * d
    _store_kv_kernel[(num_tokens,)](
        k, v, kv_cache, slot_ids, k.stride(0), v.stride(0), kv_cache.shape[2],
        ROW=row, BLOCK=triton.next_power_of_2(row), num_warps=4,
    )


# ---- SwiGLU activation -------------------------------------------------------------------------

@triton.jit
def _silu_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, n_cols, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    g = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    u = tl.load(x_ptr + row * stride_x + n_cols + cols, mask=mask, other=0.0)
    g32 = g.to(tl.float32)
    act = (g32 / (1.0 + tl.exp(-g32))).to(g.dtype).to(tl.float32)  # F.silu rounds here too
    tl.store(out_ptr + row * stride_o + cols, (act * u.to(tl.float32)).to(g.dtype), mask=mask)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:  # [T, 2I] -> new [T, I]
    rows, two_i = gate_up.shape
    inter = two_i // 2
    out = torch.empty(rows, inter, dtype=gate_up.dtype, device=gate_up.device)
    if rows == 0:
        return out
    assert gate_up.stride(-1) == 1
    block = min(1024, triton.next_power_of_2(inter))
    _silu_mul_kernel[(rows, triton.cdiv(inter, block))](
        gate_up, out, gate_up.stride(0), out.stride(0), inter, BLOCK=block, num_warps=4,
    )
    return out


# ---- the largest entry of each row (greedy tokens, draft top-1) -------------------------------

@triton.jit
def _row_max_kernel(x_ptr, val_ptr, idx_ptr, n_cols, stride_x, num_chunks,
                    BLOCK: tl.constexpr):
    """Program (row, c): the max of row `row` over columns [c * BLOCK, (c + 1) * BLOCK) and its
    first column, into slot row * num_chunks + c. NaN counts as the largest value (torch.max's
    order): a chunk holding one reports its first NaN."""
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    cols = c * BLOCK + tl.arange(0, BLOCK)
    inside = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=inside, other=float("-inf")).to(tl.float32)
    first_nan = tl.min(tl.where((x != x) & inside, cols, n_cols), axis=0)
    best = tl.max(x, axis=0)
    first_best = tl.min(tl.where((x == best) & inside, cols, n_cols), axis=0)
    has_nan = first_nan < n_cols
    slot = row * num_chunks + c
    tl.store(val_ptr + slot, tl.where(has_nan, float("nan"), best))
    tl.store(idx_ptr + slot, tl.where(has_nan, first_nan, first_best).to(tl.int64))


@triton.jit
def _row_max_merge_kernel(pval_ptr, pidx_ptr, val_ptr, idx_ptr, num_chunks,
                          BLOCK_C: tl.constexpr):
    """Program row: the chunks' maxima -> the row's (ties and NaN: the lowest chunk wins, and
    within a chunk its kernel kept the lowest column)."""
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BLOCK_C)
    inside = c < num_chunks
    v = tl.load(pval_ptr + row * num_chunks + c, mask=inside, other=float("-inf"))
    i = tl.load(pidx_ptr + row * num_chunks + c, mask=inside, other=0)
    first_nan = tl.min(tl.where((v != v) & inside, c, BLOCK_C), axis=0)
    best = tl.max(v, axis=0)
    first_best = tl.min(tl.where((v == best) & inside, c, BLOCK_C), axis=0)
    pick = tl.where(first_nan < BLOCK_C, first_nan, first_best)
    tl.store(val_ptr + row, tl.load(pval_ptr + row * num_chunks + pick))
    tl.store(idx_ptr + row, tl.load(pidx_ptr + row * num_chunks + pick))


ROW_MAX_BLOCK = 4096  # columns a program reduces (one pass at the draft head's 8k: two chunks)


def row_max(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """See `torch_ops.row_max`. Rows of many columns split over programs: torch's reduction
    gives a few-row, 49k-column max to a few blocks (12.8 us for 5 rows on an H200, in every
    speculative round); here each row's chunks run side by side and a second launch merges
    them."""
    rows, n_cols = x.shape
    assert x.stride(-1) == 1 and n_cols > 0
    val = torch.empty(rows, dtype=torch.float32, device=x.device)
    idx = torch.empty(rows, dtype=torch.int64, device=x.device)
    if rows == 0:
        return val.to(x.dtype), idx
    chunks = triton.cdiv(n_cols, ROW_MAX_BLOCK)
    block = min(ROW_MAX_BLOCK, triton.next_power_of_2(n_cols))
    if chunks == 1:
        _row_max_kernel[(rows, 1)](x, val, idx, n_cols, x.stride(0), 1, BLOCK=block,
                                   num_warps=8)
    else:
        pval = torch.empty(rows * chunks, dtype=torch.float32, device=x.device)
        pidx = torch.empty(rows * chunks, dtype=torch.int64, device=x.device)
        _row_max_kernel[(rows, chunks)](x, pval, pidx, n_cols, x.stride(0), chunks,
                                        BLOCK=block, num_warps=8)
        _row_max_merge_kernel[(rows,)](pval, pidx, val, idx, chunks,
                                       BLOCK_C=triton.next_power_of_2(chunks), num_warps=1)
    return (val if x.dtype == torch.float32 else val.to(x.dtype)), idx
