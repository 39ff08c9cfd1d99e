"""What the speculative CUDA graphs of one engine share (`GraphMemory`), the buckets they are
captured for, and their attention planners (spec/cuda_graphs.py holds the graphs)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from tandem.engine.runner import ModelRunner


def spec_graph_batch_sizes(decode_sizes: Sequence[int], max_batch_size: int | None = None
                           ) -> tuple[int, ...]:
    """The buckets to capture: the decode graphs' sizes, optionally capped (verify graphs
    hold logits for B * N rows each)."""
    sizes = sorted(set(decode_sizes))
    if max_batch_size is not None:
        sizes = [b for b in sizes if b <= max_batch_size] or sizes[:1]
    return tuple(sizes)


@dataclass(slots=True)
class VerifyCount:
    n: int = 0


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class GraphMemory:
    """What the speculative graphs of one engine share, made by its first runner (k =
    num_steps, the widest verify) and lent to the runners of other k. Graphs never run
    concurrently (one stream, one round at a time), so their intermediates may reuse each
    other's memory: one pool. Every verify graph copies its logits into `logits`, one buffer
    instead of a static output per (k, bucket) -- on the 8B shape with 11 buckets to 128,
    0.33 GB instead of 1.1 GB for k = 4 alone and 3.2 GB for every k in 0..4. Its rows are
    valid until the next verify replay of any runner (a round reads them before that)."""

    pool: Any  # torch.cuda graph pool handle; None off CUDA (eager-mode runners, CPU tests)
    logits: torch.Tensor  # [B_max * N_max, V] float32 verify logits, request-major
    # verify replays so far, every runner's: a verify queued ahead (spec/ahead.py) is still
    # the latest -- its logits still in `logits` -- while this has not moved
    verifies: VerifyCount = field(default_factory=lambda: VerifyCount())

    @staticmethod
    def allocate(runner: ModelRunner, max_rows: int, device: torch.device) -> GraphMemory:
        pool = torch.cuda.graph_pool_handle() if device.type == "cuda" else None
        vocab = runner.model.cfg.vocab_size
        return GraphMemory(pool=pool, logits=torch.zeros(max_rows, vocab, dtype=torch.float32,
                                                         device=device))


def graph_planner(backend: Any, max_bs: int, tokens_per_seq: int, pages: int,
                  max_kv_len: int, masked: bool) -> Any:
    """Fixed-buffer planner of a graph forward with `tokens_per_seq` new tokens per request: a
    1-token causal forward (k = 0 verify and extend) is a decode batch, planned through the
    decode wrappers -- the plain decode kernel, one int workspace for every bucket."""
    if tokens_per_seq == 1 and not masked:
        return backend.graph_decode_planner(max_bs, pages)
    return backend.graph_prefill_planner(max_bs, tokens_per_seq, pages, max_kv_len,
                                         custom_mask=masked)


def check_fixed_buffers(plan: Any, captured: Any) -> None:
    """A new plan must have rewritten the captured wrapper's buffers, not made new ones, and
    be its planner's latest (a later plan of another bucket rewrote the shared buffers)."""
    if hasattr(plan, "wrapper"):
        if plan.wrapper is not captured.wrapper or \
                plan.slot_ids.data_ptr() != captured.slot_ids.data_ptr():
            raise RuntimeError("spec graph replay: the plan is not the captured wrapper's")
        if plan.epoch.value != plan.planned_at:
            raise RuntimeError("spec graph replay: a newer plan replaced this one")


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class RoundBuffers:
    """The static tensors one runner's graphs (spec/cuda_graphs.py) read and write; the runner
    owns them and is the only writer. Rows of requests past the batch (bucket padding) hold
    zeros / -1: the scratch page, position 0, nothing accepted."""

    tokens: torch.Tensor  # [B_max, k+1] int64 draft tokens: root, then drafts
    hidden: torch.Tensor  # [B_max, H] the seed's draft hidden
    draft_table: torch.Tensor  # [B_max, P_max] int32 chain drafting's page table
    draft_base: torch.Tensor  # [B_max] int64 and num_cached
    ver_table: torch.Tensor  # [B_max, P_max] int32 the verify's own (device metadata)
    ver_base: torch.Tensor  # [B_max] int64
    verify_ids: torch.Tensor  # [B_max * N] int64 verify token ids
    verify_positions: torch.Tensor  # [B_max * N] int64 (planned on the host)
    acc_num: torch.Tensor  # [B_max] int32 draft-extend inputs: what acceptance left,
    acc_path: torch.Tensor  # [B_max, max(R-1, 1)] int32 accepted nodes, -1 = none
    acc_bonus: torch.Tensor  # [B_max] int64
    ver_tokens: torch.Tensor  # [B_max, N] int64 the verify's tokens
    ver_features: torch.Tensor  # [B_max * N, F] and its target features
    ext_positions: torch.Tensor  # [B_max * R] int64 (planned on the host)

    @staticmethod
    def allocate(*, max_bs: int, num_drafts: int, num_nodes: int, extend_rows: int, head: Any,
                 table_width: int, device: torch.device) -> RoundBuffers:
        def zeros(*shape: int, dtype: torch.dtype = torch.int64) -> torch.Tensor:
            return torch.zeros(*shape, dtype=dtype, device=device)

        cfg, dtype = head.cfg, head.fc.weight.dtype
        feat = cfg.hidden_size if cfg.kind == "eagle" else cfg.feature_size
        n = max_bs * num_nodes
        return RoundBuffers(
            tokens=zeros(max_bs, num_drafts + 1), hidden=zeros(max_bs, cfg.hidden_size,
                                                               dtype=dtype),
            draft_table=zeros(max_bs, table_width, dtype=torch.int32), draft_base=zeros(max_bs),
            ver_table=zeros(max_bs, table_width, dtype=torch.int32), ver_base=zeros(max_bs),
            verify_ids=zeros(n), verify_positions=zeros(n),
            acc_num=zeros(max_bs, dtype=torch.int32),
            acc_path=torch.full((max_bs, max(extend_rows - 1, 1)), -1, dtype=torch.int32,
                                device=device),
            acc_bonus=zeros(max_bs), ver_tokens=zeros(max_bs, num_nodes),
            ver_features=zeros(n, feat, dtype=dtype), ext_positions=zeros(max_bs * extend_rows),
        )
