"""The per-expert loop the fused MoE path replaced: the oracle tests and benchmarks compare
the fused path against. Not used by the engine: each expert's `nonzero` is a host read on CUDA
(one per expert per layer, launch bound, and not capturable in a CUDA graph)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tandem.engine.kernels.torch_ops import silu_and_mul


def expert_loop(
    x: torch.Tensor,  # [T, H]
    w13: torch.Tensor,  # [E_local, 2I, H]
    w2: torch.Tensor,  # [E_local, H, I]
    weights: torch.Tensor,  # [T, k] x.dtype routing weights
    experts: torch.Tensor,  # [T, k] int64 global expert ids
    expert_start: int,  # global id of local expert 0
) -> torch.Tensor:  # [T, H] this rank's experts' weighted outputs, summed per token
    out = torch.zeros_like(x)
    for e in range(w13.shape[0]):
        token_idx, slot = torch.nonzero(experts == expert_start + e, as_tuple=True)
        if token_idx.numel() == 0:
            continue
        h = silu_and_mul(F.linear(x[token_idx], w13[e]))  # [n, I]
        y = F.linear(h, w2[e]) * weights[token_idx, slot, None]  # [n, H]
        out.index_add_(0, token_idx, y)
    return out


def expert_rows_loop(
    rows: torch.Tensor,  # [N, H] received rows (all-to-all)
    w13: torch.Tensor,  # [E_local, 2I, H]
    w2: torch.Tensor,  # [E_local, H, I]
    local_expert: torch.Tensor,  # [N] int64 local expert of each row; -1: padding
) -> torch.Tensor:  # [N, H] unweighted expert outputs, 0 on padding rows
    out = torch.zeros_like(rows)
    for e in range(w13.shape[0]):
        idx = torch.nonzero(local_expert == e, as_tuple=True)[0]  # [n]
        if idx.numel() == 0:
            continue
        h = silu_and_mul(F.linear(rows[idx], w13[e]))  # [n, I]
        out.index_copy_(0, idx, F.linear(h, w2[e]))
    return out
