"""Feed-forward blocks: the dense SwiGLU MLP and the sparse mixture-of-experts block.

MoE experts shard over the expert-parallel group `ep`: rank r owns experts
[r*E/ep, (r+1)*E/ep) whole. Every rank routes every token (the router is replicated), runs the
experts it owns on the tokens that chose them, and an all-reduce sums the partial outputs.
(All-to-all dispatch is the faster variant for large EP; this one is exact and simple.)
When ep has one rank and tp has several, expert intermediate columns shard over tp instead.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tandem.engine import kernels
from tandem.engine.layers.linear import (
    MergedColumnLinear,
    OutputPart,
    ReplicatedLinear,
    RowParallelLinear,
    check_shape,
)
from tandem.engine.layers.norm import RMSNorm
from tandem.engine.parallel import ParallelGroup


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:  # [T, 2I] -> [T, I]
    return kernels.silu_and_mul(gate_up)


class DenseMLP(nn.Module):
    def __init__(
        self, hidden: int, intermediate: int, tp: ParallelGroup, dtype: torch.dtype
    ) -> None:
        super().__init__()
        part = OutputPart.even(intermediate, tp, "intermediate_size")
        self.gate_up = MergedColumnLinear(hidden, (part, part), False, dtype)
        self.down = RowParallelLinear(intermediate, hidden, False, tp, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, H]
        return self.down(silu_and_mul(self.gate_up(x)))

    def can_fuse(self) -> bool:
        return self.down.tp.size == 1 and self.down.bias is None

    def forward_fused(self, stream: torch.Tensor, norm: RMSNorm) -> torch.Tensor:
        """Decode / verify of T <= gemv_max_rows rows: stream [T, H] -> stream +
        mlp(norm(stream)) [T, H] in two GEMV launches (each row's norm folded into gate_up's,
        silu-and-mul and the residual add into down's)."""
        gate_up = kernels.fused_linear(stream, self.gate_up.weight, norm_weight=norm.weight,
                                       eps=norm.eps)
        return kernels.fused_linear(gate_up, self.down.weight, silu_mul=True, residual=stream)


class SparseMoE(nn.Module):
    """Top-k routed SwiGLU experts (Mixtral, Qwen3-MoE)."""

    def __init__(
        self, hidden: int, intermediate: int, num_experts: int, top_k: int, norm_topk: bool,
        ep: ParallelGroup, tp: ParallelGroup, dtype: torch.dtype,
    ) -> None:
        super().__init__()
        self.hidden, self.intermediate = hidden, intermediate
        self.num_experts, self.top_k, self.norm_topk = num_experts, top_k, norm_topk
        # One sharding axis at a time: experts over ep, else columns over tp.
        self.reduce_group = ep if ep.size > 1 else tp
        self.expert_start, expert_end = ep.shard_range(num_experts, "num_experts")
        col_group = tp if ep.size == 1 else ParallelGroup()
        self.col_start, col_end = col_group.shard_range(intermediate, "moe_intermediate_size")
        num_local, cols = expert_end - self.expert_start, col_end - self.col_start
        self.router = ReplicatedLinear(hidden, num_experts, dtype)
        # [E_local, 2*I_local, H]: gate rows then up rows, like the dense MLP's merged layer.
        self.w13 = nn.Parameter(torch.empty(num_local, 2 * cols, hidden, dtype=dtype), False)
        # [E_local, H, I_local]
        self.w2 = nn.Parameter(torch.empty(num_local, hidden, cols, dtype=dtype), False)

    def owns(self, expert: int) -> bool:
        return 0 <= expert - self.expert_start < self.w13.shape[0]

    def load_expert(self, name: str, expert: int, which: str, full: torch.Tensor) -> None:
        """which: 'gate' | 'up' ([I, H]) or 'down' ([H, I]). Experts of other ranks are skipped."""
        want = (self.hidden, self.intermediate) if which == "down" else (
            self.intermediate, self.hidden)
        check_shape(name, full.shape, want)
        if not self.owns(expert):
            return
        e, cols = expert - self.expert_start, self.w2.shape[2]
        if which == "down":
            self.w2.data[e].copy_(full.narrow(1, self.col_start, cols))
        else:
            offset = 0 if which == "gate" else cols
            self.w13.data[e, offset : offset + cols].copy_(full.narrow(0, self.col_start, cols))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, H]
        probs = torch.softmax(self.router(x).float(), dim=-1)  # [T, E] float32
        weights, experts = torch.topk(probs, self.top_k, dim=-1)  # [T, k] each
        if self.norm_topk:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        weights = weights.to(x.dtype)
        out = torch.zeros_like(x)
        for e in range(self.w13.shape[0]):
            token_idx, slot = torch.nonzero(experts == self.expert_start + e, as_tuple=True)
            if token_idx.numel() == 0:
                continue
            h = silu_and_mul(F.linear(x[token_idx], self.w13[e]))  # [n, I_local]
            y = F.linear(h, self.w2[e]) * weights[token_idx, slot, None]  # [n, H]
            out.index_add_(0, token_idx, y)
        return self.reduce_group.all_reduce(out)
