"""`ModelRunner`: runs one forward of one model over a batch laid out by the pure builders.

The runner plans attention once per forward (from frozen metadata), hands layers a
`ForwardContext`, and returns logits only for the rows that need them. It owns nothing
mutable except what the attention backend keeps between plans (workspaces); the KV memory
belongs to the `KVPool` it was given.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from tandem.engine.attention.backend import AttentionBackend
from tandem.engine.attention.device_decode import DEVICE_DECODE, DeviceDecodePlan
from tandem.engine.attention.metadata import AttentionMetadata
from tandem.engine.kv_cache import KVPool
from tandem.engine.layers.attention import ForwardContext
from tandem.engine.models.decoder import DecoderLM


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class ForwardBatch:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    attn: AttentionMetadata
    logits_indices: torch.Tensor  # [n] int64, rows of the token dim that need logits
    capture_layers: tuple[int, ...] = ()  # layers whose input residual stream is returned
    # Called with i after decoder layer i ran, i.e. once layer i's K/V of every token of this
    # forward is written (on CUDA: enqueued on the current stream -- a hook that hands the
    # memory to another reader must synchronize first). Eager forwards only; None = no-op.
    after_layer: Callable[[int], None] | None = None


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class ForwardOutput:
    logits: torch.Tensor  # [n, V] float32, for batch.logits_indices
    hidden: torch.Tensor  # [T, H] final-normed hidden state of every token (EAGLE-1 feature)
    aux_hidden: tuple[torch.Tensor, ...]  # each [T, H] (EAGLE-3 features)


class ModelRunner:
    """(See the module docstring.) With DP attention every forward starts with one all-gather
    of the DP ranks' token counts; `idle_forward` is the forward of a rank with no tokens."""

    def __init__(
        self, model: DecoderLM, kv_pool: KVPool, backend: AttentionBackend,
        kv_group: str = "target",
    ) -> None:
        self.model, self.kv_pool, self.backend, self.kv_group = model, kv_pool, backend, kv_group

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> ForwardOutput:
        plan = self.backend.plan(batch.attn)
        return self.forward_planned(batch.input_ids, batch.positions, plan,
                                    batch.logits_indices, batch.capture_layers,
                                    batch.after_layer)

    @torch.inference_mode()
    def idle_forward(self, device: torch.device) -> None:
        """DP attention: this rank has nothing to run, but the others do."""
        dp = self.model.par.dp
        self.model.dp_idle_forward(dp.all_gather_counts(0, device), device)

    @torch.inference_mode()
    def forward_planned(
        self, input_ids: torch.Tensor, positions: torch.Tensor, plan: Any,
        logits_indices: torch.Tensor | None, capture_layers: tuple[int, ...] = (),
        after_layer: Callable[[int], None] | None = None,
        dp_counts: tuple[int, ...] | None = None,
    ) -> ForwardOutput:
        """The forward after planning (what `DecodeGraphRunner` captures). input_ids,
        positions [T] int64; logits_indices [n] int64, or None for logits of every row. A
        `DeviceDecodePlan` (every row a decode query whose metadata is on the device: a
        speculative verify in graphs) attends through `DEVICE_DECODE`.
        dp_counts (DP attention): every rank's rows in the MLP's gather when the caller knows
        them (a CUDA graph: `ParallelContext.static_dp_counts`); None gathers them (SYNC)."""
        group = self.kv_group
        backend, slots = self.backend, None
        if isinstance(plan, DeviceDecodePlan):  # metadata on the device: its own backend
            backend, slots = DEVICE_DECODE, plan.slot_ids
        elif (kv_slots := getattr(self.backend, "kv_slots", None)) is not None:  # optional
            slots = kv_slots(plan)
        dp = self.model.par.dp
        ctx = ForwardContext(
            backend=backend, plan=plan, kv_layer=lambda i: self.kv_pool.layer(group, i),
            kv_slots=slots,
            dp_counts=None if dp.size == 1 else dp_counts or dp.all_gather_counts(
                self.model.par.dp_gather_rows(input_ids.shape[0]), input_ids.device),
        )
        out = self.model(input_ids, positions, ctx, capture_layers, after_layer=after_layer)
        rows = out.hidden if logits_indices is None else out.hidden[logits_indices]
        logits = self.model.compute_logits(rows)
        return ForwardOutput(logits=logits, hidden=out.hidden, aux_hidden=out.aux_hidden)
