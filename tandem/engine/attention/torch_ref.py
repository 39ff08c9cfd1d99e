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
class _DecodePlan:
    """Every sequence has one query: one padded SDPA call for the whole batch."""

    key_pages: torch.Tensor  # [bs, max_kv] int64 (padding points at the scratch page 0)
    key_offsets: torch.Tensor  # [bs, max_kv] int64
    mask: torch.Tensor  # [bs, 1, 1, max_kv] bool, False on padding


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class ReferencePlan:
    write_pages: torch.Tensor  # [T] int64
    write_offsets: torch.Tensor  # [T] int64
    seqs: tuple[_SeqPlan, ...]
    decode: _DecodePlan | None = None  # set for pure-decode batches when batching is on


class TorchReferenceBackend:
    name = "torch"

    def __init__(self, device: torch.device, shape: AttentionShape | None = None,
                 batched_decode: bool = True) -> None:
        """batched_decode: run pure-decode batches as one padded SDPA call (same math, far
        fewer calls on the CPU); False keeps the one-call-per-sequence oracle everywhere."""
        self.device = device  # `shape` is not needed: everything is read off the tensors
        self.batched_decode = batched_decode

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
        decode = None
        if self.batched_decode and meta.is_decode and meta.num_seqs > 1:
            decode = _DecodePlan(
                key_pages=_pad([s.key_pages for s in seqs], meta.max_kv_len),
                key_offsets=_pad([s.key_offsets for s in seqs], meta.max_kv_len),
                mask=(torch.arange(meta.max_kv_len, device=self.device)[None, :]
                      < meta.kv_lens_cpu.to(self.device)[:, None])[:, None, None, :],
            )
        return ReferencePlan(write_pages=slots // ps, write_offsets=slots % ps, seqs=tuple(seqs),
                             decode=decode)

    def forward(
        self, plan: ReferencePlan, kv_cache: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
        v: torch.Tensor, scale: float,
    ) -> torch.Tensor:
        # Write first: a token attends to its own key.
        kv_cache[plan.write_pages, 0, plan.write_offsets] = k
        kv_cache[plan.write_pages, 1, plan.write_offsets] = v
        if plan.decode is not None:
            return _batched_decode(plan.decode, kv_cache, q, scale)
        out = torch.empty_like(q)
        group = q.shape[1] // k.shape[1]  # GQA: query heads per KV head
        for s in plan.seqs:
            keys = kv_cache[s.key_pages, 0, s.key_offsets]  # [kv_len, Hkv, D]
            values = kv_cache[s.key_pages, 1, s.key_offsets]
            if group > 1:
                keys = keys.repeat_interleave(group, dim=1)
                values = values.repeat_interleave(group, dim=1)
            # float32 math whatever the storage dtype: the same arithmetic as the batched
            # decode path, so verify (many queries) and decode (one) agree as far as possible.
            o = F.scaled_dot_product_attention(
                q[s.q_start : s.q_end].transpose(0, 1).float(),  # [Hq, q_len, D]
                keys.transpose(0, 1).float(),  # [Hq, kv_len, D]
                values.transpose(0, 1).float(),
                attn_mask=s.mask,
                scale=scale,
            )
            out[s.q_start : s.q_end] = o.transpose(0, 1).to(out.dtype)
        return out


def _pad(rows: list[torch.Tensor], width: int) -> torch.Tensor:
    """[bs, width] int64; positions past a row's length index page 0, offset 0 (masked)."""
    out = torch.zeros(len(rows), width, dtype=torch.int64, device=rows[0].device)
    for i, r in enumerate(rows):
        out[i, : r.shape[0]] = r
    return out


def _batched_decode(plan: _DecodePlan, kv_cache: torch.Tensor, q: torch.Tensor,
                    scale: float) -> torch.Tensor:
    """Explicit float32 softmax attention: on the CPU torch's SDPA is several times slower
    than this in bf16 and no faster in float32."""
    keys = kv_cache[plan.key_pages, 0, plan.key_offsets]  # [bs, max_kv, Hkv, D]
    values = kv_cache[plan.key_pages, 1, plan.key_offsets]
    bs, hq, d = q.shape
    hkv = keys.shape[2]
    qg = q.float().view(bs, hkv, hq // hkv, d)  # [bs, Hkv, G, D]: query heads grouped by KV head
    scores = torch.einsum("bhgd,bkhd->bhgk", qg, keys.float()) * scale  # [bs, Hkv, G, max_kv]
    scores = scores.masked_fill(~plan.mask, float("-inf"))  # mask [bs, 1, 1, max_kv]
    probs = torch.softmax(scores, dim=-1)
    o = torch.einsum("bhgk,bkhd->bhgd", probs, values.float())  # [bs, Hkv, G, D]
    return o.reshape(bs, hq, d).to(q.dtype)
