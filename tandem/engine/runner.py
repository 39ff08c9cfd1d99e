"""`ModelRunner`: runs one forward of one model over a batch laid out by the pure builders.

The runner plans attention once per forward (from frozen metadata), hands layers a
`ForwardContext`, and returns logits only for the rows that need them. It owns nothing
mutable except what the attention backend keeps between plans (workspaces); the KV memory
belongs to the `KVPool` it was given.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tandem.engine.attention.backend import AttentionBackend
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


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class ForwardOutput:
    logits: torch.Tensor  # [n, V] float32, for batch.logits_indices
    hidden: torch.Tensor  # [T, H] final-normed hidden state of every token (EAGLE-1 feature)
    aux_hidden: tuple[torch.Tensor, ...]  # each [T, H] (EAGLE-3 features)


class ModelRunner:
    def __init__(
        self, model: DecoderLM, kv_pool: KVPool, backend: AttentionBackend,
        kv_group: str = "target",
    ) -> None:
        self.model, self.kv_pool, self.backend, self.kv_group = model, kv_pool, backend, kv_group

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> ForwardOutput:
        plan = self.backend.plan(batch.attn)
        group = self.kv_group
        ctx = ForwardContext(
            backend=self.backend, plan=plan, kv_layer=lambda i: self.kv_pool.layer(group, i)
        )
        out = self.model(batch.input_ids, batch.positions, ctx, batch.capture_layers)
        logits = self.model.compute_logits(out.hidden[batch.logits_indices])
        return ForwardOutput(logits=logits, hidden=out.hidden, aux_hidden=out.aux_hidden)
