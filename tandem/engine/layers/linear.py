"""Linear layers that shard over a tensor-parallel group.

Column-parallel layers split output features (no communication); row-parallel layers split
input features and all-reduce their output. A merged column layer stacks several logical
projections (q/k/v, gate/up) into one matmul; each part is sharded separately, so rank r holds
rows [q_r | k_r | v_r]. Weights arrive through `load_part`, which receives the FULL checkpoint
tensor and copies this rank's slice: the same loader serves TP=1, TP=n and dummy weights.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from tandem.engine import kernels
from tandem.engine.parallel import ParallelGroup


class WeightShapeError(ValueError):
    """A checkpoint tensor does not have the shape the config implies."""


def check_shape(name: str, got: torch.Size, want: tuple[int, ...]) -> None:
    if tuple(got) != tuple(want):
        raise WeightShapeError(
            f"weight '{name}': shape {tuple(got)} in the checkpoint, config implies {tuple(want)}"
        )


@dataclass(frozen=True, slots=True)
class OutputPart:
    """One logical projection inside a merged column layer.

    full_size: rows of the checkpoint tensor; local_start/local_size: the rows this rank keeps
    (for KV heads replicated over more ranks than heads, several ranks keep the same rows)."""

    full_size: int
    local_start: int
    local_size: int

    @staticmethod
    def even(full_size: int, tp: ParallelGroup, what: str) -> OutputPart:
        start, end = tp.shard_range(full_size, what)
        return OutputPart(full_size, start, end - start)


class MergedColumnLinear(nn.Module):
    """y = x @ W.T (+ b), W = concat of `parts` (each already sliced to this rank)."""

    def __init__(
        self, in_features: int, parts: tuple[OutputPart, ...], bias: bool, dtype: torch.dtype
    ) -> None:
        super().__init__()
        self.in_features = in_features
        self.parts = parts
        self.offsets = [sum(p.local_size for p in parts[:i]) for i in range(len(parts))]
        out_local = sum(p.local_size for p in parts)
        self.weight = nn.Parameter(torch.empty(out_local, in_features, dtype=dtype), False)
        self.bias = nn.Parameter(torch.empty(out_local, dtype=dtype), False) if bias else None

    def local_sizes(self) -> list[int]:
        return [p.local_size for p in self.parts]

    def load_part(self, name: str, part: int, full: torch.Tensor, is_bias: bool = False) -> None:
        spec = self.parts[part]
        want = (spec.full_size,) if is_bias else (spec.full_size, self.in_features)
        check_shape(name, full.shape, want)
        dst = self.bias if is_bias else self.weight
        assert dst is not None
        rows = full.narrow(0, spec.local_start, spec.local_size)
        dst.data.narrow(0, self.offsets[part], spec.local_size).copy_(rows)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, in] -> [T, out_local]
        return kernels.linear(x, self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """y = all_reduce(x_r @ W_r.T) (+ b): input features split over `tp`, bias added once."""

    def __init__(
        self, in_features: int, out_features: int, bias: bool, tp: ParallelGroup,
        dtype: torch.dtype,
    ) -> None:
        super().__init__()
        self.tp = tp
        self.in_features, self.out_features = in_features, out_features
        self.in_start, in_end = tp.shard_range(in_features, "row-parallel input features")
        self.weight = nn.Parameter(
            torch.empty(out_features, in_end - self.in_start, dtype=dtype), False
        )
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype), False) if bias else None

    def load_weight(self, name: str, full: torch.Tensor) -> None:
        check_shape(name, full.shape, (self.out_features, self.in_features))
        self.weight.data.copy_(full.narrow(1, self.in_start, self.weight.shape[1]))

    def load_bias(self, name: str, full: torch.Tensor) -> None:
        check_shape(name, full.shape, (self.out_features,))
        assert self.bias is not None
        self.bias.data.copy_(full)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, in_local] -> [T, out]
        y = self.tp.all_reduce(kernels.linear(x, self.weight), owned=True)  # a fresh product
        return y if self.bias is None else y + self.bias

    def forward_fused(
        self, x: torch.Tensor, residual: torch.Tensor, silu_mul: bool = False
    ) -> torch.Tensor:
        """residual + all_reduce(prologue(x_r) @ W_r.T), [T, out], for T <= gemv_max_rows
        (kernels.fused_linear; no bias). The add rides in rank 0's GEMV epilogue: rank 0 sends
        partial + residual, the others their partial, so the sum is the same function with no
        add kernel after the collective (residual is the replicated stream, equal on every
        rank). x: [T, in_local], or [T, 2 in_local] gate|up with silu_mul."""
        assert self.bias is None, "forward_fused: a bias would be added once per rank"
        mine = residual if self.tp.rank == 0 else None
        fast = self.tp.fast  # one launch for GEMV + all-reduce where it applies (batch 1)
        if fast is not None and x.shape[0] == 1 and kernels.gemv_applies(x, self.weight):
            out = fast.gemv_all_reduce(x.contiguous(), self.weight, silu_mul=silu_mul,
                                       residual=mine)
            if out is not None:
                return out
        return self.tp.all_reduce(kernels.fused_linear(x, self.weight, silu_mul=silu_mul,
                                                       residual=mine), owned=True)


class ReplicatedLinear(nn.Module):
    """A small linear layer every rank holds whole (e.g. the MoE router)."""

    def __init__(self, in_features: int, out_features: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype), False)

    def load_weight(self, name: str, full: torch.Tensor) -> None:
        check_shape(name, full.shape, tuple(self.weight.shape))
        self.weight.data.copy_(full)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)
