"""CUDA graphs for the speculative round: the chain draft step and the verify forward.

A round of a small batch is a few hundred short kernels per forward; replaying them from a
graph removes the launch cost (on an H100: ~7.7 us a launch eager, ~1 us in a graph).

- **Drafting (chain).** One graph per batch bucket runs all k-1 draft steps of a round
  (`propose.chain_steps`, the function eager drafting runs): it reads the round's page table
  and num_cached (`buf.draft_table`, `buf.draft_base`, copied in once a round) and derives every
  step's positions, slots and key counts on the device, attending through the device-metadata
  decode kernel (`engine/attention/device_decode`). Step s reads draft token column s of
  `buf.tokens` [B, k+1] and writes its top-1 into column s+1. No host work between the steps: no
  planning, one launch a round (host work per step was ~0.3 ms on an H200, more than the
  step's GPU time).
- **Verify.** One graph per batch bucket over B * N tokens (N = the tree size), planned the
  same way through `backend.graph_prefill_planner` (causal for chains, the ancestor mask for
  trees). Its outputs (logits of every row, features) are views of the graph's static
  tensors, valid until the next verify replay; the round consumes them before that. Chains by
  default plan nothing on the host for verify and draft-extend (`device_metadata`;
  TANDEM_DEVICE_VERIFY=0 plans them): row j is a decode query at num_cached + j over its
  request's page row (`device_decode.device_rows_plan`, the drafting's kernel).
- **Draft-extend.** One graph per batch bucket over a fixed B * R tokens (R = 1 + the deepest
  acceptable path; `slices.extend_slices`): row j of request r is (feature of accepted node j,
  token of accepted node j+1 or the bonus) at draft position num_cached + j, causal. The rows
  past a_r + 1 are filler (never read, written past the next round's cache), so nothing about
  a -- known on the device only -- is baked in: the graph gathers its inputs from the
  acceptance kernel's device outputs (num accepted, path, bonus) and the verify tokens and
  features, runs the draft head, and takes each request's bonus row's top-k. Its metadata
  depends on num_cached alone, so it is built and planned while the verify graph runs.
- **Every k.** A runner holds the graphs of one k (`num_drafts`, default `num_steps`): an
  adaptive policy's rounds of k < num_steps replay the runner of their k (`graph_set.py`
  captures one per k). A chain of k drafts verifies N = k + 1 nodes and extends R = k + 1
  rows; k = 1 needs no draft step (d_1 is the seed's top-1), and k = 0 (a plain step) verifies
  the root alone and extends its one token: both 1-token forwards plan through the decode
  planner (the plain decode kernel, one int workspace for every bucket). All runners of an
  engine share one `GraphMemory`: the graph memory pool and one verify-logits buffer.

Padding rows (n requests in the bucket B >= n) live on the scratch page (`slices`). Tree draft
steps run in graphs of their own (`tree_graphs.py`). Layouts are built on the host and copied
without a stream sync (`h2d`): the host plans the next forward while the GPU runs this one.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from tandem.engine import kernels
from tandem.engine.attention.device_decode import device_rows_plan
from tandem.engine.cuda_graphs import (
    check_latest_plan,
    padded_batch_size,
)
from tandem.engine.d2h import HostCopy
from tandem.engine.h2d import build_layout
from tandem.engine.runner import ForwardOutput, ModelRunner
from tandem.engine.sampling import SamplingParams
from tandem.spec import kernels as spec_kernels
from tandem.spec.device_accept import DeviceAcceptance
from tandem.spec.config import SpecConfig
from tandem.spec.draft_runner import DraftRunner
from tandem.spec.graph_memory import (GraphMemory, RoundBuffers, check_fixed_buffers,
                                      graph_planner)
from tandem.spec.phases import DraftInput, ExtendOutput, VerifyInput
from tandem.spec.propose import chain_steps
from tandem.spec.tree_graphs import DraftedTree
from tandem.spec.slices import (
    device_tree_layout,
    extend_rows,
    extend_slices,
    load_draft_table,
    pad_fixed_slices,
    verify_layout,
)


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class _Captured:
    graph: torch.cuda.CUDAGraph | None  # None in eager mode (CPU tests): the body runs instead
    plan: Any  # the plan the graph was captured with (its fixed buffers)
    out: Any  # static outputs: ForwardOutput (verify), a tuple (extend), None (draft steps)


class SpecGraphRunner:
    """Owns the speculative CUDA graphs of one k (`num_drafts`), their attention planners and
    every static buffer they read or write (`buf`, `graph_memory.RoundBuffers`: draft tokens,
    the seed's hidden, page tables and num_cached, verify ids, acceptance's outputs). The pool
    and the verify logits are the engine's `GraphMemory`.

    Invariants: callers' tensors are only read (copied in); a returned VerifyInput holds new
    tensors; verify outputs are views valid until the next `verify` (of any runner sharing
    the memory); nothing is re-captured."""

    def __init__(self, runner: ModelRunner, draft: DraftRunner, spec: SpecConfig,
                 batch_sizes: Sequence[int], max_kv_len: int,
                 capture_layers: tuple[int, ...], num_drafts: int | None = None,
                 memory: GraphMemory | None = None, device_metadata: bool | None = None) -> None:
        """num_drafts: the k this runner's rounds draft (None: spec.num_steps; another k only
        as a chain). memory: the engine's shared `GraphMemory` (None: allocate one).
        device_metadata: chain verify and draft-extend attend through the device-decode kernel
        (`device_decode.device_rows_plan`: no host planning; None: yes unless
        TANDEM_DEVICE_VERIFY=0)."""
        backend = runner.backend
        if not hasattr(backend, "graph_prefill_planner"):  # verify and extend plan through it
            raise ValueError(f"attention backend '{backend.name}' cannot replay graphs")
        k = spec.num_steps if num_drafts is None else num_drafts
        if not 0 <= k <= spec.num_steps:
            raise ValueError(f"num_drafts: must be in [0, {spec.num_steps}], got {k}")
        self.runner, self.draft, self.spec, self.num_drafts = runner, draft, spec, k
        self.capture_layers, self.max_kv_len = capture_layers, max_kv_len
        self.batch_sizes = tuple(sorted(set(batch_sizes)))
        self.page_size = runner.kv_pool.page_size
        full = k == spec.num_steps
        self.num_nodes = spec.tree_size if full else k + 1  # N: verify tokens per request
        self.masked = full and spec.topk > 1  # tree configs verify through the ancestor mask
        self.chain_drafting = not self.masked and k > 1  # k = 1: d_1 is the seed's top-1
        if device_metadata is None:
            device_metadata = os.environ.get("TANDEM_DEVICE_VERIFY", "1") != "0"
        self.device_metadata = device_metadata and not self.masked
        max_bs = self.batch_sizes[-1]
        pages = max_bs * -(-max_kv_len // self.page_size)
        device = runner.kv_pool.layer(runner.kv_group, 0).device
        self.device = device
        if memory is None:
            memory = GraphMemory.allocate(runner, max_bs * self.num_nodes, device)
        if memory.logits.shape[0] < max_bs * self.num_nodes:
            raise ValueError(f"memory: {memory.logits.shape[0]} logits rows, the verify graphs "
                             f"need {max_bs} x {self.num_nodes}")
        self.memory = memory
        # Draft-extend: R rows per request, causal, over the draft's KV group.
        self.extend_rows = extend_rows(k, self.num_nodes)
        self._verify_planner = self._extend_planner = None  # device metadata: nothing to plan
        if not self.device_metadata:
            self._verify_planner = graph_planner(backend, max_bs, self.num_nodes, pages,
                                                 max_kv_len, self.masked)
            self._extend_planner = graph_planner(backend, max_bs, self.extend_rows, pages,
                                                 max_kv_len, False)
        self.buf = RoundBuffers.allocate(
            max_bs=max_bs, num_drafts=k, num_nodes=self.num_nodes, extend_rows=self.extend_rows,
            head=draft.head, table_width=-(-max_kv_len // self.page_size), device=device)
        self._ver_loaded: VerifyInput | None = None  # the verify `buf.ver_*` was loaded for
        self._acc_loaded: VerifyInput | None = None  # the verify `accept` wrote `buf.acc_*` for
        self._draft_graphs: dict[int, _Captured] = {}
        self.drafts_launched = 0  # writes of `buf.tokens` so far (spec/ahead.py: still ours?)
        self._verify_graphs: dict[int, _Captured] = {}
        self._extend_graphs: dict[int, _Captured] = {}

    # ---- capture ------------------------------------------------------------------------------

    def capture(self, eager: bool = False) -> None:
        """Capture every bucket, largest first (smaller graphs reuse its pool). Each body runs
        once eagerly first (Triton compiles, cuBLAS picks kernels). eager=True captures
        nothing: every replay runs its body instead, with the same buffers, padding, planning
        and step index (how CPU tests check this class against the eager round)."""
        for bs in reversed(self.batch_sizes):
            self._verify_graphs[bs] = self._capture(bs, self._verify_plan_padding(bs),
                                                    self._verify_body, eager)
            if self.chain_drafting:
                self._draft_graphs[bs] = self._capture(bs, None, self._draft_body, eager)
            self._extend_graphs[bs] = self._capture(bs, self._extend_plan_padding(bs),
                                                    self._extend_body, eager)
        if not eager:
            torch.cuda.synchronize(self.device)  # SYNC: start-up only

    def _capture(self, bs: int, plan: Any, body, eager: bool) -> _Captured:
        out = body(bs, plan)
        if eager:
            return _Captured(graph=None, plan=plan, out=None)
        torch.cuda.synchronize(self.device)  # SYNC: once per graph, at start-up
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.memory.pool):
            out = body(bs, plan)
        return _Captured(graph=graph, plan=plan, out=out)

    def _replay(self, captured: _Captured, body, bs: int, plan: Any) -> Any:
        if captured.graph is None:  # eager mode
            return body(bs, plan)
        check_fixed_buffers(plan, captured.plan)
        captured.graph.replay()
        return captured.out

    def _verify_plan_padding(self, bs: int) -> Any:
        if self.device_metadata:
            return None
        slices = pad_fixed_slices([], bs, self.num_nodes, self.page_size, self.masked)
        return self._verify_planner.plan(build_layout(slices, self.page_size,
                                                      self.device).attn)

    def _extend_plan_padding(self, bs: int) -> Any:
        if self.device_metadata:
            return None
        slices = pad_fixed_slices([], bs, self.extend_rows, self.page_size, False)
        return self._extend_planner.plan(build_layout(slices, self.page_size,
                                                      self.device).attn)

    @torch.inference_mode()
    def _draft_body(self, bs: int, plan: Any) -> None:
        """Chain draft steps 1..k-1 over the bucket, from the static buffers alone."""
        del plan  # nothing planned: the steps read `buf.draft_table` / `buf.draft_base`
        buf = self.buf
        chain_steps(self.draft, buf.tokens[:bs], buf.hidden[:bs], buf.draft_table[:bs],
                    buf.draft_base[:bs])

    @torch.inference_mode()
    def _verify_body(self, bs: int, plan: Any) -> ForwardOutput:
        n, positions = bs * self.num_nodes, self.buf.verify_positions[: bs * self.num_nodes]
        if plan is None:  # device metadata: positions and slots from the table and num_cached
            plan, positions = device_rows_plan(self.buf.ver_table[:bs], self.buf.ver_base[:bs],
                                               self.num_nodes, self.page_size,
                                               self.draft.num_splits)
        out = self.runner.forward_planned(self.buf.verify_ids[:n], positions, plan, None,
                                          self.capture_layers)
        logits = self.memory.logits[:n]  # [B * N, V]: the shared buffer, not a graph output
        logits.copy_(out.logits)
        return ForwardOutput(logits=logits, hidden=out.hidden, aux_hidden=out.aux_hidden)

    @torch.inference_mode()
    def _extend_body(self, bs: int, plan: Any) -> tuple[torch.Tensor, torch.Tensor,
                                                         torch.Tensor]:
        """The fixed-shape draft-extend over the bucket, inputs gathered on the device: row j
        of request r takes the feature of node_j (root, then accepted nodes) and the token of
        accepted node j+1 -- the bonus at j = a_r and past it (filler). Returns the static
        (hidden [B, H], top-k ids [B, K], top-k log-probs [B, K]) of each bonus row."""
        r = self.extend_rows
        toks, rows, last_rows = spec_kernels.extend_rows(
            self.buf.ver_tokens[:bs], self.buf.acc_path[:bs], self.buf.acc_num[:bs],
            self.buf.acc_bonus[:bs], r)  # [B*R], [B*R], [B]
        feats = self.buf.ver_features.index_select(0, rows)  # [B*R, F]
        positions = self.buf.ext_positions[: bs * r]
        if plan is None:  # device metadata, as the verify's
            plan, positions = device_rows_plan(self.buf.ver_table[:bs], self.buf.ver_base[:bs], r,
                                               self.page_size, self.draft.num_splits)
        hidden = self.draft.forward_planned(toks, feats, positions, plan)  # [B*R, H]
        last = hidden.index_select(0, last_rows)  # [B, H] each bonus row
        ids, logp = self.draft.head.topk(last, self.spec.topk)
        return last, ids, logp

    # ---- replay -------------------------------------------------------------------------------

    def bucket(self, batch_size: int) -> int | None:
        return padded_batch_size(batch_size, self.batch_sizes)

    def can_propose(self, inp: DraftInput) -> bool:
        """A chain of k >= 1 drafts (k = 0 proposes nothing: `propose.root_only`)."""
        return (not self.masked and self.num_drafts >= 1
                and self.bucket(inp.batch_size) is not None)

    def can_verify(self, verify: VerifyInput | DraftedTree) -> bool:
        chain = isinstance(verify, VerifyInput) and verify.is_chain
        return (verify.num_nodes == self.num_nodes and self.bucket(verify.batch_size) is not None
                and (self.masked or chain))

    def propose(self, inp: DraftInput) -> VerifyInput:
        """Chain drafting through the drafting graph: the same tokens as
        `propose._propose_chain` on the same inputs."""
        bs, k = inp.batch_size, self.num_drafts
        rows = self.bucket(bs)
        if not self.can_propose(inp) or rows is None:
            raise ValueError(f"no drafting graph for a batch of {bs} (captured "
                             f"{self.batch_sizes}, {k} chain drafts: {not self.masked})")
        self.buf.tokens[:bs, 0].copy_(inp.last_tokens, non_blocking=True)
        self.buf.tokens[:bs, 1].copy_(inp.topk_ids[:, 0], non_blocking=True)
        self.drafts_launched += 1
        if self.chain_drafting:  # draft steps 1..k-1 (k = 1: d_1 alone, nothing to replay)
            load_draft_table(self.buf.draft_table, self.buf.draft_base, inp.page_ids,
                             inp.num_cached, rows)
            self.buf.hidden[:bs].copy_(inp.hidden, non_blocking=True)
            self._replay(self._draft_graphs[rows], self._draft_body, rows, None)
        return self.drafted(inp)

    def drafted(self, inp: DraftInput) -> VerifyInput:
        """The chain the latest drafting of these rows left in `buf.tokens`, as a VerifyInput of
        `inp`: `propose`'s, or the one `draft_ahead` queued for `inp` (spec/ahead.py checks that
        `inp` is the round it drafted)."""
        bs, n = inp.batch_size, self.num_drafts + 1
        return VerifyInput(
            page_ids=inp.page_ids, num_cached=inp.num_cached,
            tokens=self.buf.tokens[:bs].clone(),  # a new tensor: the buffer is reused next round
            parents=(tuple(range(-1, n - 1)),) * bs, depths=(tuple(range(n)),) * bs,
        )

    def draft_ahead(self, verify: VerifyInput, num_accepted: torch.Tensor,
                    ext: ExtendOutput) -> bool:
        """Queue the NEXT round's chain drafting right behind this round's draft-extend, before
        the round's host read: the drafting graph over the same rows, from the inputs `propose`
        would copy in next round -- root the bonus, d_1 the extend's top-1, its hidden, and
        num_cached advanced by a + 1 on the device (num_accepted [bs] int32), which the host
        does not know yet. The table is this round's page lists: each must cover every slot the
        next round may write (num_cached + k + 1 + slots_per_round), else nothing is queued
        (False) -- the graph would write through entries it was not given."""
        bs, rows = verify.batch_size, self.bucket(verify.batch_size)
        need = self.num_drafts + 1 + self.spec.slots_per_round
        if not self.chain_drafting or rows is None or any(
                len(p) > self.buf.draft_table.shape[1] or len(p) * self.page_size < nc + need
                for p, nc in zip(verify.page_ids, verify.num_cached)):
            return False
        if self._ver_loaded is verify:  # the verify's table is on the device already
            self.buf.draft_table[:rows].copy_(self.buf.ver_table[:rows])
            self.buf.draft_base[:rows].copy_(self.buf.ver_base[:rows])
        else:
            load_draft_table(self.buf.draft_table, self.buf.draft_base, verify.page_ids,
                             verify.num_cached, rows)
        self.buf.draft_base[:bs].add_(num_accepted).add_(1)  # [bs] the next round's num_cached
        self.buf.tokens[:bs, 0].copy_(ext.last_tokens)
        self.buf.tokens[:bs, 1].copy_(ext.topk_ids[:, 0])
        self.buf.hidden[:bs].copy_(ext.hidden)
        self._replay(self._draft_graphs[rows], self._draft_body, rows, None)
        self.drafts_launched += 1
        return True

    def verify(self, verify: VerifyInput | DraftedTree) -> ForwardOutput:
        """The verify forward through its graph -> logits [bs * N, V] float32 and features,
        request-major, as `SpecEngine._verify_forward` returns them. A `DraftedTree` (shape on
        the device only) is verified without a host read: mask and positions built there."""
        bs, n = verify.batch_size, self.num_nodes
        rows = self.bucket(bs)
        if not self.can_verify(verify) or rows is None:
            raise ValueError(f"no verify graph for {bs} x {verify.num_nodes} nodes (captured "
                             f"{self.batch_sizes} x {n})")
        plan = None
        if self.device_metadata:  # the table and num_cached only (a chain: no tree here)
            self._load_verify_table(verify, rows)
        else:
            if isinstance(verify, DraftedTree):
                layout = device_tree_layout(verify.page_ids, verify.num_cached, verify.parents,
                                            verify.depths, self.page_size, self.device, rows=rows)
            else:
                layout = verify_layout(verify, self.page_size, self.device, masked=self.masked,
                                       rows=rows)
            plan = self._verify_planner.plan(layout.attn)
            self.buf.verify_positions[: rows * n].copy_(layout.positions, non_blocking=True)
        self.buf.verify_ids[: bs * n].copy_(verify.tokens.reshape(-1), non_blocking=True)
        return self._replay_verify(bs, rows, plan)

    def verify_ahead(self, bs: int) -> ForwardOutput | None:
        """Queue the NEXT round's verify behind the drafting `draft_ahead` just queued for
        these `bs` rows: its tokens, page table and num_cached (the device's) are the
        drafting's. None where verify plans on the host. Outputs as `verify`'s."""
        rows = self.bucket(bs)
        if not self.device_metadata or self.masked or rows is None:
            return None
        self.buf.ver_table[:rows].copy_(self.buf.draft_table[:rows])
        self.buf.ver_base[:rows].copy_(self.buf.draft_base[:rows])  # [rows] nc + a + 1 per row
        self._ver_loaded = None  # the table is the device's guess, not a VerifyInput's
        self.buf.verify_ids[: bs * self.num_nodes].copy_(self.buf.tokens[:bs].reshape(-1))
        return self._replay_verify(bs, rows, None)

    def adopt_verify_table(self, verify: VerifyInput) -> None:
        """`verify_ahead` ran `verify`, on the pages the drafting read: its table is loaded."""
        self._ver_loaded = verify

    def _replay_verify(self, bs: int, rows: int, plan: Any) -> ForwardOutput:
        n = self.num_nodes
        self.buf.verify_ids[bs * n : rows * n].zero_()  # padding rows: any valid token
        out = self._replay(self._verify_graphs[rows], self._verify_body, rows, plan)
        self.memory.verifies.n += 1
        m = bs * n
        return ForwardOutput(logits=out.logits[:m], hidden=out.hidden[:m],
                             aux_hidden=tuple(a[:m] for a in out.aux_hidden))

    def accept(self, verify: VerifyInput, logits: torch.Tensor,
               params: Sequence[SamplingParams]) -> DeviceAcceptance | None:
        """Greedy acceptance of a chain written straight into the draft-extend graph's inputs
        (the argmax, then one kernel: `extend` of this verify copies none of them in), its host
        row copy queued; logits [bs * N, V] float32, every row greedy. None where it does not
        apply (a tree, no bucket, a row sampling or asking for logprobs): `device_accept`."""
        rows, n = self.bucket(verify.batch_size), self.num_nodes
        if self.masked or rows is None or not self.can_extend(verify) or any(
                not p.greedy or p.logprobs for p in params):
            return None
        _, target = kernels.row_max(logits)  # [bs * N] int64
        host = spec_kernels.accept_chain_into(verify.tokens, target, self.buf.acc_num[:rows],
                                              self.buf.acc_path[:rows], self.buf.acc_bonus[:rows],
                                              self.buf.ver_tokens[:rows])  # [bs, 2 + 2(N-1)]
        self._acc_loaded = verify
        bs = verify.batch_size
        buf = self.buf
        return DeviceAcceptance(num_accepted=buf.acc_num[:bs], path=buf.acc_path[:bs, :n - 1],
                                bonus=buf.acc_bonus[:bs], depth=n - 1,
                                copy=HostCopy.start((host,)))

    def can_extend(self, verify: VerifyInput) -> bool:
        return (verify.num_nodes == self.num_nodes and self.bucket(verify.batch_size) is not None
                and max(max(d) for d in verify.depths) <= self.extend_rows - 1)

    def extend(self, verify: VerifyInput, num_accepted: torch.Tensor, path: torch.Tensor,
               bonus: torch.Tensor, features: torch.Tensor) -> ExtendOutput:
        """Draft-extend through its graph, from acceptance's device outputs: num_accepted [bs]
        int32, path [bs, D] int32 (-1 padded, D <= R - 1), bonus [bs] int64; features
        [bs * N, F] the verify's target features, request-major. Queues work only: nothing
        here waits for the GPU, so it is meant to be called before the round's host read."""
        bs, n, r = verify.batch_size, self.num_nodes, self.extend_rows
        rows = self.bucket(bs)
        if not self.can_extend(verify) or rows is None:
            raise ValueError(f"no draft-extend graph for {bs} x {verify.num_nodes} nodes "
                             f"(captured {self.batch_sizes} x {n}, {r} rows)")
        d = path.shape[1]
        if d > r - 1 or tuple(num_accepted.shape) != (bs,) or tuple(bonus.shape) != (bs,) \
                or tuple(features.shape[:1]) != (bs * n,):
            raise ValueError(f"extend: path {tuple(path.shape)}, num {tuple(num_accepted.shape)}"
                             f", bonus {tuple(bonus.shape)}, features {tuple(features.shape)} "
                             f"for {bs} requests x {n} nodes, <= {r - 1} deep")
        captured, plan = self._extend_graphs[rows], None
        if self.device_metadata:  # the verify's table and num_cached (loaded by `verify`)
            if self._ver_loaded is not verify:
                self._load_verify_table(verify, rows)
        else:
            slices = extend_slices(verify.page_ids, verify.num_cached, r)
            if rows > bs:
                slices = pad_fixed_slices(slices, rows, r, self.page_size, False)
            layout = build_layout(slices, self.page_size, self.device)
            plan = self._extend_planner.plan(layout.attn)  # rewrites the captured buffers
            self.buf.ext_positions[: rows * r].copy_(layout.positions, non_blocking=True)
        loaded, self._acc_loaded = self._acc_loaded, None
        if loaded is not verify or num_accepted.data_ptr() != self.buf.acc_num.data_ptr():
            self.buf.acc_num[:bs].copy_(num_accepted, non_blocking=True)
            self.buf.acc_path[:bs, :d].copy_(path, non_blocking=True)
            if d < self.buf.acc_path.shape[1]:
                self.buf.acc_path[:bs, d:].fill_(-1)
            self.buf.acc_bonus[:bs].copy_(bonus, non_blocking=True)
            self.buf.ver_tokens[:bs].copy_(verify.tokens, non_blocking=True)
            if rows > bs:  # padding requests: accept nothing (rows read node 0 of request r)
                self.buf.acc_num[bs:rows].zero_()
                self.buf.acc_path[bs:rows].fill_(-1)
        self.buf.ver_features[: bs * n].copy_(features, non_blocking=True)
        out = self._replay(captured, self._extend_body, rows, plan)
        last, ids, logp = out
        return ExtendOutput(hidden=last[:bs].clone(), topk_ids=ids[:bs].clone(),
                            topk_logp=logp[:bs].clone(), last_tokens=bonus.clone())

    def _load_verify_table(self, verify: VerifyInput, rows: int) -> None:
        load_draft_table(self.buf.ver_table, self.buf.ver_base, verify.page_ids,
                         verify.num_cached, rows)
        self._ver_loaded = verify

    # ---- benchmarks ---------------------------------------------------------------------------

    def replay_phase_only(self, which: str, rows: int) -> None:
        """Replay this bucket's "propose" (k-1 draft steps), "verify" or "extend" graph on
        the inputs already in its buffers, nothing planned (pure GPU time). Planned on the
        host, that graph's latest plan must be of this bucket (a round of it just ran)."""
        planner = {"verify": self._verify_planner, "extend": self._extend_planner}.get(which)
        if planner is not None:
            check_latest_plan(planner, rows, f"replay_phase_only({which!r})")
        graphs = {"propose": self._draft_graphs, "verify": self._verify_graphs,
                  "extend": self._extend_graphs}[which]
        graphs[rows].graph.replay()
