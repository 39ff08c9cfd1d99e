"""Dispatch of the speculative bookkeeping kernels: the Triton kernel for CUDA tensors when the
engine's kernel policy allows Triton (`tandem.engine.kernels.current_policy().triton`,
`TANDEM_TRITON=0` turns it off), the torch twin otherwise. Triton is imported on first CUDA
use only; a CUDA machine without it falls back to the twins."""

from __future__ import annotations

import logging
from types import ModuleType

import torch

from tandem.engine.kernels import current_policy
from tandem.engine.kernels import ops as engine_kernels
from tandem.spec.kernels import torch_ops

log = logging.getLogger(__name__)
_triton: ModuleType | None = None
_failed = False


def _triton_for(x: torch.Tensor) -> ModuleType | None:
    global _triton, _failed
    if not (x.is_cuda and current_policy().triton) or _failed:
        return None
    if _triton is None:
        try:
            from tandem.spec.kernels import triton_ops
        except ImportError as exc:
            log.warning("triton unavailable (%s); using torch bookkeeping kernels", exc)
            _failed = True
            return None
        _triton = triton_ops
    return _triton


def greedy_accept(tokens: torch.Tensor, target_ids: torch.Tensor, parents: torch.Tensor,
                  max_depth: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(num_accepted [B] int32, path [B, max_depth] int32, bonus [B] int64); see torch_ops."""
    return (_triton_for(tokens) or torch_ops).greedy_accept(tokens, target_ids, parents,
                                                            max_depth)


def accept_chain_into(tokens: torch.Tensor, target_ids: torch.Tensor, num: torch.Tensor,
                      path: torch.Tensor, bonus: torch.Tensor, ver_tokens: torch.Tensor
                      ) -> torch.Tensor:
    """Greedy acceptance of chains into the graphs' buffers -> host rows; see torch_ops."""
    return (_triton_for(tokens) or torch_ops).accept_chain_into(
        tokens, target_ids, num, path, bonus, ver_tokens)


def extend_inputs(
    tokens: torch.Tensor, path: torch.Tensor, num_accepted: torch.Tensor, bonus: torch.Tensor,
    num_cached: torch.Tensor, page_table: torch.Tensor, page_size: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(token ids, feature rows, positions, slots [B * (D + 1)], last rows [B]); see torch_ops."""
    return (_triton_for(tokens) or torch_ops).extend_inputs(
        tokens, path, num_accepted, bonus, num_cached, page_table, page_size)


def extend_rows(tokens: torch.Tensor, path: torch.Tensor, num_accepted: torch.Tensor,
                bonus: torch.Tensor, rows_per_seq: int
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(token ids, feature rows [B * R], bonus rows [B]) of the fixed-shape extend; see
    torch_ops. The Triton kernel unless TANDEM_PLAN_KERNELS=0."""
    tri = _triton_for(tokens) if engine_kernels.PLAN_KERNELS else None
    return (tri or torch_ops).extend_rows(tokens, path, num_accepted, bonus, rows_per_seq)


def tree_mask(parents: torch.Tensor, num_cached: torch.Tensor, mask_offsets: torch.Tensor,
              total: int, max_num_cached: int) -> torch.Tensor:
    """[total] bool flat verify mask in build_metadata's packing; see torch_ops."""
    return (_triton_for(parents) or torch_ops).tree_mask(parents, num_cached, mask_offsets,
                                                         total, max_num_cached)
