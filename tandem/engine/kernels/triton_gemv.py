"""Triton matrix-vector products for batch-1 decode (and skinny products of up to 8 rows:
speculative verify, small decode batches), with the neighbours fused in.

At batch 1 every projection reads its whole weight once; what costs beyond that is the fixed
price of each launch (~2-3 us on an H100/H200). So the small ops around a projection run in
its prologue/epilogue instead of as kernels of their own:
- RMSNorm prologue: out = rstd(x) * W @ (norm_weight * x); the sum of squares accumulates in
  the same pass over x (no second pass, no rounding of the normed input to bf16 -- the
  multi-row kernel's MMA rounds norm_weight * x to bf16: within bf16 tolerance of the twin
  `W @ rms_norm(x)` either way, not bitwise);
- SiLU-and-mul prologue: x = silu(gate) * up, rounded like `torch_ops.silu_and_mul`;
- residual epilogue: out = bf16(W @ x) + residual, rounded like the twin (model dtype add);
- float32 output (the LM head's logits).
Each of these applies per row of x: with M rows, row m gets its own RMSNorm statistics, its
own [gate | up], and residual[m].

x of one row runs `gemv_kernel` (tuned: ~98% of copy bandwidth). x of 2..8 rows runs
`rows_kernel`, which loads each weight tile once and multiplies it against all rows on the
tensor cores (one read of the weight for M tokens), or `rows_fma_kernel`, the same on the CUDA
cores with the one-row kernel's tile shapes (narrow weights), or `gemv_kernel` once per row
over a 2-D grid (`GridConfig`: weights that stay in L2), or, where the first-call tuning
finds it faster, the unfused sequence (`UNFUSED`: cuBLAS + the Triton elementwise kernels),
so routing M <= 8 here is never slower per projection than what ran before. Choices are
recorded per kind of GPU (`tuning_file`): later processes take them untimed, so restarts run
the same kernels. On an H100 at M = 5 (benchmarks/gpu_micro.py --skinny) the kernel wins
qkv+norm (21.6 vs 23.8 us), o_proj+residual (14.4 vs 17.5), gate_up+norm (83.1 vs 85.2) and
the LM head (347 vs 378); UNFUSED wins down with SiLU-mul + residual (47.6 vs 58.7: the
per-program SiLU prologue over 8 padded rows costs more than the launch it saves). On an H200
the tuner picks `rows_fma_kernel` for SmolLM2's 576-wide sites at M = 2-5 and for no 8B site.

This module checks the arguments, routes by row count and launches; the kernels are in
gemv_kernels.py, the candidates and the choice among them (timing, the record) in
gemv_tuning.py. Callers import every name from here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton

from tandem.engine.kernels import pdl, triton_ops
from tandem.engine.kernels.gemv_kernels import (
    INTERPRET,
    gemv_kernel,
    rows_fma_kernel,
    rows_kernel,
)
from tandem.engine.kernels.gemv_tuning import (
    CONFIGS,
    ROWS_CONFIGS,
    TUNING_ENV,
    UNFUSED,
    Config,
    FmaConfig,
    GridConfig,
    RowsChoice,
    RowsConfig,
    choose,
    one_row_config,
    rows_candidates,
    rows_config,
    tuned_configs,
    tuning_file,
)

__all__ = [
    "CONFIGS", "MAX_ROWS", "ROWS_CONFIGS", "TUNING_ENV", "UNFUSED", "Config", "FmaConfig",
    "GridConfig", "RowsChoice", "RowsConfig", "choose", "gemv", "one_row_choice", "sm_count",
    "tuned_configs",
    "tuning_file", "unfused",
]

MAX_ROWS = 8  # x rows the multi-row kernel takes (its M_PAD)
_num_sms: dict[int, int] = {}  # device index -> SM count


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class _Fusion:
    """What one call folds around its product (the keyword arguments of `gemv`)."""

    norm_weight: torch.Tensor | None  # [K]
    eps: float
    silu_mul: bool
    residual: torch.Tensor | None  # [M, N] contiguous
    out_dtype: torch.dtype


def gemv(
    x: torch.Tensor,  # [M, K] (with silu_mul: [M, 2K] = gate | up), contiguous, 1 <= M <= 8
    weight: torch.Tensor,  # [N, K], rows contiguous
    *,
    norm_weight: torch.Tensor | None = None,  # [K]: RMSNorm each row of x first (eps below)
    eps: float = 0.0,
    silu_mul: bool = False,
    residual: torch.Tensor | None = None,  # [M, N] contiguous: added to the product
    out_dtype: torch.dtype | None = None,  # default x.dtype
    config: Config | RowsChoice | None = None,  # Config for M == 1, RowsChoice for M > 1
) -> torch.Tensor:  # new [M, N]
    n_rows, n_cols = weight.shape
    assert x.dim() == 2 and 1 <= x.shape[0] <= MAX_ROWS and x.is_contiguous()
    assert weight.stride(1) == 1 and x.shape[1] == (2 * n_cols if silu_mul else n_cols)
    assert not (norm_weight is not None and silu_mul)
    if residual is not None:
        assert residual.shape == (x.shape[0], n_rows) and residual.is_contiguous()
    if x.shape[0] > 1:
        assert config in (None, UNFUSED) or isinstance(
            config, (RowsConfig, FmaConfig, GridConfig)), config
        fusion = _Fusion(norm_weight=norm_weight, eps=eps, silu_mul=silu_mul,
                         residual=residual, out_dtype=out_dtype or x.dtype)
        return _gemm_rows(x, weight, fusion, config)
    assert not isinstance(config, (RowsConfig, FmaConfig, GridConfig, str)), config
    # One row: the tuned one-row kernel.
    out = torch.empty(1, n_rows, dtype=out_dtype or x.dtype, device=x.device)
    launch = _one_row_launcher(x, weight, out, norm_weight, eps, silu_mul, residual)
    if config is None:
        config = one_row_config(_one_row_key(weight, out, norm_weight, silu_mul, residual),
                                launch, weight)
    return launch(config)


def one_row_choice(
    x: torch.Tensor, weight: torch.Tensor, *, norm_weight: torch.Tensor | None = None,
    eps: float = 0.0, silu_mul: bool = False, residual: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> Config:
    """The one-row config `gemv` would run for these arguments (x [1, K]; tuned at first use,
    like gemv's: never inside a capture). triton_gemv_ar launches its kernel with it."""
    out = torch.empty(1, weight.shape[0], dtype=out_dtype or x.dtype, device=x.device)
    launch = _one_row_launcher(x, weight, out, norm_weight, eps, silu_mul, residual)
    return one_row_config(_one_row_key(weight, out, norm_weight, silu_mul, residual), launch,
                          weight)


def _one_row_key(weight: torch.Tensor, out: torch.Tensor, norm_weight: torch.Tensor | None,
                 silu_mul: bool, residual: torch.Tensor | None) -> tuple:
    n_rows, n_cols = weight.shape
    return (n_rows, n_cols, str(weight.dtype), norm_weight is not None, silu_mul,
            residual is not None, str(out.dtype))


def _one_row_launcher(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor,
                      norm_weight: torch.Tensor | None, eps: float, silu_mul: bool,
                      residual: torch.Tensor | None) -> Callable[..., torch.Tensor]:
    """launch(cfg, w=weight): `gemv_kernel` of x into `out` with config cfg."""
    n_rows, n_cols = weight.shape

    def launch(cfg: Config, w: torch.Tensor = weight) -> torch.Tensor:
        block_n, block_k, warps, per_sm = cfg
        blocks = triton.cdiv(n_rows, block_n)
        grid = min(blocks, per_sm * sm_count(x.device)) if per_sm else blocks
        iters = triton.cdiv(blocks, grid)
        gemv_kernel[(grid,)](
            x, w, out, norm_weight if norm_weight is not None else x,
            residual if residual is not None else out, n_rows, n_cols, w.stride(0), eps,
            BLOCK_N=block_n, BLOCK_K=block_k, NUM_K=triton.cdiv(n_cols, block_k), ITERS=iters,
            EVEN=(n_rows % block_n == 0 and n_cols % block_k == 0 and grid * iters == blocks),
            NORM=norm_weight is not None, SILU_MUL=silu_mul, RESIDUAL=residual is not None,
            PDL=pdl.ENABLED, num_warps=warps, **pdl.launch_options(),
        )
        return out

    return launch


def _gemm_rows(
    x: torch.Tensor,  # [M, K] or [M, 2K], 2 <= M <= MAX_ROWS
    weight: torch.Tensor,  # [N, K]
    fusion: _Fusion,
    config: RowsChoice | None,
) -> torch.Tensor:  # new [M, N]
    n_rows, n_cols = weight.shape
    num_x_rows = x.shape[0]
    norm_weight, residual = fusion.norm_weight, fusion.residual
    out = torch.empty(num_x_rows, n_rows, dtype=fusion.out_dtype, device=x.device)

    def launch(cfg: RowsChoice, w: torch.Tensor = weight) -> torch.Tensor:
        if cfg == UNFUSED:
            return unfused(x, w, norm_weight=norm_weight, eps=fusion.eps,
                           silu_mul=fusion.silu_mul, residual=residual,
                           out_dtype=fusion.out_dtype)
        if isinstance(cfg, FmaConfig):
            rows_fma_kernel[(triton.cdiv(n_rows, cfg.block_n),)](
                x, w, out, norm_weight if norm_weight is not None else x,
                residual if residual is not None else out, n_rows, n_cols, w.stride(0),
                fusion.eps, M=num_x_rows, M_PAD=triton.next_power_of_2(num_x_rows),
                BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
                NUM_K=triton.cdiv(n_cols, cfg.block_k),
                EVEN=(n_rows % cfg.block_n == 0 and n_cols % cfg.block_k == 0),
                NORM=norm_weight is not None, SILU_MUL=fusion.silu_mul,
                RESIDUAL=residual is not None, PDL=pdl.ENABLED, num_warps=cfg.num_warps,
                **pdl.launch_options(),
            )
            return out
        if isinstance(cfg, GridConfig):  # the one-row kernel per row of x (program axis 1)
            gemv_kernel[(triton.cdiv(n_rows, cfg.block_n), num_x_rows)](
                x, w, out, norm_weight if norm_weight is not None else x,
                residual if residual is not None else out, n_rows, n_cols, w.stride(0),
                fusion.eps, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
                NUM_K=triton.cdiv(n_cols, cfg.block_k), ITERS=1,
                EVEN=(n_rows % cfg.block_n == 0 and n_cols % cfg.block_k == 0),
                NORM=norm_weight is not None, SILU_MUL=fusion.silu_mul,
                RESIDUAL=residual is not None, PDL=pdl.ENABLED, ROW_GRID=True,
                num_warps=cfg.num_warps, **pdl.launch_options(),
            )
            return out
        assert isinstance(cfg, RowsConfig)
        xin, silu = x, fusion.silu_mul
        if silu and cfg.split_silu:
            xin, silu = triton_ops.silu_and_mul(x), False  # [M, K], rounded as the prologue
        rows_kernel[(triton.cdiv(n_rows, cfg.block_n),)](
            xin, w, out, norm_weight if norm_weight is not None else xin,
            residual if residual is not None else out, num_x_rows, n_rows, n_cols,
            w.stride(0), fusion.eps,
            M_PAD=MAX_ROWS, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
            NUM_K=triton.cdiv(n_cols, cfg.block_k),
            EVEN=(n_rows % cfg.block_n == 0 and n_cols % cfg.block_k == 0),
            NORM=norm_weight is not None, SILU_MUL=silu,
            RESIDUAL=residual is not None, F32_DOT=INTERPRET or w.dtype == torch.float32,
            PDL=pdl.ENABLED, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
            **pdl.launch_options(),
        )
        return out

    if config is None:
        # The row count is in the key: whether UNFUSED wins depends on it.
        key = (n_rows, n_cols, str(weight.dtype), norm_weight is not None, fusion.silu_mul,
               residual is not None, str(out.dtype), num_x_rows)
        config = rows_config(key, launch, weight, rows_candidates(weight, fusion.silu_mul))
    return launch(config)


def unfused(
    x: torch.Tensor,  # [M, K] or [M, 2K] (silu_mul)
    weight: torch.Tensor,  # [N, K]
    *,
    norm_weight: torch.Tensor | None = None,
    eps: float = 0.0,
    silu_mul: bool = False,
    residual: torch.Tensor | None = None,  # [M, N]
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:  # new [M, N]
    """What the fused GEMVs replace (the UNFUSED candidate; benchmarks time it too):
    `torch_ops.fused_linear`'s sequence with the Triton elementwise kernels (what
    `ops.rms_norm` / `ops.silu_and_mul` dispatch to on CUDA) and cuBLAS. Float32 output is the
    model-dtype product widened, as `ops.linear` does off the GEMV path."""
    if silu_mul:
        x = triton_ops.silu_and_mul(x)
    if norm_weight is not None:
        x = triton_ops.rms_norm(x, norm_weight, eps)
    y = F.linear(x, weight)
    if residual is not None:
        y = y + residual
    return y if out_dtype is None or y.dtype == out_dtype else y.to(out_dtype)


def sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # the interpreter: any small grid
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _num_sms:
        _num_sms[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _num_sms[index]
