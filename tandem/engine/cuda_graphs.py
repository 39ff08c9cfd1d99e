"""CUDA graphs for decode steps.

A decode step of a small batch is a few hundred short kernels; launching them from Python
costs more than running them. `DecodeGraphRunner` captures the whole decode forward (embed ->
layers -> logits) once per padded batch size and replays it. A batch of n sequences runs in
the graph of the smallest captured size >= n; the caller pads the batch with
`pad_decode_slices`, whose rows attend to and write only the reserved scratch page 0.

Attention is planned before each replay into buffers that never move, so the captured kernels
read the new page tables: on CUDA by `DeviceDecodePlanner` (page tables copied on the device,
tandem's paged-decode kernel; TANDEM_DEVICE_DECODE=0: off), else by the backend's
`graph_decode_planner` (host work: FlashInfer's plan).

A graph's rows are tokens. With the device planner every token is a decode query over its
own page row, so a step that prefills short prompts (with or without decode rows beside
them) replays a graph too: of the smallest size >= its tokens, among the decode sizes and
`prefill_rows` (sizes past the decode ones; TANDEM_PREFILL_GRAPHS=0 turns them off). An
eager prefill step launches a few hundred kernels from Python: ~12 ms on SmolLM2 on an H100,
~2-3 ms replayed (docs/perf.md, session 18). Graphs past the decode sizes compute logits only
for the rows listed in a fixed index buffer (`max_logit_rows` of them: one per sequence at
most).

With DP attention every rank replays the graph of the same size (the engine agrees on it each
step) and the MLP's gather of the DP ranks' rows takes its counts from the size -- every TP
lead `bs` rows, the other TP ranks none (`ParallelContext.static_dp_counts`) -- instead of
exchanging them (a host read a graph cannot hold).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from tandem.engine.attention.device_decode import DeviceDecodePlanner
from tandem.engine.attention.metadata import SeqSlice, build_metadata
from tandem.engine.parallel import ParallelContext
from tandem.engine.runner import ForwardBatch, ForwardOutput, ModelRunner

DEFAULT_BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)
SCRATCH_PAGE = 0  # reserved by the PageAllocator; padding rows live here


def graph_batch_sizes(max_num_seqs: int) -> tuple[int, ...]:
    """The padded sizes to capture for a scheduler that runs at most max_num_seqs sequences."""
    sizes = tuple(b for b in DEFAULT_BATCH_SIZES if b < max_num_seqs)
    return sizes + (max_num_seqs,)


PREFILL_GRAPH_ROWS = 512  # the largest prefill graph (tokens)
PREFILL_GRAPH_KEYS = 1 << 18  # keys a graphed step's prompt rows may read, summed over rows


def prefill_graph_rows(decode_sizes: Sequence[int], max_tokens: int) -> tuple[int, ...]:
    """Graph sizes for prefill steps past the decode sizes: powers of two above the largest
    decode size up to min(PREFILL_GRAPH_ROWS, max_tokens); () with TANDEM_PREFILL_GRAPHS=0."""
    if os.environ.get("TANDEM_PREFILL_GRAPHS", "1") == "0":
        return ()
    top = max(decode_sizes)
    cap = min(PREFILL_GRAPH_ROWS, max_tokens)
    return tuple(1 << k for k in range(1, 16) if top < (1 << k) <= cap)


def padded_batch_size(num_seqs: int, sizes: Sequence[int]) -> int | None:
    """The smallest captured size that holds num_seqs rows, or None if none does."""
    fits = [b for b in sizes if b >= num_seqs]
    return min(fits) if fits else None


def pad_decode_slices(slices: Sequence[SeqSlice], batch_size: int) -> list[SeqSlice]:
    """`slices` plus padding rows up to batch_size: one token at position 0 whose K/V go to
    the scratch page and who attends only to itself. Their logits are never read."""
    if len(slices) > batch_size:
        raise ValueError(f"batch_size: {batch_size} < {len(slices)} sequences")
    pad = SeqSlice(page_ids=(SCRATCH_PAGE,), num_cached=0, num_new=1)
    return list(slices) + [pad] * (batch_size - len(slices))


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class _Captured:
    graph: torch.cuda.CUDAGraph | None  # None in eager mode (CPU tests): the body runs
    plan: Any  # the attention plan the graph was captured with (its fixed buffers)
    out: ForwardOutput | None  # logits [B or max_logit_rows, V] float32, hidden [B, H] and
    # the captured layers' streams, written by every replay


class DecodeGraphRunner:
    """Owns the decode CUDA graphs, their memory pool, static inputs (token ids [B_max] and
    positions [B_max], int64) and outputs (logits per graph), and the attention wrappers they
    replay (from `backend.graph_decode_planner`).

    Invariants: a caller's tensors are only read (copied into the static inputs); `run`
    returns a new tensor, never a view of a graph's output; padding rows touch only the
    scratch page; nothing is re-captured, so buffers keep their addresses for life."""

    def __init__(self, runner: ModelRunner, batch_sizes: Sequence[int],
                 max_pages_per_seq: int, par: ParallelContext | None = None,
                 device_metadata: bool | None = None, prefill_rows: Sequence[int] = (),
                 capture_layers: tuple[int, ...] = ()) -> None:
        """device_metadata: plan through `DeviceDecodePlanner` (None: on CUDA unless
        TANDEM_DEVICE_DECODE=0), else through the backend's `graph_decode_planner`.
        prefill_rows: sizes past `batch_sizes` for prefill steps (device metadata only).
        capture_layers: layers whose input streams every replay keeps (`run_forward`: an
        EAGLE-3 head's features)."""
        planner_factory = getattr(runner.backend, "graph_decode_planner", None)
        device = runner.kv_pool.layer(runner.kv_group, 0).device
        if device_metadata is None:
            device_metadata = (device.type == "cuda" and planner_factory is not None
                               and os.environ.get("TANDEM_DEVICE_DECODE", "1") != "0")
        if planner_factory is None and not device_metadata:
            raise ValueError(f"attention backend '{runner.backend.name}' cannot replay graphs")
        self.device_metadata = device_metadata
        self.capture_layers = tuple(capture_layers)
        self.runner = runner
        self.max_logit_rows = max(batch_sizes)  # the decode sizes: logits of every row
        self.page_size = runner.kv_pool.page_size
        extra = ([r for r in prefill_rows if r > self.max_logit_rows]  # not under DP attention
                 if device_metadata and (par is None or par.dp.size == 1) else [])
        self.decode_sizes = tuple(sorted(set(batch_sizes)))
        self.batch_sizes = tuple(sorted(set(batch_sizes) | set(extra)))  # rows of every graph
        max_bs = self.batch_sizes[-1]
        self._planner = (
            DeviceDecodePlanner(max_bs, max_pages_per_seq, self.page_size, device)
            if device_metadata else planner_factory(max_bs, max_bs * max_pages_per_seq))
        self._input_ids = torch.zeros(max_bs, dtype=torch.int64, device=device)  # [B_max]
        self._positions = torch.zeros(max_bs, dtype=torch.int64, device=device)  # [B_max]
        # rows whose logits prefill-sized graphs compute ([max_logit_rows], 0 = padding)
        self._logit_rows = torch.zeros(self.max_logit_rows, dtype=torch.int64, device=device)
        self._graphs: dict[int, _Captured] = {}
        self._pool: Any = None
        self._par = par if par is not None and par.dp.size > 1 else None  # DP attention only

    def _body(self, bs: int, plan: Any) -> ForwardOutput:
        """The captured forward -> logits [bs, V] of every row ([max_logit_rows, V] of the
        listed rows in graphs past the decode sizes), hidden [bs, H], captured streams."""
        counts = self._par.static_dp_counts(bs) if self._par is not None else None
        rows = self._logit_rows if bs > self.max_logit_rows else None  # None: every row
        return self.runner.forward_planned(self._input_ids[:bs], self._positions[:bs], plan,
                                           rows, self.capture_layers, dp_counts=counts)

    def capture(self, eager: bool = False) -> None:
        """Capture every batch size, largest first (smaller graphs reuse its pool memory).
        Each size runs once eagerly first: Triton compiles and tunes, cuBLAS picks kernels.
        eager=True captures nothing: every `run` runs the body, with the same buffers, padding
        and DP counts (how CPU tests check the graph path's logic)."""
        device = self._input_ids.device
        for bs in reversed(self.batch_sizes):
            meta = build_metadata(pad_decode_slices([], bs), self.page_size, device).attn
            plan = self._planner.plan(meta)
            self._body(bs, plan)
            if eager:
                self._graphs[bs] = _Captured(graph=None, plan=plan, out=None)
                continue
            torch.cuda.synchronize(device)  # SYNC: once per size, at start-up
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool):
                out = self._body(bs, plan)
            self._pool = graph.pool()
            self._graphs[bs] = _Captured(graph=graph, plan=plan, out=out)
        if not eager:
            torch.cuda.synchronize(device)  # SYNC: start-up only

    def rows_for(self, chunks: Sequence[tuple[int, int]], sampling: int, dp: bool) -> int:
        """The rows a step of chunks (tokens, cached tokens) -- `sampling` of them sample --
        needs in a graph; past the largest graph where none may take it: too many rows or
        sampled rows, or prompt chunks without the device planner, under DP attention (every
        rank then runs eagerly: ranks agree on the largest row count any needs) or reading
        more than PREFILL_GRAPH_KEYS keys (each prompt row reads its whole prefix: a long
        cached prefix is FlashInfer's prefill kernel's job)."""
        rows = sum(n for n, _ in chunks)
        keys = sum(n * cached + n * (n + 1) // 2 for n, cached in chunks if n > 1)
        if (keys and (dp or not self.device_metadata or keys > PREFILL_GRAPH_KEYS)
                or sampling > self.max_logit_rows):
            return self.batch_sizes[-1] + 1
        return rows

    def can_run(self, batch: ForwardBatch) -> bool:
        """Whether a captured graph takes this (padded) batch as it is: a decode batch, or
        with the device planner any causal one, of a captured row count, whose sampled rows
        fit the graph's logits."""
        attn = batch.attn
        return (attn.num_tokens in self._graphs and attn.custom_mask is None
                and (attn.is_decode or self.device_metadata)
                and batch.logits_indices.numel() <= self.max_logit_rows)

    def run(self, batch: ForwardBatch) -> torch.Tensor:
        """Replay the graph of this (padded) batch -> logits [n, V] float32 for
        batch.logits_indices."""
        return self._replay(batch)[1]

    def run_forward(self, batch: ForwardBatch, copy: bool = True) -> ForwardOutput:
        """Replay the graph of this (padded) batch -> its logits [n, V] float32 for
        batch.logits_indices and every row's hidden [T, H] and captured streams (a prefill
        step's draft features), as `ModelRunner.forward` returns them: copies, or (copy=False)
        the graph's own buffers, valid until its next replay."""
        out, logits = self._replay(batch)
        if not copy:
            return ForwardOutput(logits=logits, hidden=out.hidden, aux_hidden=out.aux_hidden)
        return ForwardOutput(logits=logits, hidden=out.hidden.clone(),
                             aux_hidden=tuple(a.clone() for a in out.aux_hidden))

    @property
    def positions(self) -> torch.Tensor:  # [R_max] int64: the rows' positions, every replay
        return self._positions

    def captured_plan(self, rows: int) -> Any:
        """The plan the graph of `rows` rows reads (its planner's buffers: each step's)."""
        return self._graphs[rows].plan

    def captured_outputs(self, rows: int) -> ForwardOutput | None:
        """The graph of `rows` rows' output buffers (None in eager mode)."""
        return self._graphs[rows].out

    def _replay(self, batch: ForwardBatch) -> tuple[ForwardOutput, torch.Tensor]:
        """(the graph's outputs after replaying `batch` -- valid until the next replay --,
        the batch's logits [n, V] as a new tensor)."""
        attn = batch.attn
        if not self.can_run(batch):
            raise ValueError(f"no graph for a {'decode' if attn.is_decode else 'non-decode'} "
                             f"batch of {attn.num_tokens} rows (captured {self.batch_sizes})")
        bs = attn.num_tokens
        captured = self._graphs[bs]
        self._input_ids[:bs].copy_(batch.input_ids, non_blocking=True)
        self._positions[:bs].copy_(batch.positions, non_blocking=True)
        plan = self._planner.plan(attn)  # rewrites the captured wrapper's buffers in place
        picked = bs > self.max_logit_rows  # the graph computes the listed rows' logits
        n = batch.logits_indices.numel()
        if picked:
            self._logit_rows.zero_()  # stale entries could point past this graph's rows
            self._logit_rows[:n].copy_(batch.logits_indices, non_blocking=True)
        if captured.graph is None:  # eager mode (CPU tests)
            out = self._body(bs, plan)
        else:
            assert getattr(plan, "wrapper", None) is getattr(captured.plan, "wrapper", None)
            assert plan.slot_ids.data_ptr() == captured.plan.slot_ids.data_ptr()
            captured.graph.replay()
            out = captured.out
        # a new tensor, never a view of the graph's output (clone; advanced indexing copies)
        return out, out.logits[:n].clone() if picked else out.logits[batch.logits_indices]

    def eager(self, batch: ForwardBatch) -> torch.Tensor:
        """`batch`'s forward as its replay runs it (the same planner, so the same kernels),
        eagerly -> logits [n, V] float32: what `run` of the batch must equal bit for bit."""
        plan = self._planner.plan(batch.attn)
        return self.runner.forward_planned(batch.input_ids, batch.positions, plan,
                                           batch.logits_indices).logits

    def replay_only(self, batch_size: int) -> None:
        """Replay without re-planning (benchmarks: pure GPU time of a step). The latest plan
        must be of this size (`run` a batch of it first): the planner's buffers are shared by
        every size, so a graph replayed over another size's plan reads a stale indptr tail --
        negative page counts, an illegal memory access (benchmarks/gpu_spec.py at batch 16)."""
        check_latest_plan(self._planner, batch_size, "DecodeGraphRunner.replay_only")
        self._graphs[batch_size].graph.replay()


def check_latest_plan(planner: Any, batch_size: int, where: str) -> None:
    """Raise unless `planner`'s latest plan was made for `batch_size` sequences (planners
    without that record -- test fakes -- pass)."""
    latest = getattr(planner, "latest_batch_size", batch_size)
    if latest != batch_size:
        raise ValueError(f"{where}: the latest plan is for {latest} sequences, the graph takes "
                         f"{batch_size}: plan a batch of this size first")
