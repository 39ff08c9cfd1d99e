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

x of one row runs `_gemv_kernel` (tuned: ~98% of copy bandwidth). x of 2..8 rows runs
`_rows_kernel`, which loads each weight tile once and multiplies it against all rows (one
read of the weight for M tokens), or, where the first-call tuning finds it faster, the
unfused sequence (`UNFUSED`: cuBLAS + the Triton elementwise kernels), so routing M <= 8
here is never slower per projection than what ran before. Choices are recorded per kind of GPU
(`tuning_file`): later processes take them untimed, so restarts run the same kernels. On an H100 at M = 5 (benchmarks/
gpu_micro.py --skinny) the kernel wins qkv+norm (21.6 vs 23.8 us), o_proj+residual (14.4 vs
17.5), gate_up+norm (83.1 vs 85.2) and the LM head (347 vs 378); UNFUSED wins down with
SiLU-mul + residual (47.6 vs 58.7: the per-program SiLU prologue over 8 padded rows costs
more than the launch it saves).
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, NamedTuple

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from tandem.engine.cache_root import default_cache_root
from tandem.engine.kernels import triton_ops

log = logging.getLogger(__name__)
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
def _gemv_kernel(
    x_ptr, w_ptr, out_ptr, norm_ptr, res_ptr, n_rows, n_cols, stride_w, eps,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NUM_K: tl.constexpr, ITERS: tl.constexpr,
    EVEN: tl.constexpr, NORM: tl.constexpr, SILU_MUL: tl.constexpr, RESIDUAL: tl.constexpr,
):
    """out[n] = sum_k w[n, k] * x'[k] (+ residual[n]). Program p streams the row blocks
    p, p + grid, ... (ITERS of them): one block each, or a persistent grid that balances
    blocks over the SMs. Loop bounds are constants (the interpreter needs them)."""
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
    tl.store(out_ptr + rows, out.to(out_ptr.dtype.element_ty), mask=rmask)


@triton.jit
def _rows_kernel(
    x_ptr, w_ptr, out_ptr, norm_ptr, res_ptr, num_x_rows, n_rows, n_cols, stride_w, eps,
    M_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NUM_K: tl.constexpr,
    EVEN: tl.constexpr, NORM: tl.constexpr, SILU_MUL: tl.constexpr, RESIDUAL: tl.constexpr,
    F32_DOT: tl.constexpr,
):
    """out[m, n] = sum_k w[n, k] * x'[m, k] (+ residual[m, n]) for the num_x_rows <= M_PAD
    rows of x. Program p streams weight rows [p * BLOCK_N, (p + 1) * BLOCK_N) once over K and
    multiplies each [BLOCK_N, BLOCK_K] tile against every row of x on the tensor cores, as
    out^T = W @ x'^T ("swap AB": the weight tile is the MMA's tall A operand as stored, the
    few x rows, zero-padded to M_PAD, its narrow B operand; Triton pads a dot to the MMA
    shape, so M_PAD = 8 costs no more than 2). The loop over K is software-pipelined
    (num_stages), which keeps enough weight bytes in flight per SM without the huge BLOCK_K
    the one-row kernel needs.

    Rounding: like `_gemv_kernel` per row, except that the MMA takes its x operand in the
    weight dtype, so the RMSNorm prologue rounds norm_weight * x to bf16 (the twin rounds the
    normed row to bf16 too); plain and SiLU-mul inputs are bf16 values already."""
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


# (BLOCK_N, BLOCK_K, num_warps, programs per SM or 0 for one program per row block)
# candidates; the first call of each shape and variant times them all and keeps the fastest.
Config = tuple[int, int, int, int]
# Pruned from a sweep of 17 on an H200 (benchmarks/gpu_micro.py): these won for every Llama-8B
# site, plain and fused; the small-K ones serve SmolLM2-sized rows.
CONFIGS: tuple[Config, ...] = (
    (2, 2048, 4, 0), (4, 2048, 8, 0), (1, 4096, 4, 0), (2, 4096, 8, 0), (8, 512, 4, 0),
    (16, 512, 8, 0), (8, 512, 4, 4), (16, 256, 4, 0), (4, 1024, 4, 0), (32, 256, 8, 0),
)
_best: dict[tuple, Config] = {}
_num_sms: dict[int, int] = {}

MAX_ROWS = 8  # x rows the multi-row kernel takes (its M_PAD)


class RowsConfig(NamedTuple):
    """A launch of `_rows_kernel` (a type of its own: never mistaken for a one-row Config)."""

    block_n: int  # weight rows per program (the grid is cdiv(N, block_n))
    block_k: int  # K per pipelined step
    num_warps: int
    num_stages: int  # software-pipeline depth of the K loop
    # SiLU-and-mul variants: run SiLU-and-mul once as its own kernel and the product on its
    # [M, K] output, instead of in the prologue, where every program recomputes it over all
    # M_PAD rows of the (wide: 14,336 on the 8B shape) input. Ignored by other variants.
    split_silu: bool = False


# The sentinel candidate "run the unfused sequence": cuBLAS F.linear with the Triton RMSNorm /
# SiLU-mul kernels and a torch add, what M > 1 ran before `_rows_kernel` existed.
UNFUSED: Literal["unfused"] = "unfused"
RowsChoice = RowsConfig | Literal["unfused"]
# Candidates for 2..8 rows, timed like CONFIGS at the first call of each shape, variant and
# row count. The first is the interpreter's; UNFUSED stays in so a shape where cuBLAS wins
# keeps it. Pruned from a sweep of 44 at M = 5 on an H100 (benchmarks/gpu_micro.py --skinny
# --sweep): the winners of every Llama-8B site, plain and fused (8 warps never won); the
# (8, 128) one is for SmolLM2's narrow rows (N = 576).
ROWS_CONFIGS: tuple[RowsChoice, ...] = (
    RowsConfig(32, 256, 4, 4), RowsConfig(64, 256, 4, 4), RowsConfig(16, 256, 4, 4),
    RowsConfig(64, 256, 4, 3), RowsConfig(128, 128, 4, 3), RowsConfig(16, 128, 4, 5),
    RowsConfig(32, 512, 4, 3), RowsConfig(8, 128, 4, 3),
    # For the down projection (SiLU-mul + residual), whose prologue is the one site where the
    # fused kernel lost to UNFUSED on an H100 (58.7 vs 47.6 us at M = 5, while its plain
    # product took 42.2): the plain winners with SiLU split out. Not yet timed on a GPU.
    RowsConfig(32, 512, 4, 3, True), RowsConfig(64, 256, 4, 4, True), UNFUSED,
)
_best_rows: dict[tuple, RowsChoice] = {}


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
        assert config is None or config == UNFUSED or isinstance(config, RowsConfig), config
        fusion = _Fusion(norm_weight=norm_weight, eps=eps, silu_mul=silu_mul,
                         residual=residual, out_dtype=out_dtype or x.dtype)
        return _gemm_rows(x, weight, fusion, config)
    assert not isinstance(config, (RowsConfig, str)), config
    # One row: the tuned one-row kernel.
    out = torch.empty(1, n_rows, dtype=out_dtype or x.dtype, device=x.device)

    def launch(cfg: Config, w: torch.Tensor = weight) -> torch.Tensor:
        block_n, block_k, warps, per_sm = cfg
        blocks = triton.cdiv(n_rows, block_n)
        grid = min(blocks, per_sm * _sm_count(x.device)) if per_sm else blocks
        iters = triton.cdiv(blocks, grid)
        _gemv_kernel[(grid,)](
            x, w, out, norm_weight if norm_weight is not None else x,
            residual if residual is not None else out, n_rows, n_cols, w.stride(0), eps,
            BLOCK_N=block_n, BLOCK_K=block_k, NUM_K=triton.cdiv(n_cols, block_k), ITERS=iters,
            EVEN=(n_rows % block_n == 0 and n_cols % block_k == 0 and grid * iters == blocks),
            NORM=norm_weight is not None, SILU_MUL=silu_mul, RESIDUAL=residual is not None,
            num_warps=warps,
        )
        return out

    if config is None:
        key = (n_rows, n_cols, str(weight.dtype), norm_weight is not None, silu_mul,
               residual is not None, str(out.dtype))
        config = _best.get(key) or _tune(key, launch, weight, CONFIGS, _best)
    return launch(config)


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
        assert isinstance(cfg, RowsConfig)
        xin, silu = x, fusion.silu_mul
        if silu and cfg.split_silu:
            xin, silu = triton_ops.silu_and_mul(x), False  # [M, K], rounded as the prologue
        _rows_kernel[(triton.cdiv(n_rows, cfg.block_n),)](
            xin, w, out, norm_weight if norm_weight is not None else xin,
            residual if residual is not None else out, num_x_rows, n_rows, n_cols,
            w.stride(0), fusion.eps,
            M_PAD=MAX_ROWS, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
            NUM_K=triton.cdiv(n_cols, cfg.block_k),
            EVEN=(n_rows % cfg.block_n == 0 and n_cols % cfg.block_k == 0),
            NORM=norm_weight is not None, SILU_MUL=silu,
            RESIDUAL=residual is not None, F32_DOT=INTERPRET or w.dtype == torch.float32,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )
        return out

    if config is None:
        # The row count is in the key: whether UNFUSED wins depends on it.
        key = (n_rows, n_cols, str(weight.dtype), norm_weight is not None, fusion.silu_mul,
               residual is not None, str(out.dtype), num_x_rows)
        candidates = tuple(c for c in ROWS_CONFIGS  # split_silu only where there is SiLU
                           if c == UNFUSED or fusion.silu_mul or not c.split_silu)
        config = _best_rows.get(key) or _tune(key, launch, weight, candidates, _best_rows)
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


def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # the interpreter: any small grid
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _num_sms:
        _num_sms[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _num_sms[index]


def _tune(key: tuple, launch, weight: torch.Tensor, candidates: tuple, best_of: dict):
    """Time every candidate once per process (the interpreter takes the first) the way decode
    runs it: back to back inside a CUDA graph, alternating with a second weight so that no
    call finds its weight in L2. (Timing single calls with do_bench picked configs 10% slower
    in the model.) Records the winner in `best_of[key]`. A choice an earlier process made on
    this kind of GPU is taken without timing (`tuning_file`). Syncs the device: warm-up only,
    never inside a captured graph."""
    if INTERPRET or weight.device.type != "cuda":
        best = candidates[0]
    else:
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"gemv {key}: not tuned before CUDA graph capture")

        def time_all() -> dict:
            other = torch.empty_like(weight).normal_(0.0, 0.02)  # [N, K], freed after
            times = {}
            for cfg in candidates:
                try:
                    times[cfg] = _graph_time(cfg, launch, (weight, other))
                except triton.runtime.errors.OutOfResources:  # pipeline stages over a
                    continue  # smaller GPU's shared memory: not a candidate there
            return times

        best = choose(key, candidates, time_all, tuning_file(weight.device))
    best_of[key] = best
    return best


# ---- tuning results that outlive the process ---------------------------------------------------
# Timing picks between near-equal candidates differently from one process to the next, and two
# configurations round bf16 differently: greedy output could change across restarts at
# near-ties (it did on an H200, docs/perf.md session 9). So the first process on a kind of GPU
# records its choices, and later ones (restarts, every worker of the machine) take them.
TUNING_ENV = "TANDEM_GEMV_TUNING_CACHE"  # a JSON file to use instead; "0": time every process
_tables: dict[Path, dict[str, object]] = {}  # file -> its choices, as read or written


def tuning_file(device: torch.device) -> Path | None:
    """Where this GPU kind's choices live: $TANDEM_GEMV_TUNING_CACHE, else
    $TANDEM_CACHE/gemv-tuning/<device name>-triton-<version>.json; None when set to 0."""
    env = os.environ.get(TUNING_ENV)
    if env == "0":
        return None
    if env:
        return Path(env).expanduser()
    name = re.sub(r"[^A-Za-z0-9._-]+", "_", torch.cuda.get_device_name(device))
    return default_cache_root() / "gemv-tuning" / f"{name}-triton-{triton.__version__}.json"


def _encode(choice: Config | RowsChoice) -> object:
    return choice if isinstance(choice, str) else list(choice)


def _read(path: Path) -> dict[str, object]:
    try:
        table = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return table if isinstance(table, dict) else {}


def choose(key: tuple, candidates: tuple, time_all: Callable[[], dict],
           path: Path | None) -> Config | RowsChoice:
    """The recorded choice for `key` when `path` has one among `candidates`; else the fastest
    of `time_all()` (candidate -> ms), recorded in `path`. Writers merge into what the file
    holds, and a key already there keeps its choice (the first process's word stands)."""
    def recorded(table: dict[str, object]) -> Config | RowsChoice | None:
        raw = table.get(repr(key))
        return next((c for c in candidates if _encode(c) == raw), None)

    if path is not None:
        if path not in _tables:
            _tables[path] = _read(path)
        found = recorded(_tables[path])
        if found is not None:
            return found
    times = time_all()
    best = min(times, key=times.__getitem__)
    if path is None:
        return best
    table = _read(path)  # what other processes recorded meanwhile
    _tables[path] = table
    found = recorded(table)
    if found is not None:  # another process's word stands
        return found
    table[repr(key)] = _encode(best)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(table, indent=0, sort_keys=True))
        os.replace(tmp, path)  # atomic: readers see the old file or the new one
    except OSError as exc:
        log.warning("gemv tuning: cannot record choices in %s (%s)", path, exc)
    return best


def _graph_time(cfg: Config | RowsChoice, launch, weights: tuple[torch.Tensor, ...],
                calls: int = 8, reps: int = 5) -> float:
    """Median ms of one call of `cfg`, from replays of a graph of `calls` calls."""
    launch(cfg, weights[0])  # compile and warm up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            launch(cfg, weights[i % len(weights)])
    graph.replay()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / calls)
    return sorted(times)[reps // 2]


def tuned_configs() -> dict[tuple, Config | RowsChoice]:
    """Every tuned shape's choice. One-row keys: (N, K, weight dtype, norm, silu_mul,
    residual, out dtype); multi-row keys add the row count M last, and their choice is a
    RowsConfig or UNFUSED."""
    return {**_best, **_best_rows}
