"""Drafting: DraftInput -> VerifyInput, as a chain (topk = 1) or an EAGLE-2 style tree.

Level 1 of the tree is the seed's top-k. Draft forward m (m = 1 .. num_steps - 1) runs the K
frontier nodes of level m: node b consumes (its parent's draft hidden, its token) at draft
position num_cached + m - 1, writes its KV into scratch slot num_cached + (m-1)*K + b, and
attends to the prefix plus the slots of its own ancestors -- nothing else (docs/architecture.md,
"Per-step slots"). Its top-k children (K*K per request) are scored by cumulative draft
log-probability and the best K become level m+1. Finally the best `tree_size - 1` nodes (an
ancestor-closed set: a child never scores above its parent) form the tree to verify, parents
first.

For a chain (K = 1) the masks are plain causal ones and no tree bookkeeping is needed: its
steps read one page table per round and derive each step's positions, slots and key counts on
the device (`chain_steps`, `engine/attention/device_decode`), so a CUDA graph runs them all.
Tree steps rebuild their metadata from scratch for every draft step (the eager reference; in
CUDA graphs, trees draft as K beams over lane pages instead: `tree_graphs.py`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tandem.engine import h2d
from tandem.engine.attention.device_decode import device_decode_plan
from tandem.engine.attention.metadata import SeqSlice, build_metadata
from tandem.spec.config import SpecConfig
from tandem.spec.draft_runner import DraftRunner
from tandem.spec.phases import DraftInput, VerifyInput
from tandem.spec.slices import chain_draft_table


def propose(draft: DraftRunner, inp: DraftInput, spec: SpecConfig,
            num_drafts: int | None = None) -> VerifyInput:
    """num_drafts: a chain's k for this round, 0 .. spec.num_steps (None: spec.num_steps;
    0: the root alone, a plain step). A tree always drafts spec.num_steps levels."""
    k = spec.num_steps if num_drafts is None else num_drafts
    if k == 0:
        return root_only(inp)
    if spec.topk == 1:
        return _propose_chain(draft, inp, k)
    if k != spec.num_steps:
        raise ValueError(f"num_drafts: a tree drafts num_steps = {spec.num_steps}, got {k}")
    return _propose_tree(draft, inp, spec)


def root_only(inp: DraftInput) -> VerifyInput:
    """k = 0: the verify 'tree' is the root alone -- its forward is a plain decode step, and
    acceptance emits the target's own token for it (no draft to accept)."""
    bs = inp.batch_size
    return VerifyInput(page_ids=inp.page_ids, num_cached=inp.num_cached,
                       tokens=inp.last_tokens.reshape(bs, 1),  # [bs, 1] int64 the roots
                       parents=((-1,),) * bs, depths=((0,),) * bs)


def _propose_chain(draft: DraftRunner, inp: DraftInput, num_steps: int) -> VerifyInput:
    device, bs = inp.hidden.device, inp.batch_size
    tokens = torch.empty(bs, num_steps + 1, dtype=torch.int64, device=device)  # [bs, k+1]
    tokens[:, 0] = inp.last_tokens  # the root
    tokens[:, 1] = inp.topk_ids[:, 0]  # d_1
    table, num_cached = chain_draft_table(inp.page_ids, inp.num_cached)
    chain_steps(draft, tokens, inp.hidden, h2d.to_device(table, device),
                h2d.to_device(num_cached, device))
    n = num_steps + 1
    return VerifyInput(
        page_ids=inp.page_ids, num_cached=inp.num_cached, tokens=tokens,
        parents=(tuple(range(-1, n - 1)),) * bs, depths=(tuple(range(n)),) * bs,
    )


def chain_steps(draft: DraftRunner, tokens: torch.Tensor, hidden: torch.Tensor,
                page_table: torch.Tensor, num_cached: torch.Tensor) -> torch.Tensor:
    """Chain draft steps 1 .. k-1 from device tensors alone -- eager drafting runs this, and
    the drafting CUDA graph captures it whole (no host work between steps). tokens [B, k+1]
    int64: column 0 the root, column 1 d_1; step s writes d_{s+1} into column s+1 (a buffer of
    the caller's, never a phase value). hidden [B, H] the seed's draft hidden; page_table
    [B, P] int32 and num_cached [B] int64 (`slices.chain_draft_table`). Step s consumes
    (hidden, d_s) at draft position num_cached + s - 1, writes that one slot and attends to
    num_cached + s keys. Returns the last step's draft hidden [B, H]."""
    for step in range(1, tokens.shape[1] - 1):
        positions = num_cached + (step - 1)  # [B] int64
        plan = device_decode_plan(page_table, positions, draft.kv_pool.page_size,
                                  draft.num_splits)
        hidden = draft.forward_planned(tokens[:, step], hidden, positions, plan)
        tokens[:, step + 1] = draft.head.top1(hidden)
    return hidden


@dataclass(slots=True)
class _Node:
    """Host-side bookkeeping of one tree node of one request (built and read in this module
    only)."""

    token: int
    score: float  # cumulative draft log-probability
    level: int  # 1-based depth below the root
    parent: int  # index into the request's node list, -1 = root
    slot: int  # scratch slot offset past num_cached, -1 while not yet run by the draft


def _propose_tree(draft: DraftRunner, inp: DraftInput, spec: SpecConfig) -> VerifyInput:
    k, bs, device = spec.topk, inp.batch_size, inp.hidden.device
    # SYNC: tree bookkeeping (masks, selection) is host-side in this reference implementation.
    ids0, logp0 = inp.topk_ids.tolist(), inp.topk_logp.tolist()
    nodes: list[list[_Node]] = [
        [_Node(ids0[r][b], logp0[r][b], 1, -1, -1) for b in range(k)] for r in range(bs)
    ]
    frontier = [list(range(k)) for _ in range(bs)]  # node indices of the current level
    hidden = inp.hidden.repeat_interleave(k, dim=0)  # [bs*K, H] parent hidden of each frontier node
    for m in range(1, spec.num_steps):
        seqs = []
        for r in range(bs):
            nc = inp.num_cached[r]
            for b, idx in enumerate(frontier[r]):
                nodes[r][idx].slot = (m - 1) * k + b
            mask = torch.zeros(k, nc + m * k, dtype=torch.bool)
            mask[:, :nc] = True
            for b, idx in enumerate(frontier[r]):
                j = idx
                while j >= 0:  # the node itself and its ancestors
                    mask[b, nc + nodes[r][j].slot] = True
                    j = nodes[r][j].parent
            seqs.append(SeqSlice(page_ids=inp.page_ids[r], num_cached=nc + (m - 1) * k,
                                 num_new=k, mask=mask, positions=[nc + m - 1] * k))
        layout = build_metadata(seqs, draft.kv_pool.page_size, device)
        tokens = torch.tensor([nodes[r][i].token for r in range(bs) for i in frontier[r]],
                              dtype=torch.int64, device=device)
        out_hidden = draft.forward(tokens, hidden, layout)  # [bs*K, H]
        child_ids, child_logp = draft.head.topk(out_hidden, k)  # [bs*K, K] each
        child_ids_h, child_logp_h = child_ids.tolist(), child_logp.tolist()  # SYNC: as above
        next_frontier, parent_rows = [], []
        for r in range(bs):
            cands = []
            for b, idx in enumerate(frontier[r]):
                row = r * k + b
                base = nodes[r][idx].score
                cands += [(base + child_logp_h[row][c], child_ids_h[row][c], idx, row)
                          for c in range(k)]
            cands.sort(key=lambda c: -c[0])
            level = []
            for score, tok, parent, row in cands[:k]:
                nodes[r].append(_Node(tok, score, m + 1, parent, -1))
                level.append(len(nodes[r]) - 1)
                parent_rows.append(row)
            next_frontier.append(level)
        frontier = next_frontier
        hidden = out_hidden[torch.tensor(parent_rows, device=device)]
    return _select_tree(inp, nodes, spec.tree_size)


def _select_tree(inp: DraftInput, nodes: list[list[_Node]], tree_size: int) -> VerifyInput:
    """Best `tree_size - 1` nodes per request by score (ties: shallower first, so parents
    precede children), laid out root first and parents before children."""
    last = inp.last_tokens.tolist()  # SYNC: building the verify tree on the host
    tokens, parents, depths = [], [], []
    for r, rnodes in enumerate(nodes):
        order = sorted(range(len(rnodes)), key=lambda i: (-rnodes[i].score, rnodes[i].level))
        chosen = sorted(order[: tree_size - 1], key=lambda i: (rnodes[i].level, order.index(i)))
        position = {idx: j + 1 for j, idx in enumerate(chosen)}
        tokens.append([last[r]] + [rnodes[i].token for i in chosen])
        parents.append(tuple([-1] + [position.get(rnodes[i].parent, 0) if rnodes[i].parent >= 0
                                     else 0 for i in chosen]))
        depths.append(tuple([0] + [rnodes[i].level for i in chosen]))
        for i in chosen:  # ancestor-closed by construction; fail loudly if not
            if rnodes[i].parent >= 0 and rnodes[i].parent not in position:
                raise AssertionError("draft tree selection is not ancestor-closed")
    return VerifyInput(
        page_ids=inp.page_ids, num_cached=inp.num_cached,
        tokens=torch.tensor(tokens, dtype=torch.int64, device=inp.hidden.device),
        parents=tuple(parents), depths=tuple(depths),
    )
