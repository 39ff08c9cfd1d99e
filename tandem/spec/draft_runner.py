"""`DraftRunner`: runs the draft head over a batch laid out by the pure metadata builders, with
its own KV layer group ("draft") in the shared pool (same page ids as the target)."""

from __future__ import annotations

from typing import Any

import torch

from tandem.engine.attention.backend import AttentionBackend
from tandem.engine.attention.device_decode import (
    DEVICE_DECODE,
    DeviceDecodePlan,
    decode_splits,
)
from tandem.engine.attention.metadata import BatchLayout
from tandem.engine.kv_cache import KVGroupSpec, KVPool
from tandem.engine.layers.attention import ForwardContext
from tandem.spec.head import EagleHead

DRAFT_GROUP = "draft"


def draft_kv_group(head: EagleHead) -> KVGroupSpec:
    return KVGroupSpec(name=DRAFT_GROUP, num_layers=head.cfg.num_layers,
                       num_kv_heads=head.heads.local_kv_heads, head_dim=head.cfg.head_dim)


class DraftRunner:
    def __init__(self, head: EagleHead, kv_pool: KVPool, backend: AttentionBackend,
                 max_kv_len: int) -> None:
        """max_kv_len: the longest draft context (fixes the KV split count of chain draft
        steps, `device_decode.decode_splits`: eager steps and their graph sum alike)."""
        self.head, self.kv_pool, self.backend = head, kv_pool, backend
        self.num_splits = decode_splits(max_kv_len)

    @torch.inference_mode()
    def forward(
        self, token_ids: torch.Tensor, features: torch.Tensor, layout: BatchLayout
    ) -> torch.Tensor:
        """token_ids [T] int64; features [T, F] -> draft hidden [T, H]. Plans attention for
        exactly this forward (metadata is rebuilt for every draft step by the caller)."""
        plan = self.backend.plan(layout.attn)
        return self.forward_planned(token_ids, features, layout.positions, plan)

    @torch.inference_mode()
    def forward_planned(
        self, token_ids: torch.Tensor, features: torch.Tensor, positions: torch.Tensor,
        plan: Any,
    ) -> torch.Tensor:
        """The forward after planning (what the drafting CUDA graphs capture). A
        `DeviceDecodePlan` (chain draft steps) attends through its own backend."""
        backend = DEVICE_DECODE if isinstance(plan, DeviceDecodePlan) else self.backend
        ctx = ForwardContext(backend=backend, plan=plan,
                             kv_layer=lambda i: self.kv_pool.layer(DRAFT_GROUP, i))
        return self.head(token_ids, features, positions, ctx)
