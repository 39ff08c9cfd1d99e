"""The FlashInfer attention backend (CUDA): paged decode, paged causal prefill and
custom-mask (tree) verify, planned once per forward from the same `AttentionMetadata` the
torch reference reads.

Planning reads only the metadata's host (`_cpu`) tensors and hands FlashInfer the device page
ids, so `plan()` never waits on the GPU. New K/V go into the pages with one Triton kernel
(`kernels.store_kv`) before the attention kernel runs, so a token attends to itself.

Decode always runs through fixed-batch-size ("CUDA graph mode") wrappers, in eager steps too:
for a given batch size an eager decode and a replayed graph launch the same kernels with the
same KV split, so greedy outputs with and without CUDA graphs are bitwise equal.
flashinfer is imported when the backend is constructed, never at tandem import time.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

import torch

from tandem.engine import kernels
from tandem.engine.attention.backend import AttentionShape
from tandem.engine.attention.metadata import AttentionMetadata

FLOAT_WORKSPACE_BYTES = 128 << 20  # split-KV partial outputs; FlashInfer's recommended size
INT_WORKSPACE_BYTES = 8 << 20  # scheduler metadata; FlashInfer's own default


class _Epoch:
    """A counter one planner bumps on every plan; a plan is valid while its epoch is current
    (wrappers and workspaces are shared, so planning the next forward invalidates the last)."""

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class FlashInferPlan:
    wrapper: Any  # the planned FlashInfer wrapper (decode or prefill)
    slot_ids: torch.Tensor  # [T] int64, page * page_size + offset of each new K/V
    epoch: _Epoch  # the planner's counter ...
    planned_at: int  # ... and its value when this plan was made


def check_graph_metadata(meta: AttentionMetadata, where: str) -> None:
    """Host-side consistency of what a CUDA-graph plan hands the captured kernels, checked
    before launch on the [B+1] host tensors (plain lists: a few microseconds): a bad indptr
    inside a graph is an illegal memory access with no Python stack. CSR offsets start at 0,
    never decrease and end at the token/page counts; every sequence has >= 1 page, a last-page
    length in [1, page_size], and pages that exactly cover its keys."""
    qo, kv = meta.qo_indptr_cpu.tolist(), meta.kv_page_indptr_cpu.tolist()
    last, lens = meta.kv_last_page_len_cpu.tolist(), meta.kv_lens_cpu.tolist()
    ps, bad = meta.page_size, None
    if qo[0] != 0 or kv[0] != 0 or any(b < a for x in (qo, kv) for a, b in itertools.pairwise(x)):
        bad = "indptr must start at 0 and never decrease"
    elif qo[-1] != meta.num_tokens or kv[-1] != meta.kv_page_ids_cpu.numel():
        bad = (f"indptr ends ({qo[-1]}, {kv[-1]}) != tokens/pages "
               f"({meta.num_tokens}, {meta.kv_page_ids_cpu.numel()})")
    else:
        for i, ((p0, p1), n_last, n) in enumerate(zip(itertools.pairwise(kv), last, lens)):
            if p1 - p0 < 1 or not 1 <= n_last <= ps or (p1 - p0 - 1) * ps + n_last != n:
                bad = (f"sequence {i}: {p1 - p0} pages, last-page length {n_last}, {n} keys "
                       f"(page size {ps})")
                break
    if bad is not None:
        raise ValueError(f"{where}: inconsistent graph metadata: {bad}")


class _UploadGuard:
    """FlashInfer's plan() writes scheduler metadata into a pinned host buffer and queues an
    async copy to the device; the next plan() must not overwrite that buffer before the copy
    ran. An event recorded after each plan is waited for before the next one."""

    def __init__(self) -> None:
        self._event: torch.cuda.Event | None = None

    def before_plan(self) -> None:
        if self._event is not None:
            # SYNC: waits only for the previous plan's upload (queued before the previous
            # forward's kernels); a no-op in the engine loop, which syncs once per step anyway.
            self._event.synchronize()

    def after_plan(self) -> None:
        if self._event is None:
            self._event = torch.cuda.Event()
        self._event.record()


class DecodeWrappers:
    """Owns fixed-batch-size FlashInfer decode wrappers (one per batch size, created on first
    use) and every buffer they plan into: page-table buffers (indptr [B+1], page ids
    [capacity], last-page lengths [B]), the new-token slots [B], and one int workspace with its
    pinned host mirror shared by all wrappers.

    Invariants: only the latest plan is valid (shared buffers); `plan()` reads host tensors
    and copies device page ids device-to-device, never syncing on compute. With
    `growable=False` (CUDA graphs) buffers never move, so captured graphs stay valid; a batch
    beyond the capacity raises instead of reallocating."""

    def __init__(
        self, fi: Any, float_workspace: torch.Tensor, shape: AttentionShape,
        device: torch.device, max_batch_size: int, max_num_pages: int, growable: bool,
        use_tensor_cores: bool = True,
    ) -> None:
        self._fi, self._float_ws, self.shape, self.device = fi, float_workspace, shape, device
        self.growable, self.use_tensor_cores = growable, use_tensor_cores
        self._int_ws = torch.empty(INT_WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self._int_ws_host = torch.empty(INT_WORKSPACE_BYTES, dtype=torch.uint8,
                                        pin_memory=True)
        self._epoch, self._guard = _Epoch(), _UploadGuard()
        # Batch size of the latest plan: a graph of another size must not replay on these
        # shared buffers (its indptr tail is stale -> negative page counts -> illegal access).
        self.latest_batch_size: int | None = None
        self._allocate(max_batch_size, max_num_pages)

    def _allocate(self, max_batch_size: int, max_num_pages: int) -> None:
        dev = self.device
        self.max_batch_size, self.max_num_pages = max_batch_size, max_num_pages
        # Plain (not inference-mode) tensors even when growing inside a forward, so a later
        # plan() outside inference mode may still write them.
        with torch.inference_mode(False):
            self._indptr = torch.zeros(max_batch_size + 1, dtype=torch.int32, device=dev)
            self._last_len = torch.ones(max_batch_size, dtype=torch.int32, device=dev)  # [B]
            self._page_ids = torch.zeros(max_num_pages, dtype=torch.int32, device=dev)
            self._slot_ids = torch.zeros(max_batch_size, dtype=torch.int64, device=dev)
        # _indptr [B+1] int32, _page_ids [capacity] int32, _slot_ids [B] int64
        self._wrappers: dict[int, Any] = {}

    def _wrapper(self, batch_size: int) -> Any:
        w = self._wrappers.get(batch_size)
        if w is None:
            w = self._fi.BatchDecodeWithPagedKVCacheWrapper(
                self._float_ws, "NHD", use_cuda_graph=True,
                use_tensor_cores=self.use_tensor_cores,
                paged_kv_indptr_buffer=self._indptr[: batch_size + 1],
                paged_kv_indices_buffer=self._page_ids,
                paged_kv_last_page_len_buffer=self._last_len[:batch_size],
                backend="fa2",
            )
            # Share one int workspace (and its pinned mirror) across batch sizes instead of
            # 8+8 MiB each; safe because only the latest plan is ever run (see the guard).
            # (Private attributes of FlashInfer 0.7; without them each wrapper keeps its own.)
            if all(hasattr(w, a) for a in ("_int_workspace_buffer",
                                           "_pin_memory_int_workspace_buffer")):
                w._int_workspace_buffer = self._int_ws
                w._pin_memory_int_workspace_buffer = self._int_ws_host
            self._wrappers[batch_size] = w
        return w

    def plan(self, meta: AttentionMetadata) -> FlashInferPlan:
        if not meta.is_decode:
            raise ValueError("DecodeWrappers.plan: metadata is not a pure decode batch")
        bs, num_pages = meta.num_seqs, meta.kv_page_ids_cpu.numel()
        if not self.growable:
            check_graph_metadata(meta, "DecodeWrappers.plan")
        if bs > self.max_batch_size or num_pages > self.max_num_pages:
            if not self.growable:
                raise ValueError(
                    f"decode batch of {bs} sequences over {num_pages} pages exceeds the CUDA "
                    f"graph buffers ({self.max_batch_size} sequences, {self.max_num_pages} pages)"
                )
            self._allocate(*grown_capacity(bs, num_pages, self.max_batch_size,
                                           self.max_num_pages))
        s = self.shape
        self._guard.before_plan()
        self._wrapper(bs).plan(
            meta.kv_page_indptr_cpu, meta.kv_page_ids, meta.kv_last_page_len_cpu,
            s.num_qo_heads, s.num_kv_heads, s.head_dim, meta.page_size,
            q_data_type=s.dtype, kv_data_type=s.dtype, sm_scale=s.scale, non_blocking=True,
        )
        self._guard.after_plan()
        slots = self._slot_ids[:bs]  # [bs] int64, a fixed address for graph replay
        slots.copy_(meta.slot_ids, non_blocking=True)
        self.latest_batch_size = bs
        self._epoch.value += 1
        return FlashInferPlan(wrapper=self._wrappers[bs], slot_ids=slots, epoch=self._epoch,
                              planned_at=self._epoch.value)


def grown_capacity(batch_size: int, num_pages: int, max_batch_size: int, max_num_pages: int
                   ) -> tuple[int, int]:
    """The (batch, pages) capacity of growable decode buffers that hold this batch: a dimension
    grows only when exceeded, and then at least doubles. (Pages used to double whenever the
    batch grew: a batch growing by a row at a time doubled them each step, up to a 51 GiB
    page-id buffer and a decode worker out of GPU memory at 256 concurrent requests.)"""
    if batch_size > max_batch_size:
        max_batch_size = max(batch_size, 2 * max_batch_size)
    if num_pages > max_num_pages:
        max_num_pages = max(num_pages, 2 * max_num_pages)
    return max_batch_size, max_num_pages


class PrefillGraphWrappers:
    """Owns fixed-batch-size FlashInfer prefill wrappers in CUDA-graph mode (one per batch size,
    created on first use) for forwards where every sequence computes the same number of new
    tokens (`tokens_per_seq`): speculative verify (a tree or chain of N nodes per request) and
    tree draft steps. Owns every buffer they plan into -- qo/page-table indptrs [B+1], page ids
    [capacity], last-page lengths [B], the packed custom mask [bytes] and its indptr [B+1],
    the new-token slots [B * tokens_per_seq] -- so captured graphs read each new plan.

    Invariants: only the latest plan is valid (shared buffers); buffers never move; a batch
    that does not fit (pages, mask bytes, another token count, another mask mode) raises."""

    # FlashInfer plan options under test (benchmarks/gpu_spec.py --verify-plan sets them for an
    # A/B before engines are built; the engine sets none): "uniform_q_len" (every sequence has
    # tokens_per_seq query rows: the scheduler sizes its query tile for them instead of the
    # ragged worst case), "disable_split_kv" (no split-KV partial outputs, no merge kernel).
    plan_options: frozenset[str] = frozenset()

    def __init__(
        self, fi: Any, float_workspace: torch.Tensor, shape: AttentionShape,
        device: torch.device, max_batch_size: int, tokens_per_seq: int, max_num_pages: int,
        max_kv_len: int, custom_mask: bool,
    ) -> None:
        self._fi, self._float_ws, self.shape, self.device = fi, float_workspace, shape, device
        self.max_batch_size, self.tokens_per_seq = max_batch_size, tokens_per_seq
        self.max_num_pages, self.custom_mask = max_num_pages, custom_mask
        b, dev = max_batch_size, device
        with torch.inference_mode(False):  # plain tensors: plan() may run outside inference
            self._qo_indptr = torch.zeros(b + 1, dtype=torch.int32, device=dev)  # [B+1]
            self._kv_indptr = torch.zeros(b + 1, dtype=torch.int32, device=dev)  # [B+1]
            self._page_ids = torch.zeros(max_num_pages, dtype=torch.int32, device=dev)
            self._last_len = torch.ones(b, dtype=torch.int32, device=dev)  # [B]
            self._slot_ids = torch.zeros(b * tokens_per_seq, dtype=torch.int64, device=dev)
            # Bit-packed mask, each sequence's [n, kv_len] rows padded to a byte (FlashInfer's
            # segment_packbits), plus slack.
            mask_bytes = b * (-(-tokens_per_seq * max_kv_len // 8)) + 64
            self._mask = (torch.zeros(mask_bytes, dtype=torch.uint8, device=dev)
                          if custom_mask else None)
            self._mask_indptr = (torch.zeros(b + 1, dtype=torch.int32, device=dev)
                                 if custom_mask else None)
        self._wrappers: dict[int, Any] = {}
        self._epoch, self._guard = _Epoch(), _UploadGuard()
        self.latest_batch_size: int | None = None  # as in DecodeWrappers

    def _wrapper(self, batch_size: int) -> Any:
        w = self._wrappers.get(batch_size)
        if w is None:
            n = batch_size
            w = self._fi.BatchPrefillWithPagedKVCacheWrapper(
                self._float_ws, "NHD", use_cuda_graph=True,
                qo_indptr_buf=self._qo_indptr[: n + 1],
                paged_kv_indptr_buf=self._kv_indptr[: n + 1],
                paged_kv_indices_buf=self._page_ids,
                paged_kv_last_page_len_buf=self._last_len[:n],
                custom_mask_buf=self._mask,
                mask_indptr_buf=None if self._mask_indptr is None else self._mask_indptr[: n + 1],
                backend="fa2",
            )
            self._wrappers[batch_size] = w
        return w

    def plan(self, meta: AttentionMetadata) -> FlashInferPlan:
        bs, n = meta.num_seqs, self.tokens_per_seq
        if bs > self.max_batch_size or meta.num_tokens != bs * n:
            raise ValueError(f"PrefillGraphWrappers.plan: {bs} sequences of {meta.num_tokens} "
                             f"tokens; planned for <= {self.max_batch_size} x {n}")
        if (meta.custom_mask is not None) != self.custom_mask:
            raise ValueError(f"PrefillGraphWrappers.plan: custom mask "
                             f"{'missing' if self.custom_mask else 'given'}; the captured "
                             f"kernels are {'masked' if self.custom_mask else 'causal'}")
        if meta.kv_page_ids_cpu.numel() > self.max_num_pages:
            raise ValueError(f"PrefillGraphWrappers.plan: {meta.kv_page_ids_cpu.numel()} pages "
                             f"exceed the graph buffers ({self.max_num_pages})")
        check_graph_metadata(meta, "PrefillGraphWrappers.plan")
        if meta.custom_mask is not None:
            lens = meta.kv_lens_cpu.tolist()  # host tensor: no device sync
            need = sum(-(-n * kv // 8) for kv in lens)
            if need > self._mask.numel():
                raise ValueError(f"PrefillGraphWrappers.plan: the mask needs {need} bytes, "
                                 f"the graph buffer holds {self._mask.numel()}")
        s = self.shape
        self._guard.before_plan()
        self._wrapper(bs).plan(
            meta.qo_indptr_cpu, meta.kv_page_indptr_cpu, meta.kv_page_ids,
            meta.kv_last_page_len_cpu, s.num_qo_heads, s.num_kv_heads, s.head_dim,
            meta.page_size, custom_mask=meta.custom_mask, causal=meta.custom_mask is None,
            sm_scale=s.scale, q_data_type=s.dtype, kv_data_type=s.dtype, non_blocking=True,
            **self._option_args(),
        )
        self._guard.after_plan()
        slots = self._slot_ids[: bs * n]  # a fixed address for graph replay
        slots.copy_(meta.slot_ids, non_blocking=True)
        self.latest_batch_size = bs
        self._epoch.value += 1
        return FlashInferPlan(wrapper=self._wrappers[bs], slot_ids=slots, epoch=self._epoch,
                              planned_at=self._epoch.value)


    def _option_args(self) -> dict[str, Any]:
        opts = self.plan_options
        args: dict[str, Any] = {}
        if "uniform_q_len" in opts:
            args["uniform_q_len"] = self.tokens_per_seq
        if "disable_split_kv" in opts:
            args["disable_split_kv"] = True
        return args


class FlashInferBackend:
    """Owns the FlashInfer float workspace, the eager decode wrappers and the prefill/verify
    wrapper. Graph decode wrappers (`graph_decode_planner`) share the float workspace: only
    one forward runs at a time on the device's stream."""

    name = "flashinfer"

    def __init__(self, device: torch.device, shape: AttentionShape | None = None) -> None:
        if shape is None:
            raise ValueError("FlashInferBackend: needs the model's AttentionShape to plan")
        if torch.device(device).type != "cuda":
            raise ValueError(f"FlashInferBackend: needs a CUDA device, got {device}")
        import flashinfer  # lazy: GPU-only dependency

        self._fi, self.device, self.shape = flashinfer, torch.device(device), shape
        # Zeroed once: FlashInfer requires a zero-initialised float workspace on first use.
        self._float_ws = torch.zeros(FLOAT_WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self._decode = DecodeWrappers(flashinfer, self._float_ws, shape, self.device,
                                      max_batch_size=64, max_num_pages=4096, growable=True)
        self._prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(
            self._float_ws, "NHD", backend="fa2")
        self._prefill_epoch, self._prefill_guard = _Epoch(), _UploadGuard()

    def graph_decode_planner(self, max_batch_size: int, max_num_pages: int) -> DecodeWrappers:
        """Decode wrappers whose buffers never move, for CUDA graphs (see `DecodeGraphRunner`)."""
        return DecodeWrappers(self._fi, self._float_ws, self.shape, self.device,
                              max_batch_size, max_num_pages, growable=False)

    def graph_prefill_planner(self, max_batch_size: int, tokens_per_seq: int,
                              max_num_pages: int, max_kv_len: int,
                              custom_mask: bool) -> PrefillGraphWrappers:
        """Prefill wrappers whose buffers never move, for CUDA graphs of forwards with a fixed
        number of new tokens per sequence (speculative verify, tree draft steps)."""
        return PrefillGraphWrappers(self._fi, self._float_ws, self.shape, self.device,
                                    max_batch_size, tokens_per_seq, max_num_pages, max_kv_len,
                                    custom_mask)

    def plan(self, meta: AttentionMetadata) -> FlashInferPlan:
        if meta.is_decode:
            return self._decode.plan(meta)
        s = self.shape
        self._prefill_guard.before_plan()
        # Prefill chunks, ragged batches and tree verify: causal, or the packed custom mask
        # (FlashInfer's own row-major per-sequence layout, which the builder already uses).
        self._prefill.plan(
            meta.qo_indptr_cpu, meta.kv_page_indptr_cpu, meta.kv_page_ids,
            meta.kv_last_page_len_cpu, s.num_qo_heads, s.num_kv_heads, s.head_dim,
            meta.page_size, custom_mask=meta.custom_mask, causal=meta.custom_mask is None,
            sm_scale=s.scale, q_data_type=s.dtype, kv_data_type=s.dtype, non_blocking=True,
        )
        self._prefill_guard.after_plan()
        self._prefill_epoch.value += 1
        return FlashInferPlan(wrapper=self._prefill, slot_ids=meta.slot_ids,
                              epoch=self._prefill_epoch, planned_at=self._prefill_epoch.value)

    def forward(
        self, plan: FlashInferPlan, kv_cache: torch.Tensor, q: torch.Tensor,
        k: torch.Tensor | None, v: torch.Tensor | None, scale: float,
    ) -> torch.Tensor:
        """kv_cache [num_pages, 2, page_size, Hkv, D] (this layer's; written); q [T, Hq, D];
        k, v [T, Hkv, D], or None when already written at `kv_slots(plan)` -> [T, Hq, D]."""
        if plan.epoch.value != plan.planned_at:
            raise RuntimeError("FlashInferBackend: a newer plan replaced this one "
                               "(plans are valid for one forward)")
        if scale != self.shape.scale:
            raise ValueError(f"scale: {scale} differs from the planned {self.shape.scale}")
        if k is not None and v is not None:  # else the layer wrote them (`kv_slots`)
            kernels.store_kv(kv_cache, k, v, plan.slot_ids)
        return plan.wrapper.run(q.contiguous(), kv_cache)

    def kv_slots(self, plan: FlashInferPlan) -> torch.Tensor:
        """[T] int64: where layers may write this forward's K/V themselves (fused with rope);
        they then pass k = v = None to `forward`."""
        return plan.slot_ids
