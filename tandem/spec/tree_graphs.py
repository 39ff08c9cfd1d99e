"""Tree drafting (topk > 1) in CUDA graphs: every draft step of a round, the beam selection
and the choice of the tree to verify, on the device in one graph per batch bucket.

The eager tree (`propose._propose_tree`) keeps its bookkeeping on the host and writes each
step's draft KV into scratch slots of the request's own pages, attending through a mask: two
host reads and a fresh metadata build per step. Here the K frontier nodes of a request are K
*beams*, each drafting as a chain does, over pages of its own:

- **Lanes.** Beam b of request r owns a lane: L pages (`lane_pages_per_beam`) holding draft
  positions from the start of the block that contains num_cached onwards. Its page table is the
  request's table with the lane's pages in place of blocks f .. f+L-1 (f = num_cached //
  page_size), so the beam's keys are the request's prefix plus its own ancestors, in position
  order -- a plain sequence for the device-metadata decode kernel
  (`engine/attention/device_decode`), no mask. Before step 1 every lane gets a copy of block f
  (the prefix's partial page).
- **Steps.** Step m (1 .. num_steps-1) runs the K beams of every request at position
  num_cached + m - 1, writing into their lanes; the children (K x K candidates, scored by
  cumulative draft log-probability in float64, as the host does) are sorted stably and the best
  K become the next beams. A new beam inherits its parent's lane: the lane pages are copied
  from one lane set into the other (two sets, alternating), so the next step sees its
  ancestors' KV, its parent's write included.
- **Selection.** The best tree_size - 1 nodes (score, then level, then node index: the eager
  order) laid out by level, parents first, with parents as tree positions.

The request's own pages are never written while drafting (the target's verify and the
draft-extend write them, as for a chain). The verify forward is built from the tree on the
device (`DraftedTree`: mask and positions on the device) and queued before the host reads the
tree's shape, which acceptance and compaction need: the read overlaps the verify.

Lane pages are reserved for the engine's life (`LLMEngine(reserved_pages=...)`): buckets are
capped (`TREE_MAX_BATCH`), since trees pay at small batches and lanes cost pages.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from tandem.engine.attention.device_decode import DeviceDecodePlan
from tandem.engine.config import EngineConfig
from tandem.engine.cuda_graphs import padded_batch_size
from tandem.engine.d2h import HostCopy
from tandem.spec.config import SpecConfig
from tandem.spec.draft_runner import DRAFT_GROUP, DraftRunner
from tandem.spec.phases import DraftInput, VerifyInput
from tandem.spec.slices import load_draft_table

TREE_MAX_BATCH = 16  # the largest bucket tree drafting captures (larger batches: eager)


def graphs_expected(engine_cfg: EngineConfig, model: Any) -> bool:
    """Whether an engine of this config will capture CUDA graphs (LLMEngine's condition, known
    before the engine exists: its lane pages are reserved when the pool is made)."""
    return (engine_cfg.cuda_graphs and torch.device(engine_cfg.device).type == "cuda"
            and model.par.dp.size == 1 and engine_cfg.attention_backend != "torch")


def lane_pages_per_beam(spec: SpecConfig, page_size: int) -> int:
    """L: pages holding draft positions from floor(num_cached / page_size) * page_size up to
    num_cached + num_steps - 2 (the last step's write), whatever num_cached % page_size is."""
    return (page_size - 1 + spec.num_steps - 2) // page_size + 1


def tree_buckets(batch_sizes: Sequence[int]) -> tuple[int, ...]:
    sizes = tuple(b for b in sorted(set(batch_sizes)) if b <= TREE_MAX_BATCH)
    return sizes or tuple(sorted(set(batch_sizes)))[:1]


def lanes_needed(spec: SpecConfig, page_size: int, batch_sizes: Sequence[int]) -> int:
    """Pages to reserve for the tree graphs of these buckets: 2 lane sets x B x K x L."""
    if spec.topk == 1 or spec.num_steps < 2:
        return 0
    return 2 * max(tree_buckets(batch_sizes)) * spec.topk * lane_pages_per_beam(spec, page_size)


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class DraftedTree:
    """A tree drafted on the device whose shape the host has not read yet: enough to verify it
    (`SpecGraphRunner.verify` builds its ancestor mask and positions on the device), so the
    verify forward is queued before the host waits for anything; `resolve()` then reads the
    shape (by then long copied) into the `VerifyInput` the rest of the round uses. New
    tensors: the graph's buffers are reused by the next replay."""

    page_ids: tuple[tuple[int, ...], ...]
    num_cached: tuple[int, ...]  # [bs]
    tokens: torch.Tensor  # [bs, T] int64, root first
    parents: torch.Tensor  # [bs, T] int64 tree positions, -1 for the root (device)
    depths: torch.Tensor  # [bs, T] int64 (device)
    read: HostCopy  # parents, depths and the ancestor-closed flags, copying to the host

    @property
    def batch_size(self) -> int:
        return len(self.num_cached)

    @property
    def num_nodes(self) -> int:
        return self.tokens.shape[1]

    def resolve(self) -> VerifyInput:
        # SYNC: the tree's shape (queued after the drafting graph; the host needs it for
        # acceptance and compaction).
        parents, depths, ok = self.read.wait()
        if not bool(ok.all()):
            raise AssertionError("draft tree selection is not ancestor-closed")
        return VerifyInput(page_ids=self.page_ids, num_cached=self.num_cached,
                           tokens=self.tokens, parents=tuple(map(tuple, parents.tolist())),
                           depths=tuple(map(tuple, depths.tolist())))


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class _Captured:
    graph: torch.cuda.CUDAGraph | None  # None in eager mode (CPU tests): the body runs


class TreeDraftGraphs:
    """Owns the tree-drafting graphs (one per bucket), the lane pages it was given (ids only:
    the engine reserved them) and its static buffers: the round's page tables [B_max, P] int32
    and num_cached [B_max] int64, the seed's first level (ids, log-probs [B_max, K]), root
    tokens [B_max] and draft hidden [B_max, H]; outputs, the tree to verify: tokens, parents
    (tree positions, -1 for the root), depths [B_max, T] int64, and whether every chosen node's
    parent was chosen [B_max] bool.

    Invariants: only lane pages and the static buffers are written (never a request's page);
    callers' tensors are only read; the returned VerifyInput holds new tensors."""

    def __init__(self, draft: DraftRunner, spec: SpecConfig, batch_sizes: Sequence[int],
                 max_kv_len: int, lane_pages: Sequence[int], pool: Any = None) -> None:
        if spec.topk < 2 or spec.num_steps < 2:
            raise ValueError(f"spec: tree graphs need topk >= 2 and num_steps >= 2, got "
                             f"topk {spec.topk}, num_steps {spec.num_steps}")
        self.draft, self.spec, self.pool = draft, spec, pool
        self.batch_sizes = tree_buckets(batch_sizes)
        self.page_size = ps = draft.kv_pool.page_size
        max_bs, k = self.batch_sizes[-1], spec.topk
        self.lane_len = lane_len = lane_pages_per_beam(spec, ps)
        if len(lane_pages) != 2 * max_bs * k * lane_len:
            raise ValueError(f"lane_pages: {len(lane_pages)} pages, the tree graphs need "
                             f"{2 * max_bs * k * lane_len}")
        layer0 = draft.kv_pool.layer(DRAFT_GROUP, 0)
        self.device = dev = layer0.device
        self._lanes = torch.tensor(list(lane_pages), dtype=torch.int64, device=dev).view(
            2, max_bs, k, lane_len)  # [2 sets, B_max, K, L] page ids
        width = -(-max_kv_len // ps)
        self._table = torch.zeros(max_bs, width, dtype=torch.int32, device=dev)  # [B_max, P]
        self._base = torch.zeros(max_bs, dtype=torch.int64, device=dev)  # [B_max]
        self._root = torch.zeros(max_bs, dtype=torch.int64, device=dev)  # [B_max]
        self._ids0 = torch.zeros(max_bs, k, dtype=torch.int64, device=dev)  # [B_max, K]
        self._logp0 = torch.zeros(max_bs, k, dtype=torch.float32, device=dev)  # [B_max, K]
        head = draft.head
        self._hidden = torch.zeros(max_bs, head.cfg.hidden_size, dtype=head.fc.weight.dtype,
                                   device=dev)  # [B_max, H]
        t = spec.tree_size
        self._out_tokens = torch.zeros(max_bs, t, dtype=torch.int64, device=dev)  # [B_max, T]
        self._out_parents = torch.zeros(max_bs, t, dtype=torch.int64, device=dev)
        self._out_depths = torch.zeros(max_bs, t, dtype=torch.int64, device=dev)
        self._out_ok = torch.ones(max_bs, dtype=torch.bool, device=dev)  # [B_max]
        self._graphs: dict[int, _Captured] = {}

    # ---- capture --------------------------------------------------------------------------

    def capture(self, eager: bool = False) -> None:
        """Capture every bucket, largest first; eager=True captures nothing (CPU tests: each
        propose runs the body)."""
        for bs in reversed(self.batch_sizes):
            self._body(bs)  # once eagerly: Triton compiles, the pool sees the sizes
            if eager:
                self._graphs[bs] = _Captured(graph=None)
                continue
            torch.cuda.synchronize(self.device)  # SYNC: start-up only
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                self._body(bs)
            self._graphs[bs] = _Captured(graph=graph)
        if not eager:
            torch.cuda.synchronize(self.device)  # SYNC: start-up only

    def _copy_pages(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Every draft KV layer: page dst[i] <- page src[i] (int64 ids, same shape)."""
        dst, src = dst.reshape(-1), src.reshape(-1)
        for i in range(self.draft.head.cfg.num_layers):
            cache = self.draft.kv_pool.layer(DRAFT_GROUP, i)  # [pages, 2, ps, Hkv, D]
            cache.index_copy_(0, dst, cache.index_select(0, src))

    def _beam_tables(self, bs: int, f: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The two lane sets' beam page tables [bs*K, P+L] int32: each request's table with
        its beams' lane pages at blocks f .. f+L-1."""
        k, lane_len = self.spec.topk, self.lane_len
        table = torch.cat([self._table[:bs], self._table.new_zeros(bs, lane_len)], dim=1)
        table = table.repeat_interleave(k, dim=0)  # [bs*K, P+L]
        cols = f.repeat_interleave(k)[:, None] + torch.arange(lane_len, device=f.device)
        out = []
        for s in (0, 1):
            lanes = self._lanes[s, :bs].reshape(bs * k, lane_len).to(torch.int32)
            out.append(table.scatter(1, cols, lanes))
        return out[0], out[1]

    @torch.inference_mode()
    def _body(self, bs: int) -> None:
        """The whole tree drafting of a bucket from the static buffers (device work only)."""
        spec, draft, ps = self.spec, self.draft, self.page_size
        k, steps, lane_len, dev = spec.topk, spec.num_steps, self.lane_len, self.device
        nc = self._base[:bs]  # [B]
        f = nc // ps  # [B] block of the first lane page
        tables = self._beam_tables(bs, f)
        first = self._table[:bs].gather(1, f[:, None]).long()  # [B, 1] the partial prefix page
        self._copy_pages(self._lanes[0, :bs, :, 0], first.expand(bs, k))
        num = steps * k  # N nodes: level l's beam b is node (l-1)*K + b
        tok = torch.zeros(bs, num, dtype=torch.int64, device=dev)  # [B, N]
        score = torch.zeros(bs, num, dtype=torch.float64, device=dev)  # [B, N]
        parent = torch.full((bs, num), -1, dtype=torch.int64, device=dev)  # [B, N] node ids
        level = torch.arange(num, device=dev).div(k, rounding_mode="floor").add(1).expand(
            bs, num)  # [B, N]
        beam_tok, beam_score = self._ids0[:bs], self._logp0[:bs].double()  # [B, K] each
        tok[:, :k], score[:, :k] = beam_tok, beam_score
        hidden = self._hidden[:bs].repeat_interleave(k, dim=0)  # [B*K, H]
        lanes_flat = self._lanes[:, :bs].reshape(2, bs * k, lane_len)
        for m in range(1, steps):
            s = (m - 1) % 2
            pos = (nc + m - 1).repeat_interleave(k)  # [B*K] draft position of level m
            page = lanes_flat[s].gather(1, (pos // ps - f.repeat_interleave(k))[:, None])
            plan = DeviceDecodePlan(page_table=tables[s], kv_lens=pos + 1,
                                    slot_ids=page[:, 0] * ps + pos % ps,
                                    num_splits=draft.num_splits)
            out = draft.forward_planned(beam_tok.reshape(-1), hidden, pos, plan)  # [B*K, H]
            cids, clogp = draft.head.topk(out, k)  # [B*K, K] each
            cand = (beam_score[:, :, None] + clogp.view(bs, k, k).double()).reshape(bs, k * k)
            pick = torch.sort(cand, dim=1, descending=True, stable=True).indices[:, :k]
            from_beam = pick.div(k, rounding_mode="floor")  # [B, K] parent beam
            beam_tok = cids.view(bs, k * k).gather(1, pick)  # [B, K]
            beam_score = cand.gather(1, pick)
            cols = slice(m * k, (m + 1) * k)
            tok[:, cols], score[:, cols] = beam_tok, beam_score
            parent[:, cols] = from_beam + (m - 1) * k
            if m < steps - 1:  # the next step's beams inherit their parents' lanes
                src = self._lanes[s, :bs].gather(1, from_beam[:, :, None].expand(
                    bs, k, lane_len))  # [B, K, L]
                self._copy_pages(self._lanes[1 - s, :bs], src)
                hidden = out.view(bs, k, -1).gather(1, from_beam[:, :, None].expand(
                    bs, k, out.shape[-1])).reshape(bs * k, -1)
        self._select(bs, tok, score, parent, level)

    def _select(self, bs: int, tok: torch.Tensor, score: torch.Tensor, parent: torch.Tensor,
                level: torch.Tensor) -> None:
        """The best T-1 nodes by (score desc, level, node index), laid out by (level, that
        rank): tokens, parents as tree positions (root 0), depths -> the output buffers."""
        t = self.spec.tree_size
        by_level = torch.sort(level, dim=1, stable=True).indices  # [B, N]
        rank = torch.sort(score.gather(1, by_level), dim=1, descending=True, stable=True).indices
        chosen = by_level.gather(1, rank)[:, : t - 1]  # [B, T-1] node ids, best first
        chosen = chosen.gather(1, torch.sort(level.gather(1, chosen), dim=1,
                                             stable=True).indices)  # by level, then rank
        where = torch.zeros_like(parent)  # [B, N] tree position of each chosen node
        where.scatter_(1, chosen, torch.arange(1, t, device=chosen.device).expand(bs, t - 1))
        par = parent.gather(1, chosen)  # [B, T-1] node ids, -1 = the root
        par_pos = torch.where(par >= 0, where.gather(1, par.clamp(min=0)), 0)
        self._out_ok[:bs] = ((par < 0) | (par_pos > 0)).all(dim=1)
        self._out_tokens[:bs, 0] = self._root[:bs]
        self._out_tokens[:bs, 1:] = tok.gather(1, chosen)
        self._out_parents[:bs, 0] = -1
        self._out_parents[:bs, 1:] = par_pos
        self._out_depths[:bs, 0] = 0
        self._out_depths[:bs, 1:] = level.gather(1, chosen)

    # ---- replay -----------------------------------------------------------------------------

    def bucket(self, batch_size: int) -> int | None:
        return padded_batch_size(batch_size, self.batch_sizes)

    def can_propose(self, inp: DraftInput) -> bool:
        return self.bucket(inp.batch_size) is not None and inp.topk_ids.shape[1] == \
            self.spec.topk

    def propose(self, inp: DraftInput) -> VerifyInput:
        """The tree of `propose._propose_tree` on the same inputs (the same tokens, parents
        and depths up to the draft attention's rounding), drafted by the bucket's graph. One
        host read: the tree's shape."""
        return self.launch(inp).resolve()

    def launch(self, inp: DraftInput) -> DraftedTree:
        """Queue the bucket's drafting graph and the copy of the tree's shape to the host;
        never waits."""
        bs, rows = inp.batch_size, self.bucket(inp.batch_size)
        if rows is None or not self.can_propose(inp):
            raise ValueError(f"no tree drafting graph for a batch of {bs} (captured "
                             f"{self.batch_sizes}, topk {self.spec.topk})")
        load_draft_table(self._table, self._base, inp.page_ids, inp.num_cached, rows)
        self._root[:bs].copy_(inp.last_tokens, non_blocking=True)
        self._ids0[:bs].copy_(inp.topk_ids, non_blocking=True)
        self._logp0[:bs].copy_(inp.topk_logp, non_blocking=True)
        self._hidden[:bs].copy_(inp.hidden, non_blocking=True)
        captured = self._graphs[rows]
        if captured.graph is None:
            self._body(rows)
        else:
            captured.graph.replay()
        parents, depths = self._out_parents[:bs].clone(), self._out_depths[:bs].clone()
        return DraftedTree(page_ids=inp.page_ids, num_cached=inp.num_cached,
                           tokens=self._out_tokens[:bs].clone(), parents=parents,
                           depths=depths,
                           read=HostCopy.start((parents, depths, self._out_ok[:bs].clone())))

    def replay_only(self, rows: int) -> None:
        """Replay a bucket's graph on the inputs in its buffers (benchmarks: GPU time)."""
        self._graphs[rows].graph.replay()
