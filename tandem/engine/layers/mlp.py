"""Feed-forward blocks: the dense SwiGLU MLP and the sparse mixture-of-experts block.

MoE experts shard over the expert-parallel group `ep`: rank r owns experts
[r*E/ep, (r+1)*E/ep) whole. By default ("allreduce") every rank routes every token (the router
is replicated), runs the experts it owns on the tokens that chose them, and an all-reduce sums
the partial outputs. With `moe_dispatch` "alltoall" / "alltoall_padded" the tokens travel to
their experts' ranks and back instead (moe_dispatch.py): under DP attention each rank sends its
own tokens (no gather; a DP rank of TP > 1 splits its tokens over its TP ranks, which hold the
same ones); otherwise the tokens are the same on every EP rank, so each rank sends an even
slice of them and the slices are all-gathered afterwards.
When ep has one rank and tp has several, expert intermediate columns shard over tp instead
(the dispatch setting is then moot: every expert is local).
The experts themselves run as fused grouped-GEMM kernels (kernels.moe_experts: pairs sorted by
expert on the device, Triton on CUDA, torch twins elsewhere), with no host read and shapes
fixed by the batch: the all-reduce path and the padded all-to-all capture in CUDA graphs.
"""

from __future__ import annotations

import torch
from torch import nn

from tandem.engine import kernels
from tandem.engine.layers.linear import (
    MergedColumnLinear,
    OutputPart,
    ReplicatedLinear,
    RowParallelLinear,
    check_shape,
)
from tandem.engine.layers.moe_dispatch import AllToAllDispatcher, even_counts
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
        return self.down.bias is None

    def forward_fused(self, stream: torch.Tensor, norm: RMSNorm) -> torch.Tensor:
        """Decode / verify of T <= gemv_max_rows rows: stream [T, H] -> stream +
        mlp(norm(stream)) [T, H] in two GEMV launches (each row's norm folded into gate_up's,
        silu-and-mul and the residual add into down's; under TP, the add into rank 0's, before
        the all-reduce)."""
        gate_up = kernels.fused_linear(stream, self.gate_up.weight, norm_weight=norm.weight,
                                       eps=norm.eps)
        return self.down.forward_fused(gate_up, stream, silu_mul=True)


MOE_DISPATCH_MODES = ("allreduce", "alltoall", "alltoall_padded")


class SparseMoE(nn.Module):
    """Top-k routed SwiGLU experts (Mixtral, Qwen3-MoE). `dispatch` is one of
    MOE_DISPATCH_MODES (EngineConfig.moe_dispatch)."""

    def __init__(
        self, hidden: int, intermediate: int, num_experts: int, top_k: int, norm_topk: bool,
        ep: ParallelGroup, tp: ParallelGroup, dtype: torch.dtype, dispatch: str = "allreduce",
    ) -> None:
        super().__init__()
        if dispatch not in MOE_DISPATCH_MODES:
            raise ValueError(f"moe_dispatch: '{dispatch}' is not one of "
                             f"{', '.join(MOE_DISPATCH_MODES)}")
        self.ep = ep
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
        # None: the all-reduce path (also whenever ep has one rank: nothing to dispatch)
        self.a2a = (AllToAllDispatcher(ep, num_local, padded=dispatch == "alltoall_padded")
                    if dispatch != "allreduce" and ep.size > 1 else None)

    @property
    def dispatches_tokens(self) -> bool:
        """True when tokens travel to their experts' ranks (all-to-all): under DP attention the
        block then takes this DP rank's own rows, not the gathered ones."""
        return self.a2a is not None

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

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] -> (weights [T, k] x.dtype, experts [T, k] int64 global expert ids)."""
        probs = torch.softmax(self.router(x).float(), dim=-1)  # [T, E] float32
        weights, experts = torch.topk(probs, self.top_k, dim=-1)  # [T, k] each
        if self.norm_topk:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype), experts

    def forward(
        self, x: torch.Tensor, max_rows: int | None = None, shared_by: ParallelGroup | None = None,
    ) -> torch.Tensor:
        """x [T, H] -> [T, H]. For all-to-all only: `shared_by` is the group whose ranks all hold
        this same x (each dispatches an even slice of it, then the slices are all-gathered),
        `max_rows` the most rows any EP rank's x has (host int: sets the padded capacity).
        None, None: x is the same on every EP rank (no DP attention). Under DP attention x is
        this DP rank's own rows, shared by its TP ranks."""
        weights, experts = self.route(x)
        if self.a2a is None:
            return self.reduce_group.all_reduce(self._local_experts_by_token(x, weights, experts))
        shared_by = self.ep if shared_by is None else shared_by
        max_rows = x.shape[0] if max_rows is None else max_rows
        counts = even_counts(x.shape[0], shared_by.size)
        start, n = sum(counts[: shared_by.rank]), counts[shared_by.rank]
        capacity = max(even_counts(max_rows, shared_by.size))  # rows of the largest slice
        out = self._alltoall(x[start : start + n], weights[start : start + n],
                             experts[start : start + n], capacity)
        return shared_by.all_gather_rows(out, counts)

    def _local_experts_by_token(
        self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor
    ) -> torch.Tensor:
        """The all-reduce path's partial sum: [T, H], this rank's experts' weighted outputs
        (slots routed to other ranks' experts add 0). Fused MoE kernels: no host read, shapes
        fixed by T (a decode step captures in a CUDA graph); the per-expert loop it replaced
        is the tests' oracle (kernels/moe_reference.py)."""
        y = kernels.moe_experts(x, self.w13, self.w2, experts, self.expert_start)  # [T, k, H]
        return kernels.moe_weighted_sum(y, weights, experts)

    def _alltoall(
        self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, slice_rows: int
    ) -> torch.Tensor:
        """x [T, H] this rank's rows, weights/experts [T, k] -> [T, H] their MoE output.
        slice_rows: the most rows any EP rank dispatches this forward (T <= slice_rows)."""
        assert self.a2a is not None
        num_tokens, k = experts.shape
        sent = self.a2a.dispatch(x, experts, capacity=slice_rows * k)
        back = self.a2a.combine(self._run_received(sent.rows, sent.local_expert), sent)
        # Each token's k outputs weighted and added from zero in ascending expert id: the
        # order the all-reduce path adds them in on one rank, so both give the same sums.
        return kernels.moe_weighted_sum(back.view(num_tokens, k, x.shape[1]), weights, experts)

    def _run_received(self, rows: torch.Tensor, local_expert: torch.Tensor) -> torch.Tensor:
        """rows [N, H], local_expert [N] int64 (-1: padding) -> [N, H] unweighted expert outputs
        (zeros on padding rows): the fused kernels with one slot per row, no host read (the
        padded variant's N = ep * capacity is fixed, so its decode step captures in a graph)."""
        return kernels.moe_experts(rows, self.w13, self.w2, local_expert[:, None], 0)[:, 0]
