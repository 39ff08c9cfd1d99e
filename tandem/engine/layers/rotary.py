"""Rotary position embedding (the "rotate half" / NeoX layout HF Llama checkpoints use),
with optional Llama-3.1 frequency scaling. cos/sin are precomputed in float32 for every
position once; a forward only indexes them, so positions may be arbitrary (tree drafts)."""

from __future__ import annotations

import math

import torch
from torch import nn

from tandem.engine import kernels
from tandem.engine.config import RopeScaling


def inverse_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    """[head_dim/2] float32. Same arithmetic as HF so float32 parity is exact."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv = 1.0 / (theta**exponents)
    if scaling is None:
        return inv
    # Llama 3.1: long wavelengths are slowed by `factor`, short ones kept, the band between
    # interpolated smoothly.
    old_ctx = scaling.original_max_position_embeddings
    low_wavelen = old_ctx / scaling.low_freq_factor
    high_wavelen = old_ctx / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / scaling.factor, inv)
    smooth = (old_ctx / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    is_medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    def __init__(
        self, head_dim: int, max_position: int, theta: float, scaling: RopeScaling | None
    ) -> None:
        super().__init__()
        inv = inverse_frequencies(head_dim, theta, scaling)
        freqs = torch.outer(torch.arange(max_position, dtype=torch.float32), inv)
        emb = torch.cat([freqs, freqs], dim=-1)
        # [max_position, head_dim] float32 each; buffers move with the module's device.
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] int64; q [T, Hq, D]; k [T, Hk, D] -> rotated (new tensors)."""
        return kernels.rotary(positions, q, k, self.cos, self.sin)

    def apply_and_store(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
        kv_cache: torch.Tensor, slot_ids: torch.Tensor,
    ) -> torch.Tensor:
        """Rotate q and k; write k and v into kv_cache [num_pages, 2, ps, Hk, D] at slot_ids
        [T] int64 (one Triton kernel on CUDA). Returns the rotated q [T, Hq, D]."""
        return kernels.rotary_store(positions, q, k, v, self.cos, self.sin, kv_cache, slot_ids)
