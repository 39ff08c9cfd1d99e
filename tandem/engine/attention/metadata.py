"""Attention metadata: what one forward's attention needs to know, built by pure functions.

Every forward (prefill chunk, decode, verify, each draft step, draft-extend) gets fresh
metadata from `build_metadata`; nothing is patched in place afterwards (docs/architecture.md,
"Metadata per step"). The layout is FlashInfer's paged one (CSR page tables), so the GPU
backend plans from the very same object the torch reference backend reads.

A forward batch is a list of sequences; sequence i already holds `num_cached` tokens in its
pages and computes `num_new` new tokens in this forward. Its new K/V are written at positions
[num_cached, num_cached + num_new) of its page table, and its queries attend to the first
`num_cached + num_new` keys -- causally, or through an explicit boolean mask (tree verify,
tree drafting).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True, kw_only=True)
class SeqSlice:
    """One sequence's share of a forward (plain ints: builders never read device memory)."""

    page_ids: Sequence[int]  # the sequence's page table; must cover num_cached + num_new tokens
    num_cached: int  # tokens already in the KV cache
    num_new: int  # tokens this forward computes (queries) and writes (keys/values)
    # [num_new, num_cached + num_new] bool, True = may attend; None = causal. Used for tree
    # verify/drafting where new tokens see only their ancestors.
    mask: torch.Tensor | None = None
    # [num_new] positions of the new tokens; None = num_cached + arange(num_new).
    positions: Sequence[int] | None = None

    @property
    def kv_len(self) -> int:
        return self.num_cached + self.num_new


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class AttentionMetadata:
    """Frozen per-forward attention metadata. Device tensors plus their host (`_cpu`) mirrors,
    both made from the same Python ints, so planning never waits on the device."""

    page_size: int
    num_seqs: int
    num_tokens: int
    qo_indptr: torch.Tensor  # [bs+1] int32, CSR offsets of each sequence's queries
    kv_page_indptr: torch.Tensor  # [bs+1] int32, CSR offsets into kv_page_ids
    kv_page_ids: torch.Tensor  # [num_used_pages] int32, pages each sequence attends over
    kv_lens: torch.Tensor  # [bs] int32, keys each sequence attends to (new ones included)
    kv_last_page_len: torch.Tensor  # [bs] int32, valid entries in each sequence's last page
    slot_ids: torch.Tensor  # [num_tokens] int64, page * page_size + offset of each new K/V
    # [sum_i num_new_i * kv_len_i] bool, row-major per sequence (FlashInfer's packing);
    # None when every sequence is causal.
    custom_mask: torch.Tensor | None
    qo_indptr_cpu: torch.Tensor  # [bs+1] int32
    kv_page_indptr_cpu: torch.Tensor  # [bs+1] int32
    kv_page_ids_cpu: torch.Tensor  # [num_used_pages] int32
    kv_lens_cpu: torch.Tensor  # [bs] int32
    kv_last_page_len_cpu: torch.Tensor  # [bs] int32
    max_q_len: int
    max_kv_len: int

    @property
    def is_decode(self) -> bool:
        """Every sequence has exactly one query and a causal mask."""
        return self.custom_mask is None and self.max_q_len == 1


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class BatchLayout:
    """What a builder returns: the metadata plus the token positions the model needs."""

    attn: AttentionMetadata
    positions: torch.Tensor  # [num_tokens] int64


def build_metadata(
    seqs: Sequence[SeqSlice], page_size: int, device: torch.device | str = "cpu"
) -> BatchLayout:
    """The one pure builder every phase uses. Raises ValueError on an inconsistent request
    (page table too short, empty batch) instead of producing metadata that reads garbage."""
    if not seqs:
        raise ValueError("seqs: a forward needs at least one sequence")
    qo_indptr, page_indptr, page_ids, kv_lens, last_lens = [0], [0], [], [], []
    slots: list[int] = []
    positions: list[int] = []
    masks: list[torch.Tensor] = []
    any_mask = any(s.mask is not None for s in seqs)
    for i, s in enumerate(seqs):
        if s.num_new <= 0 or s.num_cached < 0:
            raise ValueError(f"seqs[{i}]: num_new={s.num_new}, num_cached={s.num_cached}")
        kv_len = s.kv_len
        num_pages = -(-kv_len // page_size)
        if len(s.page_ids) < num_pages:
            raise ValueError(
                f"seqs[{i}]: {len(s.page_ids)} pages cannot hold {kv_len} tokens "
                f"at page_size {page_size}"
            )
        used = list(s.page_ids[:num_pages])
        page_ids.extend(used)
        page_indptr.append(page_indptr[-1] + num_pages)
        qo_indptr.append(qo_indptr[-1] + s.num_new)
        kv_lens.append(kv_len)
        last_lens.append(kv_len - (num_pages - 1) * page_size)
        for j in range(s.num_cached, kv_len):
            slots.append(used[j // page_size] * page_size + j % page_size)
        if s.positions is None:
            positions.extend(range(s.num_cached, kv_len))
        else:
            if len(s.positions) != s.num_new:
                raise ValueError(f"seqs[{i}].positions: {len(s.positions)} != num_new")
            positions.extend(s.positions)
        if any_mask:
            masks.append(_sequence_mask(s, i))

    def host(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int32)

    qo_cpu, pind_cpu, pids_cpu = host(qo_indptr), host(page_indptr), host(page_ids)
    lens_cpu, last_cpu = host(kv_lens), host(last_lens)
    custom = torch.cat([m.reshape(-1) for m in masks]).to(device) if any_mask else None
    attn = AttentionMetadata(
        page_size=page_size,
        num_seqs=len(seqs),
        num_tokens=qo_indptr[-1],
        qo_indptr=qo_cpu.to(device),
        kv_page_indptr=pind_cpu.to(device),
        kv_page_ids=pids_cpu.to(device),
        kv_lens=lens_cpu.to(device),
        kv_last_page_len=last_cpu.to(device),
        slot_ids=torch.tensor(slots, dtype=torch.int64, device=device),
        custom_mask=custom,
        qo_indptr_cpu=qo_cpu,
        kv_page_indptr_cpu=pind_cpu,
        kv_page_ids_cpu=pids_cpu,
        kv_lens_cpu=lens_cpu,
        kv_last_page_len_cpu=last_cpu,
        max_q_len=max(s.num_new for s in seqs),
        max_kv_len=max(kv_lens),
    )
    return BatchLayout(attn=attn, positions=torch.tensor(positions, dtype=torch.int64,
                                                          device=device))


def causal_mask(num_new: int, kv_len: int) -> torch.Tensor:
    """[num_new, kv_len] bool: query j (at absolute index kv_len - num_new + j) sees keys <= it."""
    q_abs = torch.arange(kv_len - num_new, kv_len).unsqueeze(1)
    return torch.arange(kv_len).unsqueeze(0) <= q_abs


def _sequence_mask(s: SeqSlice, index: int) -> torch.Tensor:
    if s.mask is None:
        return causal_mask(s.num_new, s.kv_len)
    if tuple(s.mask.shape) != (s.num_new, s.kv_len) or s.mask.dtype != torch.bool:
        raise ValueError(
            f"seqs[{index}].mask: want bool [{s.num_new}, {s.kv_len}], "
            f"got {s.mask.dtype} {list(s.mask.shape)}"
        )
    return s.mask.cpu()


def tree_mask(num_cached: int, parents: Sequence[int]) -> torch.Tensor:
    """Mask for verifying a token tree appended after `num_cached` tokens.

    parents[j] is the index (within the new tokens) of token j's parent, or -1 for a child of
    the last cached token. Returns [num_new, num_cached + num_new] bool: every new token sees
    the whole prefix, itself and its ancestors."""
    n = len(parents)
    mask = torch.zeros(n, num_cached + n, dtype=torch.bool)
    mask[:, :num_cached] = True
    for j, parent in enumerate(parents):
        if parent >= j:
            raise ValueError(f"parents[{j}]={parent}: a parent must come before its child")
        mask[j, num_cached + j] = True
        if parent >= 0:
            mask[j, num_cached:] |= mask[parent, num_cached:]
    return mask
