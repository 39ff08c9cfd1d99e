"""Torch twins of the speculative bookkeeping kernels (`triton_ops`): the reference semantics,
and the path CPU engines run. Each allocates its outputs and never writes its arguments."""

from __future__ import annotations

import torch


def greedy_accept(
    tokens: torch.Tensor,  # [B, N] int64 draft tree per request, node 0 = root
    target_ids: torch.Tensor,  # [B, N] int64 target argmax at every node
    parents: torch.Tensor,  # [B, N] int32 parent node, -1 for the root
    max_depth: int,  # deepest node of any tree (bounds the accepted path)
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Walk each tree from the root: move to the first child (lowest index) whose token is the
    target's argmax at the current node; stop when none is. Returns (num_accepted [B] int32,
    path [B, max_depth] int32 accepted nodes, -1 past the end, bonus [B] int64 = the target's
    argmax at the last accepted node) -- `accept._walk_greedy` for a whole batch."""
    b, n = tokens.shape
    dev = tokens.device
    rows = torch.arange(b, device=dev)
    idx = torch.arange(n, device=dev).expand(b, n)
    node = torch.zeros(b, dtype=torch.int64, device=dev)
    active = torch.ones(b, dtype=torch.bool, device=dev)
    num = torch.zeros(b, dtype=torch.int32, device=dev)
    path = torch.full((b, max(max_depth, 1)), -1, dtype=torch.int32, device=dev)
    for d in range(max_depth):
        want = target_ids[rows, node]  # [B]
        match = (parents.long() == node[:, None]) & (tokens == want[:, None]) & active[:, None]
        first = torch.where(match, idx, n).min(dim=1).values  # [B], n = no match
        found = first < n
        path[:, d] = torch.where(found, first, -1).to(torch.int32)
        node = torch.where(found, first, node)
        num += found.to(torch.int32)
        active = found
    return num, path[:, :max_depth], target_ids[rows, node]


def accept_chain_into(
    tokens: torch.Tensor,  # [b, N] int64 each request's chain (node j's parent is j - 1)
    target_ids: torch.Tensor,  # [b * N] int64 the target's argmax at every node
    num: torch.Tensor,  # [R] int32 out, R >= b (rows past b: padding requests)
    path: torch.Tensor,  # [R, P] int32 out, P >= N - 1
    bonus: torch.Tensor,  # [R] int64 out
    ver_tokens: torch.Tensor,  # [R, N] int64 out (rows < b)
) -> torch.Tensor:  # [b, 2 + 2D] int64, D = N - 1
    """`greedy_accept` of a chain, written where the speculative graphs read it: num accepted,
    path (nodes 1..a, then -1), bonus, and the tokens; rows past b (padding) accept nothing
    (bonus 0, tokens left as they are). Returns each request's host row [a, bonus, path[:D],
    tokens[1 : D + 1]] (the path and its tokens past a are filler)."""
    b, n = tokens.shape
    d = n - 1
    target = target_ids.view(b, n)
    match = tokens[:, 1:] == target[:, :-1]  # [b, D] draft j + 1 is the target's choice at j
    a = torch.cumprod(match.long(), dim=1).sum(dim=1)  # [b] the leading run of matches
    j = torch.arange(path.shape[1], device=tokens.device)
    num.zero_()
    path.fill_(-1)
    bonus.zero_()
    num[:b] = a.to(torch.int32)
    path[:b] = torch.where(j[None, :] < a[:, None], j[None, :] + 1, -1).to(torch.int32)
    bonus[:b] = target.gather(1, a[:, None])[:, 0]
    ver_tokens[:b] = tokens
    return torch.cat([a[:, None], bonus[:b, None], path[:b, :d].long(), tokens[:, 1:]], dim=1)


def extend_inputs(
    tokens: torch.Tensor,  # [B, N] int64 the verified trees
    path: torch.Tensor,  # [B, D] int32 accepted nodes, -1 padded
    num_accepted: torch.Tensor,  # [B] int32
    bonus: torch.Tensor,  # [B] int64
    num_cached: torch.Tensor,  # [B] int64 the round's num_cached
    page_table: torch.Tensor,  # [B, P] int32 each request's pages (padded)
    page_size: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The draft-extend forward's inputs, packed request-major over T = sum(a_r + 1) rows
    (outputs have B * (D + 1) rows; rows >= T are 0): token ids (accepted drafts, then the
    bonus), feature rows r * N + node (root first, then the accepted nodes), positions
    num_cached + j, KV slots of those positions; and last_rows [B], each request's bonus
    row (its next-round hidden)."""
    b, n = tokens.shape
    d = path.shape[1]
    cap = b * (d + 1)
    dev = tokens.device
    out_tok = torch.zeros(cap, dtype=torch.int64, device=dev)
    out_feat = torch.zeros(cap, dtype=torch.int64, device=dev)
    out_pos = torch.zeros(cap, dtype=torch.int64, device=dev)
    out_slot = torch.zeros(cap, dtype=torch.int64, device=dev)
    counts = num_accepted.long() + 1  # [B]
    starts = torch.cumsum(counts, 0) - counts  # [B]
    j = torch.arange(d + 1, device=dev).expand(b, d + 1)  # [B, D+1]
    valid = j < counts[:, None]
    nodes = torch.cat([torch.zeros(b, 1, dtype=torch.int64, device=dev),
                       path.long().clamp(min=0)], dim=1)  # [B, D+1] root, then path
    # token j: the accepted node j+1's token for j < a, the bonus at j == a
    nxt = torch.cat([path.long().clamp(min=0), torch.zeros(b, 1, dtype=torch.int64,
                                                            device=dev)], dim=1)
    toks = torch.where(j < num_accepted.long()[:, None], tokens.gather(1, nxt),
                       bonus[:, None].expand(b, d + 1))
    pos = num_cached.long()[:, None] + j
    page = page_table.long().gather(1, (pos // page_size).clamp(max=page_table.shape[1] - 1))
    slots = page * page_size + pos % page_size
    dst = (starts[:, None] + j)[valid]
    out_tok[dst] = toks[valid]
    out_feat[dst] = (torch.arange(b, device=dev)[:, None] * n + nodes)[valid]
    out_pos[dst] = pos[valid]
    out_slot[dst] = slots[valid]
    return out_tok, out_feat, out_pos, out_slot, starts + counts - 1


def tree_mask(
    parents: torch.Tensor,  # [B, N] int32, -1 for the root
    num_cached: torch.Tensor,  # [B] int64
    mask_offsets: torch.Tensor,  # [B] int64 start of each request's rows in the output
    total: int,  # sum_r N * (num_cached[r] + N)
    max_num_cached: int,  # max_r num_cached[r] (host-known; bounds the kernel's prefix loop)
) -> torch.Tensor:
    """The flat verify mask in `build_metadata`'s packing: request r's [N, num_cached + N]
    rows, row-major, from mask_offsets[r]: the whole prefix, then the node itself and its
    ancestors. [total] bool."""
    b, n = parents.shape
    dev = parents.device
    anc = torch.eye(n, dtype=torch.bool, device=dev).expand(b, n, n).clone()  # [B, N, N]
    cur = parents.long()  # [B, N] the ancestor `step` levels up (-1: none)
    rows = torch.arange(b, device=dev)[:, None]
    for _ in range(n - 1):
        has = cur >= 0
        anc |= torch.nn.functional.one_hot(cur.clamp(min=0), n).bool() & has[..., None]
        cur = torch.where(has, parents.long()[rows, cur.clamp(min=0)], cur)
    del max_num_cached  # the twin reads the lengths themselves
    out = torch.zeros(total, dtype=torch.bool, device=dev)
    for r, (nc, off) in enumerate(zip(num_cached.tolist(), mask_offsets.tolist())):
        block = torch.cat([torch.ones(n, nc, dtype=torch.bool, device=dev), anc[r]], dim=1)
        out[off : off + n * (nc + n)] = block.reshape(-1)
    return out


def extend_rows(
    tokens: torch.Tensor,  # [B, N] int64 the verified nodes' tokens
    path: torch.Tensor,  # [B, >= R-1] int32 accepted nodes, -1 padded
    num_accepted: torch.Tensor,  # [B] int32
    bonus: torch.Tensor,  # [B] int64
    rows_per_seq: int,  # R: the fixed-shape extend's rows per request
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The fixed-shape draft-extend's inputs (speculative graphs; `extend_inputs` packs
    instead): row j of request r carries the token of accepted node j+1 (the bonus at
    j = a_r and past it: filler) and reads the feature row r * N + node_j (root, then the
    accepted nodes) -> (token ids [B*R] int64, feature rows [B*R] int64, each request's bonus
    row r * R + a_r [B] int64)."""
    b, n = tokens.shape
    r = rows_per_seq
    dev = tokens.device
    num = num_accepted.long()  # [B]
    steps = path[:, : r - 1].long().clamp(min=0)  # [B, R-1]
    zero = torch.zeros(b, 1, dtype=torch.int64, device=dev)
    nodes = torch.cat([zero, steps], dim=1)  # [B, R] node feeding row j
    nxt = torch.cat([steps, zero], dim=1)  # [B, R] node whose token row j carries
    j = torch.arange(r, device=dev)  # [R]
    toks = torch.where(j[None, :] < num[:, None], tokens.gather(1, nxt), bonus[:, None])
    base = torch.arange(b, device=dev)[:, None]  # [B, 1]
    return toks.reshape(-1), (base * n + nodes).reshape(-1), base[:, 0] * r + num
