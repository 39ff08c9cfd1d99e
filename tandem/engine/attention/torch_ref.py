"""The torch reference attention backend: slow, obvious, and the oracle every other backend
is tested against. Runs anywhere torch runs (CI uses it on the CPU)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tandem.engine.attention.backend import AttentionShape
from tandem.engine.attention.metadata import AttentionMetadata, causal_mask


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class _SeqPlan:
    q_start: int
    q_end: int
    key_pages: torch.Tensor  # [kv_len] int64 page of each key
    key_offsets: torch.Tensor  # [kv_len] int64 offset of each key inside its page
    mask: torch.Tensor  # [q_len, kv_len] bool


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class ReferencePlan:
    write_pages: torch.Tensor  # [T] int64
    write_offsets: torch.Tensor  # [T] int64
    seqs: tuple[_SeqPlan, ...]


class TorchReferenceBackend:
    name = "torch"

    def __init__(self, device: torch.device, shape: AttentionShape | None = None) -> None:
        self.device = device  # `shape` is not needed: everything is read off the tensors

    def plan(self, meta: AttentionMetadata) -> ReferencePlan:
        ps = meta.page_size
        qo = meta.qo_indptr_cpu.tolist()  # host tensors: no device sync
        pind = meta.kv_page_indptr_cpu.tolist()
        lens = meta.kv_lens_cpu.tolist()
        pages_all = meta.kv_page_ids_cpu.long()
        custom = meta.custom_mask.cpu() if meta.custom_mask is not None else None
        seqs, mask_off = [], 0
        for i in range(meta.num_seqs):
            kv_len, q_len = lens[i], qo[i + 1] - qo[i]
            token_idx = torch.arange(kv_len)
            pages = pages_all[pind[i] : pind[i + 1]][token_idx // ps]
            if custom is None:
                mask = causal_mask(q_len, kv_len)
            else:
                mask = custom[mask_off : mask_off + q_len * kv_len].view(q_len, kv_len)
                mask_off += q_len * kv_len
            seqs.append(_SeqPlan(
                q_start=qo[i], q_end=qo[i + 1],
                key_pages=pages.to(self.device), key_offsets=(token_idx % ps).to(self.device),
                mask=mask.to(self.device),
            ))
        slots = meta.slot_ids
        return ReferencePlan(write_pages=slots // ps, write_offsets=slots % ps, seqs=tuple(seqs))

    def forward(
        self, plan: ReferencePlan, kv_cache: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
        v: torch.Tensor, scale: float,
    ) -> torch.Tensor:
        # Write first: a token attends to its own key.
        kv_cache[plan.write_pages, 0, plan.write_offsets] = k
        kv_cache[plan.write_pages, 1, plan.write_offsets] = v
        out = torch.empty_like(q)
        group = q.shape[1] // k.shape[1]  # GQA: query heads per KV head
        for s in plan.seqs:
            keys = kv_cache[s.key_pages, 0, s.key_offsets]  # [kv_len, Hkv, D]
            values = kv_cache[s.key_pages, 1, s.key_offsets]
            if group > 1:
                keys = keys.repeat_interleave(group, dim=1)
                values = values.repeat_interleave(group, dim=1)
            o = F.scaled_dot_product_attention(
                q[s.q_start : s.q_end].transpose(0, 1),  # [Hq, q_len, D]
                keys.transpose(0, 1),  # [Hq, kv_len, D]
                values.transpose(0, 1),
                attn_mask=s.mask,
                scale=scale,
            )
            out[s.q_start : s.q_end] = o.transpose(0, 1)
        return out
