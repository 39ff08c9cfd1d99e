"""Triton kernels for speculative bookkeeping: one launch each where torch needs a loop of
small ones (or a host round trip). Imported only when a CUDA tensor (or a CPU test under
TRITON_INTERPRET=1) asks for them. Each has a twin in `torch_ops` with the same signature and
semantics; all of them are integer/bool work, so outputs equal the twins exactly."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# ---- greedy acceptance -------------------------------------------------------------------------

@triton.jit
def _greedy_accept_kernel(
    tok_ptr, tgt_ptr, par_ptr, num_ptr, path_ptr, bonus_ptr, n_nodes,
    MAX_DEPTH: tl.constexpr, PATH_STRIDE: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """Program r walks request r's tree: at each level the lowest-index child of the current
    node whose token equals the target's argmax there, until none does."""
    r = tl.program_id(0).to(tl.int64)
    idx = tl.arange(0, BLOCK_N)
    inside = idx < n_nodes
    toks = tl.load(tok_ptr + r * n_nodes + idx, mask=inside, other=-1)
    pars = tl.load(par_ptr + r * n_nodes + idx, mask=inside, other=-2).to(tl.int32)
    node = tl.zeros((), dtype=tl.int32)
    active = tl.full((), 1, dtype=tl.int32)
    num = tl.zeros((), dtype=tl.int32)
    for d in tl.static_range(MAX_DEPTH):
        want = tl.load(tgt_ptr + r * n_nodes + node)
        match = (pars == node) & (toks == want) & inside & (active != 0)
        first = tl.min(tl.where(match, idx, BLOCK_N), axis=0).to(tl.int32)
        found = (first < BLOCK_N).to(tl.int32)
        tl.store(path_ptr + r * PATH_STRIDE + d, tl.where(found != 0, first, -1))
        node = tl.where(found != 0, first, node)
        num += found
        active = found
    tl.store(num_ptr + r, num)
    tl.store(bonus_ptr + r, tl.load(tgt_ptr + r * n_nodes + node))


def greedy_accept(tokens: torch.Tensor, target_ids: torch.Tensor, parents: torch.Tensor,
                  max_depth: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """See `torch_ops.greedy_accept`."""
    b, n = tokens.shape
    dev = tokens.device
    num = torch.empty(b, dtype=torch.int32, device=dev)
    path = torch.empty(b, max(max_depth, 1), dtype=torch.int32, device=dev)
    bonus = torch.empty(b, dtype=torch.int64, device=dev)
    if b == 0:
        return num, path[:, :max_depth], bonus
    _greedy_accept_kernel[(b,)](
        tokens.contiguous(), target_ids.contiguous(), parents.to(torch.int32).contiguous(),
        num, path, bonus, n, MAX_DEPTH=max_depth, PATH_STRIDE=path.shape[1],
        BLOCK_N=triton.next_power_of_2(n), num_warps=1,
    )
    return num, path[:, :max_depth], bonus


@triton.jit
def _accept_chain_kernel(
    tok_ptr, tgt_ptr, num_ptr, path_ptr, bonus_ptr, vtok_ptr, rows_ptr, batch, n_nodes,
    path_stride, DEPTH: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_P: tl.constexpr,
):
    """Program r < batch: request r's chain (node j's parent j - 1) -- accepted drafts = the
    first j where node j+1's token differs from the target's argmax at node j (or n - 1), the
    bonus the argmax at the last accepted node; writes the extend graph's inputs (num, path
    padded with -1, bonus, tokens) and the host row [num, bonus, path[:D], tokens[1:D+1]].
    Program r >= batch: a padding request accepting nothing."""
    r = tl.program_id(0).to(tl.int64)
    live = r < batch
    j = tl.arange(0, BLOCK_N)
    toks = tl.load(tok_ptr + r * n_nodes + j, mask=live & (j < n_nodes), other=0)
    nxt = tl.load(tok_ptr + r * n_nodes + j + 1, mask=live & (j + 1 < n_nodes), other=0)
    tgt = tl.load(tgt_ptr + r * n_nodes + j, mask=live & (j + 1 < n_nodes), other=0)
    miss = (nxt != tgt) | (j + 1 >= n_nodes)
    num = tl.min(tl.where(miss, j, BLOCK_N), axis=0).to(tl.int32)
    num = tl.where(live, num, 0)
    bonus = tl.load(tgt_ptr + r * n_nodes + num, mask=live, other=0)
    p = tl.arange(0, BLOCK_P)
    path = tl.where(p < num, p + 1, -1).to(tl.int32)
    tl.store(path_ptr + r * path_stride + p, path, mask=p < path_stride)
    tl.store(num_ptr + r, num)
    tl.store(bonus_ptr + r, bonus)
    tl.store(vtok_ptr + r * n_nodes + j, toks, mask=live & (j < n_nodes))
    row = rows_ptr + r * (2 + 2 * DEPTH)
    tl.store(row, num.to(tl.int64), mask=live)
    tl.store(row + 1, bonus, mask=live)
    tl.store(row + 2 + p, path.to(tl.int64), mask=live & (p < DEPTH))
    tl.store(row + 2 + DEPTH + j - 1, toks, mask=live & (j >= 1) & (j <= DEPTH))


def accept_chain_into(tokens: torch.Tensor, target_ids: torch.Tensor, num: torch.Tensor,
                      path: torch.Tensor, bonus: torch.Tensor, ver_tokens: torch.Tensor
                      ) -> torch.Tensor:
    """See `torch_ops.accept_chain_into`."""
    b, n = tokens.shape
    depth = n - 1
    rows = torch.empty(b, 2 + 2 * depth, dtype=torch.int64, device=tokens.device)
    _accept_chain_kernel[(num.shape[0],)](
        tokens, target_ids, num, path, bonus, ver_tokens, rows, b, n, path.stride(0),
        DEPTH=depth, BLOCK_N=triton.next_power_of_2(n),
        BLOCK_P=triton.next_power_of_2(path.shape[1]), num_warps=1,
    )
    return rows


# ---- draft-extend inputs -----------------------------------------------------------------------

@triton.jit
def _extend_inputs_kernel(
    tok_ptr, path_ptr, num_ptr, bonus_ptr, nc_ptr, pt_ptr,
    out_tok_ptr, out_feat_ptr, out_pos_ptr, out_slot_ptr, last_ptr,
    batch, n_nodes, pt_stride, page_size,
    DEPTH: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_J: tl.constexpr,
):
    """Program r writes request r's a_r + 1 rows at offset sum_{q<r} (a_q + 1)."""
    r = tl.program_id(0).to(tl.int64)
    q = tl.arange(0, BLOCK_B)
    counts = tl.load(num_ptr + q, mask=q < batch, other=0).to(tl.int64) + 1
    start = tl.sum(tl.where(q < r, counts, 0), axis=0)
    a = tl.load(num_ptr + r).to(tl.int64)
    j = tl.arange(0, BLOCK_J)
    valid = j <= a
    # node feeding row j: the root (j = 0) or accepted node j (path[j - 1])
    feat_node = tl.load(path_ptr + r * DEPTH + j - 1, mask=valid & (j > 0), other=0).to(tl.int64)
    # token of row j: accepted node j+1's (path[j]) for j < a, the bonus at j == a
    tok_node = tl.load(path_ptr + r * DEPTH + j, mask=valid & (j < a), other=0).to(tl.int64)
    toks = tl.load(tok_ptr + r * n_nodes + tok_node, mask=valid & (j < a), other=0)
    toks = tl.where(j < a, toks, tl.load(bonus_ptr + r))
    pos = tl.load(nc_ptr + r).to(tl.int64) + j
    page = tl.load(pt_ptr + r * pt_stride + pos // page_size, mask=valid, other=0).to(tl.int64)
    dst = start + j
    tl.store(out_tok_ptr + dst, toks, mask=valid)
    tl.store(out_feat_ptr + dst, r * n_nodes + feat_node, mask=valid)
    tl.store(out_pos_ptr + dst, pos, mask=valid)
    tl.store(out_slot_ptr + dst, page * page_size + pos % page_size, mask=valid)
    tl.store(last_ptr + r, start + a)


def extend_inputs(
    tokens: torch.Tensor, path: torch.Tensor, num_accepted: torch.Tensor, bonus: torch.Tensor,
    num_cached: torch.Tensor, page_table: torch.Tensor, page_size: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """See `torch_ops.extend_inputs`."""
    b, n = tokens.shape
    d = path.shape[1]
    cap, dev = b * (d + 1), tokens.device
    outs = [torch.zeros(cap, dtype=torch.int64, device=dev) for _ in range(4)]
    last = torch.empty(b, dtype=torch.int64, device=dev)
    if b == 0:
        return (*outs, last)
    path_c = path.to(torch.int32).contiguous()
    if d == 0:  # no drafts: a placeholder the kernel never reads
        path_c = torch.zeros(b, 1, dtype=torch.int32, device=dev)
    pt = page_table.to(torch.int32).contiguous()
    _extend_inputs_kernel[(b,)](
        tokens.contiguous(), path_c, num_accepted.to(torch.int32).contiguous(),
        bonus.contiguous(), num_cached.to(torch.int64).contiguous(), pt, *outs, last,
        b, n, pt.shape[1], page_size, DEPTH=path_c.shape[1],
        BLOCK_B=triton.next_power_of_2(b), BLOCK_J=triton.next_power_of_2(d + 1), num_warps=1,
    )
    return (*outs, last)


# ---- verify tree mask --------------------------------------------------------------------------

@triton.jit
def _tree_mask_kernel(
    par_ptr, nc_ptr, off_ptr, out_ptr,
    N_NODES: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """Program (r, i, c) writes columns [c * BLOCK_K, (c + 1) * BLOCK_K) of row i of request
    r's [N, nc + N] mask: True over the nc prefix keys, then True at tree node j iff j is node
    i or one of its ancestors (found by walking up from i)."""
    r = tl.program_id(0).to(tl.int64)
    i = tl.program_id(1)
    nc = tl.load(nc_ptr + r).to(tl.int64)
    width = nc + N_NODES
    row = out_ptr + tl.load(off_ptr + r) + i * width
    cols = tl.program_id(2).to(tl.int64) * BLOCK_K + tl.arange(0, BLOCK_K)
    j = cols - nc  # tree node of each column (negative over the prefix)
    val = cols < nc
    node = i.to(tl.int64)
    for _ in tl.static_range(N_NODES):  # the node itself and at most N - 1 ancestors
        live = node >= 0
        val = val | ((j == node) & live)
        up = tl.load(par_ptr + r * N_NODES + tl.maximum(node, 0)).to(tl.int64)
        node = tl.where(live, up, node)
    tl.store(row + cols, val.to(tl.uint8), mask=cols < width)


def tree_mask(parents: torch.Tensor, num_cached: torch.Tensor, mask_offsets: torch.Tensor,
              total: int, max_num_cached: int) -> torch.Tensor:
    """See `torch_ops.tree_mask`."""
    b, n = parents.shape
    out = torch.empty(total, dtype=torch.uint8, device=parents.device)  # 0/1, viewed as bool
    if b == 0 or total == 0:
        return out.view(torch.bool)
    block = 1024
    _tree_mask_kernel[(b, n, triton.cdiv(max_num_cached + n, block))](
        parents.to(torch.int32).contiguous(), num_cached.to(torch.int64).contiguous(),
        mask_offsets.to(torch.int64).contiguous(), out, N_NODES=n, BLOCK_K=block, num_warps=4,
    )
    return out.view(torch.bool)


# ---- the fixed-shape draft-extend's inputs (speculative graphs) --------------------------------

@triton.jit
def _extend_rows_kernel(
    tok_ptr, path_ptr, num_ptr, bonus_ptr, out_tok_ptr, out_row_ptr, last_ptr, n_nodes,
    path_stride, rows_per_seq, BLOCK_R: tl.constexpr,
):
    """Program r: request r's rows j < R (see `torch_ops.extend_rows`)."""
    r = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, BLOCK_R)
    inside = j < rows_per_seq
    num = tl.load(num_ptr + r).to(tl.int64)
    # node_j: the root at j = 0, accepted node j (path[j-1]) after; next_j: path[j], 0 at R-1
    prev = tl.load(path_ptr + r * path_stride + j - 1, mask=inside & (j >= 1), other=0)
    node = tl.maximum(prev.to(tl.int64), 0)
    nxt = tl.load(path_ptr + r * path_stride + j, mask=inside & (j < rows_per_seq - 1),
                  other=0)
    nxt = tl.maximum(nxt.to(tl.int64), 0)
    tok = tl.load(tok_ptr + r * n_nodes + nxt, mask=inside, other=0)
    tok = tl.where(j < num, tok, tl.load(bonus_ptr + r))
    tl.store(out_tok_ptr + r * rows_per_seq + j, tok, mask=inside)
    tl.store(out_row_ptr + r * rows_per_seq + j, r * n_nodes + node, mask=inside)
    tl.store(last_ptr + r, r * rows_per_seq + num)


def extend_rows(tokens: torch.Tensor, path: torch.Tensor, num_accepted: torch.Tensor,
                bonus: torch.Tensor, rows_per_seq: int
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """See `torch_ops.extend_rows`; one launch instead of ~14."""
    b, n = tokens.shape
    dev = tokens.device
    toks = torch.empty(b * rows_per_seq, dtype=torch.int64, device=dev)
    rows = torch.empty(b * rows_per_seq, dtype=torch.int64, device=dev)
    last = torch.empty(b, dtype=torch.int64, device=dev)
    if b:
        _extend_rows_kernel[(b,)](
            tokens, path, num_accepted, bonus, toks, rows, last, n, path.stride(0),
            rows_per_seq, BLOCK_R=triton.next_power_of_2(rows_per_seq), num_warps=1,
        )
    return toks, rows, last
