"""The self-attention layer: projections, q/k norm, rope, and a call into the backend."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from tandem.engine import kernels
from tandem.engine.attention.backend import AttentionBackend
from tandem.engine.layers.linear import (
    MergedColumnLinear,
    OutputPart,
    RowParallelLinear,
)
from tandem.engine.layers.norm import RMSNorm
from tandem.engine.layers.rotary import RotaryEmbedding
from tandem.engine.parallel import ParallelGroup


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class ForwardContext:
    """What layers need from the runner for one forward: the backend, its plan for this
    forward, and a function giving layer i's KV pages. Built by the runner, read by layers."""

    backend: AttentionBackend
    plan: Any
    kv_layer: Callable[[int], torch.Tensor]  # layer index -> [num_pages, 2, ps, Hkv, D]
    # [T] int64 slots where layers write the new K/V themselves (fused rope + store), or None
    # when the backend writes them (the reference backend).
    kv_slots: torch.Tensor | None = None
    # DP attention: the rows every rank adds to the MLP's gather this forward (world rank
    # order; a DP rank's token count on its TP lead, 0 on its other TP ranks), gathered once by
    # the runner; None without DP.
    dp_counts: tuple[int, ...] | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class HeadLayout:
    """How attention heads split over TP. KV heads are replicated when TP > num_kv_heads."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    q_part: OutputPart
    kv_part: OutputPart

    @staticmethod
    def for_rank(num_heads: int, num_kv_heads: int, head_dim: int, tp: ParallelGroup) -> HeadLayout:
        q_part = OutputPart.even(num_heads * head_dim, tp, "num_attention_heads")
        if tp.size <= num_kv_heads:
            kv_part = OutputPart.even(num_kv_heads * head_dim, tp, "num_key_value_heads")
        else:
            if tp.size % num_kv_heads:
                raise ValueError(
                    f"tp size {tp.size} must be a multiple of num_key_value_heads {num_kv_heads}"
                )
            head = tp.rank * num_kv_heads // tp.size
            kv_part = OutputPart(num_kv_heads * head_dim, head * head_dim, head_dim)
        return HeadLayout(num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                          q_part=q_part, kv_part=kv_part)

    @property
    def local_heads(self) -> int:
        return self.q_part.local_size // self.head_dim

    @property
    def local_kv_heads(self) -> int:
        return self.kv_part.local_size // self.head_dim


class SelfAttention(nn.Module):
    def __init__(
        self, layer_idx: int, hidden: int, heads: HeadLayout, qkv_bias: bool, o_bias: bool,
        qk_norm_eps: float | None, rotary: RotaryEmbedding, tp: ParallelGroup, dtype: torch.dtype,
        qkv_in_features: int | None = None,
    ) -> None:
        """qkv_in_features: input width of q/k/v when it differs from `hidden` (EAGLE-3's draft
        layer attends over [token embedding, feature], 2 * hidden wide)."""
        super().__init__()
        self.layer_idx, self.heads, self.rotary = layer_idx, heads, rotary
        self.qkv = MergedColumnLinear(
            qkv_in_features or hidden, (heads.q_part, heads.kv_part, heads.kv_part), qkv_bias, dtype
        )
        self.o_proj = RowParallelLinear(heads.num_heads * heads.head_dim, hidden, o_bias, tp, dtype)
        self.q_norm = RMSNorm(heads.head_dim, qk_norm_eps, dtype) if qk_norm_eps else None
        self.k_norm = RMSNorm(heads.head_dim, qk_norm_eps, dtype) if qk_norm_eps else None
        self.scale = heads.head_dim**-0.5

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:  # positions [T]; x [T, H] -> [T, H]
        return self.o_proj(self._attend(positions, self.qkv(x), ctx))

    def can_fuse(self) -> bool:
        return self.qkv.bias is None and self.o_proj.bias is None

    def forward_fused(
        self, positions: torch.Tensor, stream: torch.Tensor, norm: RMSNorm, ctx: ForwardContext
    ) -> torch.Tensor:
        """Decode / verify of T <= gemv_max_rows rows (kernels.decode_fusion_ok): stream
        [T, H] (the residual stream) -> stream + attn(norm(stream)) [T, H], with each row's
        norm folded into the qkv GEMV and each row's add into o_proj's (under TP, rank 0's
        o_proj GEMV adds it before the all-reduce: RowParallelLinear.forward_fused)."""
        qkv = kernels.fused_linear(stream, self.qkv.weight, norm_weight=norm.weight,
                                   eps=norm.eps)
        return self.o_proj.forward_fused(self._attend(positions, qkv, ctx), stream)

    def forward_add(
        self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor,
        ctx: ForwardContext,
    ) -> torch.Tensor:
        """residual + attn(x), [T, H], with the add in o_proj's GEMV epilogue where
        `kernels.decode_fusion_ok` (a layer without an input norm of its own: EAGLE's draft
        layer 0, whose input is the fc output or the normed [embedding, feature]); under TP in
        rank 0's, before the all-reduce (RowParallelLinear.forward_fused)."""
        return self.o_proj.forward_fused(self._attend(positions, self.qkv(x), ctx), residual)

    def _attend(
        self, positions: torch.Tensor, qkv: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:  # qkv [T, (Hq + 2 Hkv) D] -> attention output [T, Hq D]
        num_tokens, d = qkv.shape[0], self.heads.head_dim
        q, k, v = qkv.split(self.qkv.local_sizes(), dim=-1)
        q = q.view(num_tokens, -1, d)  # [T, Hq_local, D]
        k = k.view(num_tokens, -1, d)  # [T, Hkv_local, D]
        v = v.view(num_tokens, -1, d)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        kv_cache = ctx.kv_layer(self.layer_idx)
        if ctx.kv_slots is not None:  # one kernel: rope, and K/V into the pages
            q = self.rotary.apply_and_store(positions, q, k, v, kv_cache, ctx.kv_slots)
            o = ctx.backend.forward(ctx.plan, kv_cache, q, None, None, self.scale)
        else:
            q, k = self.rotary(positions, q, k)
            o = ctx.backend.forward(ctx.plan, kv_cache, q, k, v, self.scale)
        return o.reshape(num_tokens, -1)
