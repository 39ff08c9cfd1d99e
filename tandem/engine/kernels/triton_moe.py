"""Fused-MoE Triton kernels: a grouped GEMM over blocks of sorted (token, slot) pairs that
share one expert (moe_blocks), in three launches per MoE layer:

1. `moe_gate_up`: per block, the block's token rows (gathered by pair) times its expert's gate
   and up rows, SiLU(gate) * up -> h [R, I] in sorted order.
2. `moe_down`: per block, h times the expert's down rows -> each pair's output row [A, H]
   (unweighted; pairs of other ranks' experts keep the zeros they start with).
3. `moe_weighted_sum`: per token, its k rows times their routing weights, added in ascending
   expert id: a fixed order, so the result is deterministic (no atomics anywhere).

Imported only on CUDA (or by CPU tests under TRITON_INTERPRET=1). Twins: torch_moe, the same
signatures; the roundings to the model dtype between steps are the twins' (and the old expert
loop's), so bf16 results match them within one rounding of the matmul accumulation order.
Unused blocks (block_expert -1) exit at once: the grid is fixed by the batch's shapes, the
work by the routing, and nothing reads a count on the host.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from tandem.engine.kernels.moe_blocks import MoeBlocks

BLOCK_N = 64  # output columns per program
# The interpreter's tl.dot reads bf16 operands as raw 16-bit integers (numpy has no bf16):
# under it the operands go up to float32 first, which multiplies the same values exactly.
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _load_k_step(
    a_ptr, a_rows, a_ok, stride_a, w_ptr, w_rows, w_ok, stride_wn, k0, n_k,
    BLOCK_K: tl.constexpr, UPCAST: tl.constexpr,
):
    """One K step of a grouped tile: a [BLOCK_M, BLOCK_K] from rows a_rows of a [*, K], and
    w^T [BLOCK_K, BLOCK_N] from rows w_rows of w [*, K]; masked rows/columns/K read 0. (The
    interpreter cannot range over a scalar argument: the kernels loop over NUM_K, a
    constexpr.)"""
    ks = k0 + tl.arange(0, BLOCK_K)
    k_ok = ks < n_k
    a = tl.load(a_ptr + a_rows[:, None] * stride_a + ks[None, :],
                mask=a_ok[:, None] & k_ok[None, :], other=0.0)
    w = tl.load(w_ptr + w_rows[None, :] * stride_wn + ks[:, None],
                mask=w_ok[None, :] & k_ok[:, None], other=0.0)
    if UPCAST:
        return a.to(tl.float32), w.to(tl.float32)
    return a, w


@triton.jit
def _gate_up_kernel(
    x_ptr, w_ptr, out_ptr, pairs_ptr, block_expert_ptr,
    num_pairs, top_k, n_inter, n_hidden, stride_x, stride_we, stride_wn, stride_o,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NUM_K: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):
    expert = tl.load(block_expert_ptr + tl.program_id(0))
    if expert < 0:
        return
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)  # sorted rows of this block
    pairs = tl.load(pairs_ptr + rows)
    row_ok = pairs < num_pairs  # padding rows carry num_pairs
    tokens = (pairs // top_k).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < n_inter
    w_e = w_ptr + expert.to(tl.int64) * stride_we
    gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for i in range(NUM_K):  # NUM_K = cdiv(H, BLOCK_K), a constant per weight shape
        k0 = i * BLOCK_K
        a, w_gate = _load_k_step(x_ptr, tokens, row_ok, stride_x, w_e, cols, col_ok,
                                 stride_wn, k0, n_hidden, BLOCK_K, UPCAST)
        _, w_up = _load_k_step(x_ptr, tokens, row_ok, stride_x, w_e, cols + n_inter, col_ok,
                               stride_wn, k0, n_hidden, BLOCK_K, UPCAST)
        gate = tl.dot(a, w_gate, gate, input_precision=PRECISION)
        up = tl.dot(a, w_up, up, input_precision=PRECISION)
    dtype = out_ptr.dtype.element_ty
    # the twin's roundings: gate_up in the model dtype, silu(gate) too, then the product
    gate = gate.to(dtype).to(tl.float32)
    act = (gate * tl.sigmoid(gate)).to(dtype).to(tl.float32)
    h = act * up.to(dtype).to(tl.float32)
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * stride_o + cols[None, :], h.to(dtype),
             mask=col_ok[None, :])


@triton.jit
def _down_kernel(
    h_ptr, w_ptr, out_ptr, pairs_ptr, block_expert_ptr,
    num_pairs, n_hidden, n_inter, stride_h, stride_we, stride_wn, stride_o,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NUM_K: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):
    expert = tl.load(block_expert_ptr + tl.program_id(0))
    if expert < 0:
        return
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(pairs_ptr + rows)
    row_ok = pairs < num_pairs
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < n_hidden
    w_e = w_ptr + expert.to(tl.int64) * stride_we
    y = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for i in range(NUM_K):  # NUM_K = cdiv(I, BLOCK_K)
        k0 = i * BLOCK_K
        a, w = _load_k_step(h_ptr, rows.to(tl.int64), row_ok, stride_h, w_e, cols, col_ok,
                            stride_wn, k0, n_inter, BLOCK_K, UPCAST)
        y = tl.dot(a, w, y, input_precision=PRECISION)
    # each pair appears in one sorted row: one writer per output row
    tl.store(out_ptr + pairs.to(tl.int64)[:, None] * stride_o + cols[None, :],
             y.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _weighted_sum_kernel(
    y_ptr, w_ptr, order_ptr, out_ptr, n_cols, stride_yt, stride_yk, stride_wt, stride_o,
    TOP_K: tl.constexpr, BLOCK: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < n_cols
    dtype = out_ptr.dtype.element_ty
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for j in tl.static_range(TOP_K):  # ascending expert id; rounded after each add (twin)
        slot = tl.load(order_ptr + token * TOP_K + j)
        wt = tl.load(w_ptr + token * stride_wt + slot).to(tl.float32)
        y = tl.load(y_ptr + token * stride_yt + slot * stride_yk + cols, mask=ok,
                    other=0.0).to(tl.float32)
        acc = (acc + (y * wt).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
    tl.store(out_ptr + token * stride_o + cols, acc.to(dtype), mask=ok)


def _precision(dtype: torch.dtype) -> str:
    # float32 stays IEEE (tf32 would be ~1e-3 off the float32 oracle)
    return "ieee" if dtype == torch.float32 else "tf32"


def _block_k(dtype: torch.dtype) -> int:
    return 32 if dtype == torch.float32 else 64


def moe_gate_up(x: torch.Tensor, w13: torch.Tensor, blocks: MoeBlocks) -> torch.Tensor:
    """x [T, H], w13 [E_local, 2I, H] -> h [R, I] (rows of unused blocks are not written)."""
    assert x.stride(1) == 1 and w13.stride(2) == 1
    n_inter = w13.shape[1] // 2
    out = x.new_empty(blocks.num_rows, n_inter)  # [R, I]
    if blocks.num_rows == 0:
        return out
    grid = (blocks.num_rows // blocks.block, triton.cdiv(n_inter, BLOCK_N))
    block_k = _block_k(x.dtype)
    _gate_up_kernel[grid](
        x, w13, out, blocks.sorted_pairs, blocks.block_expert,
        blocks.num_pairs, blocks.top_k, n_inter, x.shape[1],
        x.stride(0), w13.stride(0), w13.stride(1), out.stride(0),
        BLOCK_M=blocks.block, BLOCK_N=BLOCK_N, BLOCK_K=block_k,
        NUM_K=triton.cdiv(x.shape[1], block_k),
        PRECISION=_precision(x.dtype), UPCAST=INTERPRET, num_warps=4, num_stages=3,
    )
    return out


def moe_down(h: torch.Tensor, w2: torch.Tensor, blocks: MoeBlocks) -> torch.Tensor:
    """h [R, I], w2 [E_local, H, I] -> [A, H] unweighted output per pair (0: not local)."""
    assert h.stride(1) == 1 and w2.stride(2) == 1
    n_hidden = w2.shape[1]
    out = h.new_zeros(blocks.num_pairs, n_hidden)  # [A, H]
    if blocks.num_rows == 0:
        return out
    grid = (blocks.num_rows // blocks.block, triton.cdiv(n_hidden, BLOCK_N))
    block_k = _block_k(h.dtype)
    _down_kernel[grid](
        h, w2, out, blocks.sorted_pairs, blocks.block_expert,
        blocks.num_pairs, n_hidden, h.shape[1], h.stride(0), w2.stride(0), w2.stride(1),
        out.stride(0),
        BLOCK_M=blocks.block, BLOCK_N=BLOCK_N, BLOCK_K=block_k,
        NUM_K=triton.cdiv(h.shape[1], block_k),
        PRECISION=_precision(h.dtype), UPCAST=INTERPRET, num_warps=4, num_stages=3,
    )
    return out


def moe_weighted_sum(
    y: torch.Tensor, weights: torch.Tensor, slot_order: torch.Tensor
) -> torch.Tensor:
    """y [T, k, H], weights [T, k], slot_order [T, k] int64 -> [T, H] (see torch_moe)."""
    num_tokens, top_k, n_cols = y.shape
    assert y.stride(2) == 1
    out = y.new_empty(num_tokens, n_cols)  # [T, H]
    if num_tokens == 0:
        return out
    order = slot_order.contiguous()
    block = min(1024, triton.next_power_of_2(n_cols))
    _weighted_sum_kernel[(num_tokens, triton.cdiv(n_cols, block))](
        y, weights, order, out, n_cols, y.stride(0), y.stride(1), weights.stride(0),
        out.stride(0), TOP_K=top_k, BLOCK=block, num_warps=4,
    )
    return out
