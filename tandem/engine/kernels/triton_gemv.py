"""Triton matrix-vector products for batch-1 decode, with the neighbours fused in.

At batch 1 every projection reads its whole weight once; what costs beyond that is the fixed
price of each launch (~2-3 us on an H100/H200). So the small ops around a projection run in
its prologue/epilogue instead of as kernels of their own:
- RMSNorm prologue: out = rstd(x) * W @ (norm_weight * x); the sum of squares accumulates in
  the same pass over x (no second pass, no rounding of the normed input to bf16: within bf16
  tolerance of the twin `W @ rms_norm(x)`, not bitwise);
- SiLU-and-mul prologue: x = silu(gate) * up, rounded like `torch_ops.silu_and_mul`;
- residual epilogue: out = bf16(W @ x) + residual, rounded like the twin (model dtype add);
- float32 output (the LM head's logits).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


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
        if EVEN:
            w = tl.load(row_ptr + cols[None, :], eviction_policy="evict_first")
        else:
            wmask = (rows[:, None] < n_rows) & kmask[None, :]
            w = tl.load(row_ptr + cols[None, :], mask=wmask, other=0.0,
                        eviction_policy="evict_first")
        x = tl.load(x_ptr + cols, mask=kmask, other=0.0)
        if SILU_MUL:  # x_ptr holds [gate | up], n_cols = len(gate)
            g = x.to(tl.float32)
            up = tl.load(x_ptr + n_cols + cols, mask=kmask, other=0.0)
            act = (g / (1.0 + tl.exp(-g))).to(x.dtype).to(tl.float32)
            xf = (act * up.to(tl.float32)).to(x.dtype).to(tl.float32)
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
        res = tl.load(res_ptr + rows, mask=rmask, other=0.0)
        out = (out.to(res.dtype).to(tl.float32) + res.to(tl.float32)).to(res.dtype)
    tl.store(out_ptr + rows, out.to(out_ptr.dtype.element_ty), mask=rmask)


# (BLOCK_N, BLOCK_K, num_warps, programs per SM or 0 for one program per row block)
# candidates; the first call of each shape and variant times them all and keeps the fastest.
Config = tuple[int, int, int, int]
# Pruned from a sweep of 17 on an H200 (bench/gpu_micro.py): these won for every Llama-8B
# site, plain and fused; the small-K ones serve SmolLM2-sized rows.
CONFIGS: tuple[Config, ...] = (
    (2, 2048, 4, 0), (4, 2048, 8, 0), (1, 4096, 4, 0), (2, 4096, 8, 0), (8, 512, 4, 0),
    (16, 512, 8, 0), (8, 512, 4, 4), (16, 256, 4, 0), (4, 1024, 4, 0), (32, 256, 8, 0),
)
_best: dict[tuple, Config] = {}
_num_sms: dict[int, int] = {}


def gemv(
    x: torch.Tensor,  # [1, K] (with silu_mul: [1, 2K] = gate | up), contiguous
    weight: torch.Tensor,  # [N, K], rows contiguous
    *,
    norm_weight: torch.Tensor | None = None,  # [K]: RMSNorm x first (eps below)
    eps: float = 0.0,
    silu_mul: bool = False,
    residual: torch.Tensor | None = None,  # [1, N]: added to the product (model dtype)
    out_dtype: torch.dtype | None = None,  # default x.dtype
    config: Config | None = None,
) -> torch.Tensor:  # new [1, N]
    n_rows, n_cols = weight.shape
    assert x.dim() == 2 and x.shape[0] == 1 and x.is_contiguous() and weight.stride(1) == 1
    assert x.shape[1] == (2 * n_cols if silu_mul else n_cols)
    assert not (norm_weight is not None and silu_mul)
    if residual is not None:
        assert residual.shape == (1, n_rows) and residual.is_contiguous()
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
        config = _best.get(key) or _tune(key, launch, weight)
    return launch(config)


def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # the interpreter: any small grid
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _num_sms:
        _num_sms[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _num_sms[index]


def _tune(key: tuple, launch, weight: torch.Tensor) -> Config:
    """Time every config once per process (the interpreter takes the first) the way decode
    runs it: back to back inside a CUDA graph, alternating with a second weight so that no
    call finds its weight in L2. (Timing single calls with do_bench picked configs 10% slower
    in the model.) Syncs the device: warm-up only, never inside a captured graph."""
    if INTERPRET or weight.device.type != "cuda":
        best = CONFIGS[0]
    else:
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"gemv {key}: not tuned before CUDA graph capture")
        other = torch.empty_like(weight).normal_(0.0, 0.02)  # [N, K], freed after tuning
        times = {cfg: _graph_time(cfg, launch, (weight, other)) for cfg in CONFIGS}
        best = min(times, key=times.__getitem__)
        del other
    _best[key] = best
    return best


def _graph_time(cfg: Config, launch, weights: tuple[torch.Tensor, ...], calls: int = 8,
                reps: int = 5) -> float:
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


def tuned_configs() -> dict[tuple, Config]:
    return dict(_best)
