"""Kernel dispatch: Triton on CUDA tensors, the torch twins everywhere else.

The policy is process-wide and read-only during a forward (like `torch.backends` flags):
`KernelPolicy.triton` turns the Triton kernels on for CUDA tensors (`TANDEM_TRITON=0` turns
them off at start-up), `KernelPolicy.gemv` additionally routes projections of x with at most
`KernelPolicy.gemv_max_rows` rows (batch-1 decode, speculative verify of k+1 tokens, small
decode batches) to the Triton GEMV kernels (`TANDEM_GEMV=0`; `TANDEM_GEMV_MAX_ROWS`, default
8; 1 keeps them to batch 1), and `KernelPolicy.fused_decode` lets layers of that many rows
fold their norms, activation and residual adds into those GEMVs (`TANDEM_FUSED_DECODE=0`;
`KernelPolicy.fused_draft` lets the draft head's layers do the same, `TANDEM_FUSED_DRAFT=0`
turns that off). MoE experts (`moe_experts`, `moe_weighted_sum`) run as grouped-GEMM Triton
kernels on CUDA (triton_moe; twins in torch_moe), with no host read.
`kernel_policy(...)` swaps the policy inside a `with` block (tests and benchmarks compare
paths in one process). A policy change after a CUDA graph was captured does not affect the
graph. Triton is imported on first CUDA use only.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from types import ModuleType

import torch
import torch.nn.functional as F

from tandem.engine.kernels import torch_moe, torch_ops
from tandem.engine.kernels.moe_blocks import align_blocks, block_rows

log = logging.getLogger(__name__)


# Rows the Triton GEMV kernels take (triton_gemv.MAX_ROWS; not imported: triton is lazy).
GEMV_ROWS_LIMIT = 8


@dataclass(frozen=True, slots=True, kw_only=True)
class KernelPolicy:
    triton: bool = True  # Triton kernels for CUDA tensors
    gemv: bool = True  # Triton GEMV kernels for [M, K] x [N, K] on CUDA, M <= gemv_max_rows
    # Largest M routed to the GEMV kernels (and to the fused layer path); 1 = batch 1 only.
    # 8 covers speculative verify (k + 1 = 5 tokens at batch 1) and decode batches up to 8.
    # The first call of each shape times the multi-row kernel against cuBLAS and keeps the
    # faster (triton_gemv), so 8 is never slower than 1 by more than noise (docs/perf.md).
    gemv_max_rows: int = 8
    fused_decode: bool = True  # layers of <= gemv_max_rows rows fold norm/act/residual in
    # The draft head's layers take that fused path too (spec/head.py; TANDEM_FUSED_DRAFT=0).
    fused_draft: bool = True

    def __post_init__(self) -> None:
        if not 1 <= self.gemv_max_rows <= GEMV_ROWS_LIMIT:
            raise ValueError(f"gemv_max_rows (TANDEM_GEMV_MAX_ROWS): must be in "
                             f"[1, {GEMV_ROWS_LIMIT}], got {self.gemv_max_rows}")


def _env_rows(name: str, default: int) -> int:
    raw = os.environ.get(name, str(default))
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"{name}: expected an integer, got {raw!r}") from None


_policy = KernelPolicy(triton=os.environ.get("TANDEM_TRITON", "1") != "0",
                       gemv=os.environ.get("TANDEM_GEMV", "1") != "0",
                       gemv_max_rows=_env_rows("TANDEM_GEMV_MAX_ROWS", 8),
                       fused_decode=os.environ.get("TANDEM_FUSED_DECODE", "1") != "0",
                       fused_draft=os.environ.get("TANDEM_FUSED_DRAFT", "1") != "0")
_triton_module: ModuleType | None = None
_gemv_module: ModuleType | None = None
_decode_module: ModuleType | None = None  # triton_decode, imported on first use
# The one-launch bookkeeping kernels of the speculative graphs (decode_rows_plan here,
# spec kernels.extend_rows); TANDEM_PLAN_KERNELS=0 takes the torch twins' launches instead.
# On an H100 (docs/perf.md session 18) the GPU tests pass with them and rounds are no slower.
PLAN_KERNELS = os.environ.get("TANDEM_PLAN_KERNELS", "1") != "0"
_moe_module: ModuleType | None = None
_triton_failed = False


def current_policy() -> KernelPolicy:
    return _policy


@contextmanager
def kernel_policy(**changes: bool | int) -> Iterator[KernelPolicy]:
    """Run a block under a changed policy, e.g. `with kernel_policy(triton=False): ...` or
    `kernel_policy(gemv_max_rows=1)`."""
    global _policy
    saved = _policy
    _policy = replace(saved, **changes)
    try:
        yield _policy
    finally:
        _policy = saved


def _on_triton_device(x: torch.Tensor) -> bool:
    """Whether x lives where the Triton kernels run (a seam: CPU tests under the Triton
    interpreter patch it)."""
    return x.is_cuda


def _decode_for(x: torch.Tensor) -> ModuleType | None:
    """`triton_decode` (the device-metadata decode kernels) where `_triton_for` takes Triton."""
    global _decode_module
    if _triton_for(x) is None:
        return None
    if _decode_module is None:
        from tandem.engine.kernels import triton_decode

        _decode_module = triton_decode
    return _decode_module


def _triton_for(x: torch.Tensor) -> ModuleType | None:
    """The Triton kernel module when `x` should use it, else None (torch twin).

    The Triton kernels have no backward: while autograd records (training the draft head),
    every op takes its differentiable torch twin. Without this, q/k of the head's attention
    and its norm weights got no gradient on the GPU (rope and RMSNorm outputs were cut off
    from the graph)."""
    global _triton_module, _gemv_module, _moe_module, _triton_failed
    if (not (_policy.triton and _on_triton_device(x)) or _triton_failed
            or torch.is_grad_enabled()):
        return None
    if _triton_module is None:
        try:
            from tandem.engine.kernels import triton_gemv, triton_moe, triton_ops
        except ImportError as exc:  # a CUDA machine without triton: slower, still correct
            log.warning("triton unavailable (%s); using torch kernels", exc)
            _triton_failed = True
            return None
        _triton_module, _gemv_module, _moe_module = triton_ops, triton_gemv, triton_moe
    return _triton_module


def _gemv_for(x: torch.Tensor) -> ModuleType | None:
    """The Triton GEMV module when x is [M, K] on CUDA with 1 <= M <= gemv_max_rows and the
    policy allows it, else None."""
    if (x.dim() != 2 or not 1 <= x.shape[0] <= _policy.gemv_max_rows or not _policy.gemv
            or _triton_for(x) is None):
        return None
    return _gemv_module


def gemv_applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `linear` / `fused_linear` of x with this weight run the Triton GEMV."""
    return weight.stride(1) == 1 and _gemv_for(x) is not None


def decode_fusion_ok(x: torch.Tensor) -> bool:
    """Whether a layer given x [T, H] should take the fused path (`fused_linear`): T rows,
    1 <= T <= gemv_max_rows, on CUDA (batch-1 decode, speculative verify, small batches)."""
    return _policy.fused_decode and x.is_contiguous() and _gemv_for(x) is not None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    tri = _triton_for(x)
    if tri is not None and x.stride(-1) == 1:
        return tri.rms_norm(x, weight, eps)
    return torch_ops.rms_norm(x, weight, eps)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    tri = _triton_for(x)
    if tri is not None and x.dim() == 2 and x.stride(-1) == 1 and residual.stride(-1) == 1:
        return tri.add_rms_norm(x, residual, weight, eps)
    return torch_ops.add_rms_norm(x, residual, weight, eps)


def rotary(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
    sin: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    tri = _triton_for(q)
    if tri is not None and tri.rotary_supported(q.shape[-1]):
        return tri.rotary(positions, q, k, cos, sin)
    return torch_ops.rotary(positions, q, k, cos, sin)


def store_kv(
    kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_ids: torch.Tensor
) -> None:
    tri = _triton_for(k)
    if tri is not None:
        d = k.shape[-1]
        if all(t.stride(2) == 1 and t.stride(1) == d for t in (k, v)):
            tri.store_kv(kv_cache, k, v, slot_ids)
            return
    torch_ops.store_kv(kv_cache, k, v, slot_ids)


def paged_decode(
    q: torch.Tensor, kv_cache: torch.Tensor, page_table: torch.Tensor, kv_lens: torch.Tensor,
    scale: float, num_splits: int,
) -> torch.Tensor:
    """q [B, Hq, D] one token per sequence; kv_cache [num_pages, 2, page_size, Hkv, D];
    page_table [B, P] int32; kv_lens [B] int32/int64 -> [B, Hq, D] q.dtype. The Triton path
    cuts each sequence's keys into num_splits chunks of ceil(kv_len / num_splits) keys on the
    device and never reads kv_lens on the host, so a CUDA graph replays it for any lengths.
    The twin (CPU, autograd, D not a power of two >= 16) reads them: capturing it fails loudly."""
    tri = _decode_for(q)
    d = q.shape[-1]
    if tri is not None and d >= 16 and d & (d - 1) == 0 and kv_cache.stride(-1) == 1:
        return tri.paged_decode(q, kv_cache, page_table, kv_lens, scale, num_splits)
    return torch_ops.paged_decode(q, kv_cache, page_table, kv_lens, scale, num_splits)


def decode_rows_plan(
    table: torch.Tensor, base: torch.Tensor, rows_per_seq: int, page_size: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """table [B, P] int32, base [B] int64 -> (positions, key counts, K/V slots [B*R] int64,
    page-table rows [B*R, P] int32) of decode rows base[b] + j, j < R
    (`torch_ops.decode_rows_plan`); no host read either way. The one-launch Triton kernel
    runs unless TANDEM_PLAN_KERNELS=0 (then the twin's ~7-10 small launches)."""
    tri = _decode_for(base) if PLAN_KERNELS else None
    if tri is not None and table.dtype == torch.int32 and table.stride(1) == 1:
        return tri.decode_rows_plan(table, base, rows_per_seq, page_size)
    return torch_ops.decode_rows_plan(table, base, rows_per_seq, page_size)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    tri = _triton_for(gate_up)
    if tri is not None and gate_up.dim() == 2:
        return tri.silu_and_mul(gate_up)
    return torch_ops.silu_and_mul(gate_up)


def rotary_store(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    cos: torch.Tensor, sin: torch.Tensor, kv_cache: torch.Tensor, slot_ids: torch.Tensor,
) -> torch.Tensor:
    """Rope on q and k, k and v into the pages at slot_ids; returns the rotated q [T, Hq, D]."""
    tri = _triton_for(q)
    d = v.shape[-1]
    if (tri is not None and tri.rotary_supported(q.shape[-1]) and kv_cache.is_contiguous()
            and v.stride(2) == 1 and v.stride(1) == d):
        return tri.rotary_store(positions, q, k, v, cos, sin, kv_cache, slot_ids)
    return torch_ops.rotary_store(positions, q, k, v, cos, sin, kv_cache, slot_ids)


def linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """[M, K] x [N, K] (+ [N]) -> [M, N] (in out_dtype, default x.dtype). M <= gemv_max_rows
    on CUDA may take the Triton GEMV (which writes out_dtype directly)."""
    gemv = _gemv_for(x) if bias is None and weight.stride(1) == 1 else None
    if gemv is not None:
        return gemv.gemv(x.contiguous(), weight, out_dtype=out_dtype)
    y = F.linear(x, weight, bias)
    return y if out_dtype is None else y.to(out_dtype)


def fused_linear(
    x: torch.Tensor, weight: torch.Tensor, *, norm_weight: torch.Tensor | None = None,
    eps: float = 0.0, silu_mul: bool = False, residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [M, K] (or [M, 2K] with silu_mul), residual [M, N] -> weight @ prologue(x)
    (+ residual) [M, N], in one launch for M <= gemv_max_rows on CUDA (see triton_gemv); the
    unfused torch sequence elsewhere. Prologue: rms_norm (norm_weight) or silu_and_mul, per
    row."""
    gemv = _gemv_for(x) if weight.stride(1) == 1 else None
    if gemv is not None and (residual is None or residual.is_contiguous()):
        return gemv.gemv(x.contiguous(), weight, norm_weight=norm_weight, eps=eps,
                         silu_mul=silu_mul, residual=residual)
    return torch_ops.fused_linear(x, weight, norm_weight, eps, silu_mul, residual)


def _moe_for(x: torch.Tensor) -> ModuleType:
    """triton_moe for x on CUDA (policy allowing), else its twins (torch_moe)."""
    if _triton_for(x) is None:
        return torch_moe
    assert _moe_module is not None
    return _moe_module


def moe_experts(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, experts: torch.Tensor,
    expert_start: int,
) -> torch.Tensor:
    """Fused MoE experts, no host read: x [T, H]; w13 [E_local, 2I, H] (gate rows, up rows);
    w2 [E_local, H, I]; experts [T, k] int64 global ids, local ones in [expert_start,
    expert_start + E_local) -> [T, k, H] each slot's unweighted expert output (0 for a slot
    routed to another rank's expert). Shapes depend on (T, k, E_local) alone: capturable in a
    CUDA graph per batch size. Pairs sorted by expert into blocks (moe_blocks), then two
    grouped GEMMs (gate_up with SiLU * up, down)."""
    impl = _moe_for(x)
    num_tokens, top_k = experts.shape
    num_local = w13.shape[0]
    blocks = align_blocks(experts, expert_start, num_local,
                          block_rows(num_tokens * top_k, num_local))
    h = impl.moe_gate_up(x.contiguous(), w13, blocks)  # [R, I] sorted rows
    return impl.moe_down(h, w2, blocks).view(num_tokens, top_k, w2.shape[1])


def moe_weighted_sum(
    y: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor
) -> torch.Tensor:
    """y [T, k, H] per-slot expert outputs, weights [T, k] y.dtype, experts [T, k] int64 ->
    [T, H] sum over slots of weights * y, added from zero in ascending expert id (the order
    the expert loop added them in: deterministic, and the same sums whichever path made y)."""
    impl = _moe_for(y)
    return impl.moe_weighted_sum(y.contiguous(), weights.contiguous(), experts.argsort(dim=-1))


def row_max(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, V] -> (values [M], first indices [M] int64) = x.max(dim=-1): the Triton kernel
    (chunks of each row side by side) on CUDA, torch elsewhere."""
    tri = _triton_for(x)
    if tri is not None and x.dim() == 2 and x.stride(-1) == 1 and x.shape[1] > 0:
        return tri.row_max(x)
    return torch_ops.row_max(x)
