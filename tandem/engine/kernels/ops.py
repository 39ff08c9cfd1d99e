"""Kernel dispatch: Triton on CUDA tensors, the torch twins everywhere else.

The policy is process-wide and read-only during a forward (like `torch.backends` flags):
`KernelPolicy.triton` turns the Triton kernels on for CUDA tensors (`TANDEM_TRITON=0` turns
them off at start-up), `KernelPolicy.gemv` additionally routes batch-1 projections to the
Triton matrix-vector kernel. `kernel_policy(...)` swaps it inside a `with` block (tests and
benchmarks compare both paths in one process). Triton is imported on first CUDA use only.
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

from tandem.engine.kernels import torch_ops

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True, kw_only=True)
class KernelPolicy:
    triton: bool = True  # Triton kernels for CUDA tensors
    gemv: bool = True  # Triton matrix-vector kernel for [1, K] x [N, K] on CUDA


_policy = KernelPolicy(triton=os.environ.get("TANDEM_TRITON", "1") != "0",
                       gemv=os.environ.get("TANDEM_GEMV", "1") != "0")
_triton_module: ModuleType | None = None
_triton_failed = False


def current_policy() -> KernelPolicy:
    return _policy


@contextmanager
def kernel_policy(**changes: bool) -> Iterator[KernelPolicy]:
    """Run a block under a changed policy, e.g. `with kernel_policy(triton=False): ...`."""
    global _policy
    saved = _policy
    _policy = replace(saved, **changes)
    try:
        yield _policy
    finally:
        _policy = saved


def _triton_for(x: torch.Tensor) -> ModuleType | None:
    """The Triton kernel module when `x` should use it, else None (torch twin)."""
    global _triton_module, _triton_failed
    if not (x.is_cuda and _policy.triton) or _triton_failed:
        return None
    if _triton_module is None:
        try:
            from tandem.engine.kernels import triton_ops
        except ImportError as exc:  # a CUDA machine without triton: slower, still correct
            log.warning("triton unavailable (%s); using torch kernels", exc)
            _triton_failed = True
            return None
        _triton_module = triton_ops
    return _triton_module


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


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    tri = _triton_for(gate_up)
    if tri is not None and gate_up.dim() == 2:
        return tri.silu_and_mul(gate_up)
    return torch_ops.silu_and_mul(gate_up)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
           ) -> torch.Tensor:
    """[M, K] x [N, K] (+ [N]) -> [M, N]. Batch-1 decode on CUDA may take the Triton GEMV."""
    if bias is None and x.dim() == 2 and x.shape[0] == 1 and _policy.gemv:
        tri = _triton_for(x)
        if tri is not None and weight.stride(1) == 1:
            return tri.gemv(x.contiguous(), weight)
    return F.linear(x, weight, bias)
