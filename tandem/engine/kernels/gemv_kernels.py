"""The Triton kernels behind `triton_gemv.gemv` (which picks and launches them): `gemv_kernel`
for one row of x, `rows_kernel` (tensor cores) and `rows_fma_kernel` (CUDA cores) for 2..8 rows
(each weight tile read once for all rows), and the fused neighbours they share - the weight
tile load, the SiLU-and-mul prologue and the residual epilogue, each rounded like its torch
twin (see triton_gemv's docstring for the fusions)."""

from __future__ import annotations

import os

import triton
import triton.language as tl

# The interpreter (CPU tests) runs these kernels too: its bf16 dot multiplies raw bits, so
# rows_kernel takes F32_DOT there, and tuning takes the first candidate untimed.
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _weight_tile(row_ptr, rows, cols, kmask, n_rows, EVEN: tl.constexpr):
    """The [BLOCK_N, BLOCK_K] weight tile at (rows, cols), streamed once (evict first)."""
    if EVEN:
        w = tl.load(row_ptr + cols[None, :], eviction_policy="evict_first")
    else:
        wmask = (rows[:, None] < n_rows) & kmask[None, :]
        w = tl.load(row_ptr + cols[None, :], mask=wmask, other=0.0,
                    eviction_policy="evict_first")
    return w


@triton.jit
def _silu_mul(gate, up):
    """float32 silu(gate) * up, rounded to the input dtype after each op as
    `torch_ops.silu_and_mul` does (any shape)."""
    g = gate.to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(gate.dtype).to(tl.float32)
    return (act * up.to(tl.float32)).to(gate.dtype).to(tl.float32)


@triton.jit
def _add_residual(out, res):
    """out (float32) + residual, rounded like the twin: product to the model dtype, then a
    model-dtype add."""
    return (out.to(res.dtype).to(tl.float32) + res.to(tl.float32)).to(res.dtype)


@triton.jit
def gemv_kernel(
    x_ptr, w_ptr, out_ptr, norm_ptr, res_ptr, n_rows, n_cols, stride_w, eps,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NUM_K: tl.constexpr, ITERS: tl.constexpr,
    EVEN: tl.constexpr, NORM: tl.constexpr, SILU_MUL: tl.constexpr, RESIDUAL: tl.constexpr,
    PDL: tl.constexpr = False, ROW_GRID: tl.constexpr = False,
):
    """out[n] = sum_k w[n, k] * x'[k] (+ residual[n]). Program p streams the row blocks
    p, p + grid, ... (ITERS of them): one block each, or a persistent grid that balances
    blocks over the SMs. Loop bounds are constants (the interpreter needs them). PDL: launched
    as a programmatic dependent (kernels/pdl.py): wait for the kernel before first. ROW_GRID
    (`GridConfig`): program axis 1 is a row m of x [M, K], out [M, N] and residual [M, N]."""
    if PDL:
        tl.extra.cuda.gdc_wait()
    if ROW_GRID:
        m = tl.program_id(1)
        x_ptr += m * (2 * n_cols if SILU_MUL else n_cols)
        out_ptr += m * n_rows
        res_ptr += m * n_rows
    for it in range(ITERS):
        _gemv_rows(
            x_ptr, w_ptr, out_ptr, norm_ptr, res_ptr, n_rows, n_cols, stride_w, eps,
            tl.program_id(0) + it * tl.num_programs(0), BLOCK_N, BLOCK_K, NUM_K, EVEN, NORM,
            SILU_MUL, RESIDUAL,
        )


@triton.jit
def _gemv_rows(
    x_ptr, w_ptr, out_ptr, norm_ptr, res_ptr, n_rows, n_cols, stride_w, eps, block,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NUM_K: tl.constexpr, EVEN: tl.constexpr,
    NORM: tl.constexpr, SILU_MUL: tl.constexpr, RESIDUAL: tl.constexpr,
):
    out, rows, rmask = gemv_block(x_ptr, w_ptr, norm_ptr, res_ptr, n_rows, n_cols, stride_w,
                                  eps, block, BLOCK_N, BLOCK_K, NUM_K, EVEN, NORM, SILU_MUL,
                                  RESIDUAL)
    tl.store(out_ptr + rows, out.to(out_ptr.dtype.element_ty), mask=rmask)


@triton.jit
def gemv_block(
    x_ptr, w_ptr, norm_ptr, res_ptr, n_rows, n_cols, stride_w, eps, block,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NUM_K: tl.constexpr, EVEN: tl.constexpr,
    NORM: tl.constexpr, SILU_MUL: tl.constexpr, RESIDUAL: tl.constexpr,
):
    """Weight rows [block * BLOCK_N, (block + 1) * BLOCK_N) of the one-row product, before
    the store: (values [BLOCK_N] -- float32, or the residual's dtype after the add --, the
    rows, their mask). `gemv_kernel` stores them; triton_gemv_ar sums them over TP ranks
    first."""
    rows = block * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ptr = w_ptr + rows.to(tl.int64)[:, None] * stride_w
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    sq = tl.zeros([BLOCK_K], dtype=tl.float32)
    for i in range(NUM_K):  # NUM_K = cdiv(n_cols, BLOCK_K), a constant per weight shape
        cols = i * BLOCK_K + tl.arange(0, BLOCK_K)
        kmask = cols < n_cols
        w = _weight_tile(row_ptr, rows, cols, kmask, n_rows, EVEN)
        x = tl.load(x_ptr + cols, mask=kmask, other=0.0)
        if SILU_MUL:  # x_ptr holds [gate | up], n_cols = len(gate)
            xf = _silu_mul(x, tl.load(x_ptr + n_cols + cols, mask=kmask, other=0.0))
        else:
            xf = x.to(tl.float32)
        if NORM:
            sq += xf * xf
            xf = xf * tl.load(norm_ptr + cols, mask=kmask, other=0.0).to(tl.float32)
        acc += w.to(tl.float32) * xf[None, :]
    out = tl.sum(acc, axis=1)
    if NORM:
        out = out / tl.sqrt(tl.sum(sq, axis=0) / n_cols + eps)
    rmask = rows < n_rows
    if RESIDUAL:
        out = _add_residual(out, tl.load(res_ptr + rows, mask=rmask, other=0.0))
    return out, rows, rmask


@triton.jit
def rows_kernel(
    x_ptr, w_ptr, out_ptr, norm_ptr, res_ptr, num_x_rows, n_rows, n_cols, stride_w, eps,
    M_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NUM_K: tl.constexpr,
    EVEN: tl.constexpr, NORM: tl.constexpr, SILU_MUL: tl.constexpr, RESIDUAL: tl.constexpr,
    F32_DOT: tl.constexpr, PDL: tl.constexpr = False,
):
    """out[m, n] = sum_k w[n, k] * x'[m, k] (+ residual[m, n]) for the num_x_rows <= M_PAD
    rows of x. Program p streams weight rows [p * BLOCK_N, (p + 1) * BLOCK_N) once over K and
    multiplies each [BLOCK_N, BLOCK_K] tile against every row of x on the tensor cores, as
    out^T = W @ x'^T ("swap AB": the weight tile is the MMA's tall A operand as stored, the
    few x rows, zero-padded to M_PAD, its narrow B operand; Triton pads a dot to the MMA
    shape, so M_PAD = 8 costs no more than 2). The loop over K is software-pipelined
    (num_stages), which keeps enough weight bytes in flight per SM without the huge BLOCK_K
    the one-row kernel needs.

    Rounding: like `gemv_kernel` per row, except that the MMA takes its x operand in the
    weight dtype, so the RMSNorm prologue rounds norm_weight * x to bf16 (the twin rounds the
    normed row to bf16 too); plain and SiLU-mul inputs are bf16 values already."""
    if PDL:  # launched as a programmatic dependent (kernels/pdl.py)
        tl.extra.cuda.gdc_wait()
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N] weight rows
    ms = tl.arange(0, M_PAD)  # [M_PAD] x rows
    mmask = ms < num_x_rows
    row_ptr = w_ptr + rows.to(tl.int64)[:, None] * stride_w  # [BLOCK_N, 1]
    x_row_ptr = x_ptr + ms[:, None] * (2 * n_cols if SILU_MUL else n_cols)  # [M_PAD, 1]
    acc = tl.zeros([BLOCK_N, M_PAD], dtype=tl.float32)  # out^T
    sq = tl.zeros([M_PAD, BLOCK_K], dtype=tl.float32)  # each x row's sum of squares (NORM)
    for i in range(NUM_K):  # NUM_K = cdiv(n_cols, BLOCK_K), a constant per weight shape
        cols = i * BLOCK_K + tl.arange(0, BLOCK_K)
        kmask = cols < n_cols
        w = _weight_tile(row_ptr, rows, cols, kmask, n_rows, EVEN)
        xmask = mmask[:, None] & kmask[None, :]  # padding rows load nothing
        x = tl.load(x_row_ptr + cols[None, :], mask=xmask, other=0.0)  # [M_PAD, BLOCK_K]
        if SILU_MUL:  # row m of x holds [gate | up], n_cols = len(gate)
            xf = _silu_mul(x, tl.load(x_row_ptr + n_cols + cols[None, :], mask=xmask,
                                      other=0.0))
        else:
            xf = x.to(tl.float32)
        if NORM:
            sq += xf * xf
            xf = xf * tl.load(norm_ptr + cols, mask=kmask, other=0.0).to(tl.float32)[None, :]
        if F32_DOT:  # float32 weights, or the interpreter (its bf16 dot multiplies raw bits)
            acc = tl.dot(w.to(tl.float32), tl.trans(xf), acc, input_precision="ieee")
        else:
            acc = tl.dot(w, tl.trans(xf.to(w.dtype)), acc)
    out = acc  # [BLOCK_N, M_PAD]
    if NORM:
        out = out / tl.sqrt(tl.sum(sq, axis=1) / n_cols + eps)[None, :]
    omask = (rows < n_rows)[:, None] & mmask[None, :]
    offs = ms[None, :].to(tl.int64) * n_rows + rows[:, None]  # [BLOCK_N, M_PAD] into [M, N]
    if RESIDUAL:
        out = _add_residual(out, tl.load(res_ptr + offs, mask=omask, other=0.0))
    tl.store(out_ptr + offs, out.to(out_ptr.dtype.element_ty), mask=omask)


@triton.jit
def rows_fma_kernel(
    x_ptr, w_ptr, out_ptr, norm_ptr, res_ptr, n_rows, n_cols, stride_w, eps,
    M: tl.constexpr, M_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    NUM_K: tl.constexpr, EVEN: tl.constexpr, NORM: tl.constexpr, SILU_MUL: tl.constexpr,
    RESIDUAL: tl.constexpr, PDL: tl.constexpr = False,
):
    """What `rows_kernel` computes, on the CUDA cores: each [BLOCK_N, BLOCK_K] weight tile is
    loaded once and multiplied against the M rows of x one after another (a one-row GEMV per
    row, sharing the tile). For narrow weights (SmolLM2's 576-wide rows) the tensor-core
    kernel's MMA tiles leave too few programs and too long a pipeline prologue for a ~1.7 MB
    weight; this one keeps the one-row kernel's shape (few weight rows, all of K in one or
    a few steps, many programs). M is a constant (the tuner keys by row count anyway); M_PAD
    its next power of two, the accumulator's height.

    Rounding: per row like `gemv_kernel` (float32 prologues, no rounding of the normed x); the
    product is reduced at each K step (the one-row kernel reduces once, after the last), so
    the float32 sums may differ from it in the last bits."""
    if PDL:  # launched as a programmatic dependent (kernels/pdl.py)
        tl.extra.cuda.gdc_wait()
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N] weight rows
    ms = tl.arange(0, M_PAD)  # [M_PAD] x rows (M of them real)
    row_ptr = w_ptr + rows.to(tl.int64)[:, None] * stride_w  # [BLOCK_N, 1]
    x_stride = 2 * n_cols if SILU_MUL else n_cols
    acc = tl.zeros([M_PAD, BLOCK_N], dtype=tl.float32)  # out
    sq = tl.zeros([M_PAD], dtype=tl.float32)  # each x row's sum of squares (NORM)
    for i in range(NUM_K):  # NUM_K = cdiv(n_cols, BLOCK_K), a constant per weight shape
        cols = i * BLOCK_K + tl.arange(0, BLOCK_K)
        kmask = cols < n_cols
        w = _weight_tile(row_ptr, rows, cols, kmask, n_rows, EVEN).to(tl.float32)
        if NORM:
            nw = tl.load(norm_ptr + cols, mask=kmask, other=0.0).to(tl.float32)
        for m in tl.static_range(M):
            x = tl.load(x_ptr + m * x_stride + cols, mask=kmask, other=0.0)  # [BLOCK_K]
            if SILU_MUL:  # row m holds [gate | up], n_cols = len(gate)
                xf = _silu_mul(x, tl.load(x_ptr + m * x_stride + n_cols + cols, mask=kmask,
                                          other=0.0))
            else:
                xf = x.to(tl.float32)
            if NORM:
                sq = tl.where(ms == m, sq + tl.sum(xf * xf, axis=0), sq)
                xf = xf * nw
            part = tl.sum(w * xf[None, :], axis=1)  # [BLOCK_N]
            acc = tl.where((ms == m)[:, None], acc + part[None, :], acc)
    out = acc  # [M_PAD, BLOCK_N]
    if NORM:
        out = out / tl.sqrt(sq / n_cols + eps)[:, None]
    omask = (ms < M)[:, None] & (rows < n_rows)[None, :]
    offs = ms[:, None].to(tl.int64) * n_rows + rows[None, :]  # [M_PAD, BLOCK_N] into [M, N]
    if RESIDUAL:
        out = _add_residual(out, tl.load(res_ptr + offs, mask=omask, other=0.0))
    tl.store(out_ptr + offs, out.to(out_ptr.dtype.element_ty), mask=omask)
