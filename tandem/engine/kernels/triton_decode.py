"""Triton kernels of decode steps whose metadata lives on the device (chain drafting, verify
and draft-extend rows, plain decode graphs: `engine/attention/device_decode.py`): paged decode
attention split over the keys with its merge, and the rows' plan (positions, key counts, K/V
slots, page-table rows). Each has a torch twin in `torch_ops`, which the CPU tests compare
through the Triton interpreter."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tandem.engine.kernels.triton_ops import INTERPRET


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


@triton.jit
def _decode_rows_plan_kernel(
    table_ptr, base_ptr, pos_ptr, lens_ptr, slot_ptr, rows_ptr, stride_t, stride_r, n_pages,
    rows_per_seq, page_size,
    REPEAT: tl.constexpr, BLOCK_P: tl.constexpr, NUM_P: tl.constexpr,
):
    """Program r (row j = r % R of sequence b = r // R): its position base[b] + j, key count,
    K/V slot and (REPEAT) a copy of b's page-table row."""
    r = tl.program_id(0)
    b = (r // rows_per_seq).to(tl.int64)
    pos = tl.load(base_ptr + b) + r % rows_per_seq  # int64
    page = tl.load(table_ptr + b * stride_t + pos // page_size).to(tl.int64)
    tl.store(pos_ptr + r, pos)
    tl.store(lens_ptr + r, pos + 1)
    tl.store(slot_ptr + r, page * page_size + pos % page_size)
    if REPEAT:
        for i in range(NUM_P):  # NUM_P = cdiv(P, BLOCK_P), a constant per table shape
            cols = i * BLOCK_P + tl.arange(0, BLOCK_P)
            keep = cols < n_pages
            row = tl.load(table_ptr + b * stride_t + cols, mask=keep)
            tl.store(rows_ptr + r.to(tl.int64) * stride_r + cols, row, mask=keep)


def decode_rows_plan(
    table: torch.Tensor, base: torch.Tensor, rows_per_seq: int, page_size: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`torch_ops.decode_rows_plan` in one launch (it was ~10 small ones: a draft step's or a
    verify's plan, inside the speculative graphs). table [B, P] int32 (last dim contiguous),
    base [B] int64."""
    bs, n_pages = table.shape
    assert table.dtype == torch.int32 and table.stride(1) == 1 and base.dtype == torch.int64
    n = bs * rows_per_seq
    dev = base.device
    positions = torch.empty(n, dtype=torch.int64, device=dev)  # [B * R]
    lens = torch.empty(n, dtype=torch.int64, device=dev)
    slots = torch.empty(n, dtype=torch.int64, device=dev)
    repeat = rows_per_seq > 1
    rows = (torch.empty(n, n_pages, dtype=torch.int32, device=dev) if repeat
            else table)  # [B * R, P]
    if n:
        block_p = min(1024, triton.next_power_of_2(max(n_pages, 1)))
        _decode_rows_plan_kernel[(n,)](
            table, base, positions, lens, slots, rows, table.stride(0), rows.stride(0),
            n_pages, rows_per_seq, page_size,
            REPEAT=repeat, BLOCK_P=block_p, NUM_P=triton.cdiv(n_pages, block_p), num_warps=1,
        )
    return positions, lens, slots, rows
