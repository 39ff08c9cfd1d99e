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


# ---- paged decode attention, split over the keys (flash-decoding) ----------------------------
# All metadata is read on the device: kv_lens [B] decide each program's key range inside the
# kernel, so a CUDA graph replays draft steps whose lengths grew on the device, with no host
# planning. Shapes depend on (B, Hq, D, num_splits) only.

PAGED_DECODE_BLOCK_N = 32  # keys per inner step: 2 steps at 40 keys exercise the rescaling
# Split programs a launch aims for: a small batch splits its keys finer than the engine's
# count (a function of the context alone) asks. On an H100 (benchmarks/gpu_attn_micro.py,
# graphs over 32 layers' pages) the best launch had 256-512 programs: Llama-8B per TP-2 rank
# (4 KV heads, 1,071 keys) at batch 1 took 8.5 us at 32 splits against 11.8 at 7 (FlashInfer's
# decode 11.4), at batch 8 13.6 at 16; SmolLM2 (3 KV heads, 516 keys) at batch 1 4.7 at 32.
PAGED_DECODE_PROGRAMS = 512
PAGED_DECODE_MAX_SPLITS = 32


def decode_split_count(num_splits: int, batch: int, num_kv_heads: int) -> int:
    """The splits a launch of `batch` rows x `num_kv_heads` runs: at least `num_splits` (the
    engine's, from its longest context), more while the launch has fewer programs than
    PAGED_DECODE_PROGRAMS (up to 32). A function of the shapes only: a CUDA graph and an
    eager call of one shape sum in the same order."""
    want = -(-PAGED_DECODE_PROGRAMS // max(1, batch * num_kv_heads))
    return max(num_splits, min(PAGED_DECODE_MAX_SPLITS, want))


@triton.jit
def _paged_decode_block(
    q, m_i, l_i, acc, n0, end, table_row, cache_ptr, kv_head, stride_cp, stride_ckv,
    stride_ct, stride_ch, stride_tp, scale,
    PAGE_SIZE: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr, F32_DOT: tl.constexpr,
):
    """One online-softmax step over keys n0 .. n0 + BLOCK_N - 1 (those < end) of one sequence
    (table_row: its page-table row). q [BLOCK_G, D]; returns the updated running max m_i
    [BLOCK_G], sum l_i [BLOCK_G] and weighted V acc [BLOCK_G, D], all float32."""
    d = tl.arange(0, D)
    t = n0 + tl.arange(0, BLOCK_N)  # [BLOCK_N] key positions
    t_mask = t < end
    page = tl.load(table_row + (t // PAGE_SIZE) * stride_tp, mask=t_mask, other=0).to(tl.int64)
    k_rows = cache_ptr + page * stride_cp + (t % PAGE_SIZE) * stride_ct + kv_head * stride_ch
    k = tl.load(k_rows[:, None] + d[None, :], mask=t_mask[:, None], other=0.0)  # [N, D]
    v = tl.load(k_rows[:, None] + stride_ckv + d[None, :], mask=t_mask[:, None], other=0.0)
    if F32_DOT:  # the interpreter: its bf16 dot multiplies raw bits
        q, k, v = q.to(tl.float32), k.to(tl.float32), v.to(tl.float32)
    # ieee: float32 q/K stay exact (tf32 would not); ignored for 16-bit inputs.
    s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale  # [BLOCK_G, N] float32
    s = tl.where(t_mask[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))  # finite: a step has >= 1 valid key
    alpha = tl.exp(m_i - m_new)  # 0 on the first step (m_i = -inf)
    p = tl.exp(s - m_new[:, None])  # [BLOCK_G, N] float32, 0 at masked keys
    l_i = l_i * alpha + tl.sum(p, axis=1)
    # 16-bit KV: p is rounded to V's dtype for the tensor-core product (as flash attention
    # does); the sum stays float32.
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
    return m_new, l_i, acc


@triton.jit
def _paged_decode_split_kernel(
    q_ptr, cache_ptr, table_ptr, lens_ptr, part_ptr, lse_ptr,
    stride_qb, stride_qh, stride_cp, stride_ckv, stride_ct, stride_ch, stride_tb, stride_tp,
    stride_len, scale, num_q_heads, group, num_splits,
    PAGE_SIZE: tl.constexpr, D: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    """Program (b, kv_head, split): the `group` query heads of kv_head over split's chunk of
    sequence b's keys. Writes part [B, Hq, S, D] float32 (softmax-weighted V of the chunk, already
    normalised) and lse [B, Hq, S] float32 (log-sum-exp of the chunk's scores; -inf if empty)."""
    b = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    kv_len = tl.load(lens_ptr + b * stride_len).to(tl.int32)
    chunk = tl.cdiv(kv_len, num_splits)  # keys per split; the last splits may get none
    start = split * chunk
    end = tl.minimum(start + chunk, kv_len)

    g = tl.arange(0, BLOCK_G)  # [BLOCK_G] rows >= group are padding for tl.dot's minimum 16
    d = tl.arange(0, D)
    heads = kv_head * group + g
    g_mask = g < group
    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + d[None, :],
                mask=g_mask[:, None], other=0.0)  # [BLOCK_G, D] q.dtype

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)  # running max of the scores
    l_i = tl.zeros([BLOCK_G], tl.float32)  # running sum of exp(score - m_i)
    acc = tl.zeros([BLOCK_G, D], tl.float32)  # running sum of exp(score - m_i) * V
    table_row = table_ptr + b * stride_tb
    if INTERPRET:
        # The interpreter cannot take tensor bounds in range() (int() of its [1] scalars fails
        # under numpy 2); a while loop is the same walk, without the GPU's load pipelining.
        n0 = start
        while n0 < end:
            m_i, l_i, acc = _paged_decode_block(
                q, m_i, l_i, acc, n0, end, table_row, cache_ptr, kv_head, stride_cp,
                stride_ckv, stride_ct, stride_ch, stride_tp, scale, PAGE_SIZE, D, BLOCK_N,
                INTERPRET)
            n0 += BLOCK_N
    else:
        for n0 in range(start, end, BLOCK_N):
            m_i, l_i, acc = _paged_decode_block(
                q, m_i, l_i, acc, n0, end, table_row, cache_ptr, kv_head, stride_cp,
                stride_ckv, stride_ct, stride_ch, stride_tp, scale, PAGE_SIZE, D, BLOCK_N,
                INTERPRET)

    nonempty = l_i > 0
    out = tl.where(nonempty[:, None], acc / tl.where(nonempty, l_i, 1.0)[:, None], 0.0)
    lse = tl.where(nonempty, m_i + tl.log(tl.where(nonempty, l_i, 1.0)), float("-inf"))
    row = (b * num_q_heads + heads) * num_splits + split  # [BLOCK_G] (b, head, split) rows
    tl.store(part_ptr + row[:, None] * D + d[None, :], out, mask=g_mask[:, None])
    tl.store(lse_ptr + row, lse, mask=g_mask)


@triton.jit
def _paged_decode_merge_kernel(
    part_ptr, lse_ptr, out_ptr, stride_ob, stride_oh, num_q_heads, num_splits,
    D: tl.constexpr, BLOCK_S: tl.constexpr,
):
    """Program (b, head): out = sum_s w_s part_s / sum_s w_s, w_s = exp(lse_s - max lse).
    A sequence without keys (lse all -inf) gets a zero row instead of NaN."""
    b = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, D)
    s_mask = s < num_splits
    row = (b * num_q_heads + head) * num_splits + s  # [BLOCK_S]
    lse = tl.load(lse_ptr + row, mask=s_mask, other=float("-inf"))
    m = tl.max(lse, axis=0)
    w = tl.exp(lse - tl.where(m > float("-inf"), m, 0.0))  # [BLOCK_S], 0 for empty splits
    parts = tl.load(part_ptr + row[:, None] * D + d[None, :], mask=s_mask[:, None], other=0.0)
    total = tl.sum(w, axis=0)
    out = tl.sum(w[:, None] * parts, axis=0) / tl.where(total > 0, total, 1.0)  # [D] float32
    tl.store(out_ptr + b * stride_ob + head * stride_oh + d, out.to(out_ptr.dtype.element_ty))


def paged_decode(
    q: torch.Tensor, kv_cache: torch.Tensor, page_table: torch.Tensor, kv_lens: torch.Tensor,
    scale: float, num_splits: int,
) -> torch.Tensor:
    """q [B, Hq, D]; kv_cache [num_pages, 2, page_size, Hkv, D] (last dim contiguous);
    page_table [B, P] int32; kv_lens [B] int32/int64 on the device -> new [B, Hq, D] q.dtype.
    Two launches, no host sync: the split kernel (B, Hkv, S), the merge (B, Hq); S is
    `decode_split_count(num_splits, B, Hkv)`."""
    batch, num_q_heads, d = q.shape
    page_size, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    assert d >= 16 and d & (d - 1) == 0, f"head_dim {d}: needs a power of two >= 16"
    assert num_q_heads % num_kv_heads == 0 and kv_cache.shape[4] == d and num_splits >= 1
    assert kv_cache.dtype == q.dtype and kv_cache.stride(4) == 1
    assert page_table.dtype == torch.int32 and kv_lens.dim() == 1
    group = num_q_heads // num_kv_heads
    num_splits = decode_split_count(num_splits, batch, num_kv_heads)
    q = q if q.stride(2) == 1 else q.contiguous()
    out = torch.empty(batch, num_q_heads, d, dtype=q.dtype, device=q.device)  # [B, Hq, D]
    if batch == 0:
        return out
    part = torch.empty(batch, num_q_heads, num_splits, d, dtype=torch.float32,
                       device=q.device)  # [B, Hq, S, D] float32 per-split outputs
    lse = torch.empty(batch, num_q_heads, num_splits, dtype=torch.float32,
                      device=q.device)  # [B, Hq, S] float32 per-split log-sum-exp
    _paged_decode_split_kernel[(batch, num_kv_heads, num_splits)](
        q, kv_cache, page_table, kv_lens, part, lse,
        q.stride(0), q.stride(1), kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2),
        kv_cache.stride(3), page_table.stride(0), page_table.stride(1), kv_lens.stride(0),
        scale, num_q_heads, group, num_splits,
        PAGE_SIZE=page_size, D=d, BLOCK_G=max(16, triton.next_power_of_2(group)),
        BLOCK_N=PAGED_DECODE_BLOCK_N, INTERPRET=INTERPRET, num_warps=4,
    )
    _paged_decode_merge_kernel[(batch, num_q_heads)](
        part, lse, out, out.stride(0), out.stride(1), num_q_heads, num_splits,
        D=d, BLOCK_S=triton.next_power_of_2(num_splits), num_warps=4,
    )
    return out
