"""RMSNorm, computed the way HF computes it (float32 statistics, weight applied in the model
dtype) so that parity tests hold in bf16 as well as float32. On CUDA one Triton kernel does
the residual add and the norm (see `tandem.engine.kernels`)."""

from __future__ import annotations

import torch
from torch import nn

from tandem.engine import kernels


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype), False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., dim] -> [..., dim]
        return kernels.rms_norm(x, self.weight, self.eps)

    def add_and_norm(
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual). The sum is taken in the model dtype, as HF does."""
        return kernels.add_rms_norm(x, residual, self.weight, self.eps)
