"""Decode attention whose metadata lives on the device: one query per sequence, its page table,
its position and its key count all device tensors, so one CUDA graph can run several draft
steps in a row (positions advanced on the device) with no host planning between them.

A forward with a `DeviceDecodePlan` attends through `DEVICE_DECODE`, a backend of its own that
plans nothing (the same two kernels on any device: `kernels.store_kv`, then
`kernels.paged_decode`, Triton on CUDA and the float32 torch twin elsewhere); the runner that
builds such plans passes that backend in its ForwardContext. Built by the pure
`device_decode_plan`; host work per forward: none. Plain decode graphs plan through
`DeviceDecodePlanner` (the page tables copied on the device each step).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from tandem.engine import kernels
from tandem.engine.attention.metadata import AttentionMetadata

MAX_SPLITS = 32  # KV splits of the decode kernel at the longest contexts
KEYS_PER_SPLIT = 256  # target keys per split at max_kv_len


def decode_splits(max_kv_len: int) -> int:
    """The KV split count for sequences of up to `max_kv_len` keys: a Python int fixed for an
    engine (graphs capture it; eager forwards use the same, so both sum in the same order)."""
    if max_kv_len < 1:
        raise ValueError(f"max_kv_len: must be >= 1, got {max_kv_len}")
    return max(1, min(MAX_SPLITS, -(-max_kv_len // KEYS_PER_SPLIT)))


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class DeviceDecodePlan:
    """One new token per sequence: it writes its K/V at `slot_ids` and attends to the first
    `kv_lens` keys of its pages (its own included)."""

    page_table: torch.Tensor  # [B, P] int32 page of each sequence's t-th key block
    kv_lens: torch.Tensor  # [B] int32 or int64 keys attended (position + 1)
    slot_ids: torch.Tensor  # [B] int64 page * page_size + offset of the new K/V
    num_splits: int  # KV splits of the decode kernel


def device_decode_plan(page_table: torch.Tensor, positions: torch.Tensor, page_size: int,
                       num_splits: int) -> DeviceDecodePlan:
    """page_table [B, P] int32, positions [B] int64 (device) -> the plan of a decode step whose
    token b sits at positions[b]. Pure tensor ops, no host read: safe inside a CUDA graph."""
    return device_rows_plan(page_table, positions, 1, page_size, num_splits)[0]


def device_rows_plan(table: torch.Tensor, base: torch.Tensor, rows_per_seq: int,
                     page_size: int, num_splits: int) -> tuple[DeviceDecodePlan, torch.Tensor]:
    """R = rows_per_seq decode rows per sequence: row j of sequence b is a decode query at
    position base[b] + j over b's page row -- its K/V written at that slot, attending to
    base[b] + j + 1 keys, so the rows of a sequence are causal among themselves (every row's
    K/V is stored before any attends): a chain verify or draft-extend in the speculative
    graphs, or (R = 1) one decode step. table [B, P] int32, base [B] int64 -> (the plan of
    B * R rows, their positions [B * R] int64). Pure tensor ops, no host read."""
    positions, kv_lens, slots, rows = kernels.decode_rows_plan(table, base, rows_per_seq,
                                                              page_size)  # [B * R] ...
    return DeviceDecodePlan(page_table=rows, kv_lens=kv_lens, slot_ids=slots,
                            num_splits=num_splits), positions


class DeviceDecodeBackend:
    """The attention backend of `DeviceDecodePlan` forwards (the `AttentionBackend` protocol
    without planning: the plan is built on the device by `device_decode_plan`)."""

    name = "device-decode"

    def forward(self, plan: DeviceDecodePlan, kv_cache: torch.Tensor, q: torch.Tensor,
                k: torch.Tensor | None, v: torch.Tensor | None, scale: float) -> torch.Tensor:
        """kv_cache [num_pages, 2, page_size, Hkv, D] (written); q [B, Hq, D]; k, v [B, Hkv, D]
        or None when the layer already wrote them at `plan.slot_ids` -> [B, Hq, D]."""
        if k is not None and v is not None:
            kernels.store_kv(kv_cache, k, v, plan.slot_ids)
        return kernels.paged_decode(q, kv_cache, plan.page_table, plan.kv_lens, scale,
                                    plan.num_splits)


DEVICE_DECODE = DeviceDecodeBackend()


class DeviceDecodePlanner:
    """Plans the steps of `DecodeGraphRunner` without host planning: each step puts its
    rows' page tables (gathered on the device from the metadata's page ids), key counts and
    slots into buffers that never move, and the captured kernels read them there. Five small
    device copies a step, instead of FlashInfer's plan (~0.15-0.3 ms of host work).

    A row is a token: a decode step's one per sequence, or a causal prefill chunk's several
    (`plan` of any metadata without a custom mask). Each attends as a decode query over its
    sequence's pages to its own position (its chunk's later tokens are stored but not seen),
    so a step that prefills short prompts replays a graph too.

    Owns those buffers: table [R_max, P] int32 (columns past a row's pages hold other rows'
    pages: never read, the kernel stops at the key count), lens [R_max] int32, slots [R_max]
    int64."""

    def __init__(self, max_rows: int, max_pages_per_seq: int, page_size: int,
                 device: torch.device) -> None:
        self.num_splits = decode_splits(max_pages_per_seq * page_size)
        self._table = torch.zeros(max_rows, max_pages_per_seq, dtype=torch.int32,
                                  device=device)
        self._lens = torch.ones(max_rows, dtype=torch.int32, device=device)
        self._slots = torch.zeros(max_rows, dtype=torch.int64, device=device)
        self._cols = torch.arange(max_pages_per_seq, dtype=torch.int32, device=device)  # [P]
        self.latest_batch_size: int | None = None  # rows (`cuda_graphs.check_latest_plan`)

    def plan(self, meta: AttentionMetadata) -> DeviceDecodePlan:
        """The plan of causal metadata `meta`, one row per token, over the fixed buffers: the
        same tensors for every batch of a row count (a graph replays on them)."""
        if meta.custom_mask is not None:
            raise ValueError("DeviceDecodePlanner: causal rows only (no custom mask)")
        rows = meta.num_tokens
        if rows == meta.num_seqs:  # decode: row b is sequence b's one token
            seq_of_row = None
            self._lens[:rows].copy_(meta.kv_lens, non_blocking=True)
        else:  # row t of sequence s at index j of its chunk: its keys end at itself
            # numpy, not torch: torch's CPU repeat_interleave forks every intra-op thread
            # for any size (grain 1); on a 16-vCPU H200 host that took ~3 ms per prompt step.
            qo = meta.qo_indptr_cpu.numpy().astype(np.int64)  # [bs + 1]
            seq = np.repeat(np.arange(meta.num_seqs), np.diff(qo))  # [T]
            lens = meta.kv_lens_cpu.numpy().astype(np.int64)[seq] - (qo[1:][seq]
                                                                     - np.arange(rows)) + 1
            both = torch.from_numpy(np.stack([seq, lens]))  # [2, T] int64: one copy, no wait
            if self._lens.is_cuda:
                both = both.pin_memory().to(self._lens.device, non_blocking=True)
            seq_of_row = both[0]
            self._lens[:rows].copy_(both[1])
        starts = meta.kv_page_indptr[:meta.num_seqs]
        if seq_of_row is not None:
            starts = starts[seq_of_row]
        last = max(meta.kv_page_ids.numel() - 1, 0)
        index = (starts[:, None] + self._cols[None, :]).clamp_(max=last)
        torch.index_select(meta.kv_page_ids, 0, index.view(-1),
                           out=self._table[:rows].view(-1))  # [rows * P] row r's pages first
        self._slots[:rows].copy_(meta.slot_ids, non_blocking=True)
        self.latest_batch_size = rows
        return DeviceDecodePlan(page_table=self._table[:rows], kv_lens=self._lens[:rows],
                                slot_ids=self._slots[:rows], num_splits=self.num_splits)
