"""Torch twins of the Triton kernels: the reference semantics every kernel is tested against,
and the path the CPU engine runs. Each function allocates its outputs (never writes into an
argument) except `store_kv`, whose whole job is writing into the KV pages it is given."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., H], weight [H] -> [..., H]. float32 statistics, weight applied in x.dtype (HF)."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """x, residual [T, H] -> (rms_norm(x + residual), x + residual); the sum in x.dtype (HF)."""
    summed = x + residual
    return rms_norm(summed, weight, eps), summed


def rotary(
    positions: torch.Tensor,  # [T] int64
    q: torch.Tensor,  # [T, Hq, D]
    k: torch.Tensor,  # [T, Hk, D]
    cos: torch.Tensor,  # [max_position, D] float32 (two equal halves)
    sin: torch.Tensor,  # [max_position, D] float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate-half (NeoX) rope. Returns new contiguous [T, Hq, D] and [T, Hk, D]."""
    c = cos[positions].to(q.dtype).unsqueeze(1)  # [T, 1, D]
    s = sin[positions].to(q.dtype).unsqueeze(1)
    return q * c + _rotate_half(q) * s, k * c + _rotate_half(k) * s


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def store_kv(
    kv_cache: torch.Tensor,  # [num_pages, 2, page_size, Hkv, D] one layer's pages (written)
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, D]
    slot_ids: torch.Tensor,  # [T] int64, page * page_size + offset
) -> None:
    page_size = kv_cache.shape[2]
    pages, offsets = slot_ids // page_size, slot_ids % page_size
    kv_cache[pages, 0, offsets] = k
    kv_cache[pages, 1, offsets] = v


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:  # [T, 2I] -> [T, I]
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:  # [M, K] x [N, K] -> [M, N]
    return F.linear(x, weight)


def fused_linear(
    x: torch.Tensor,  # [M, K], or [M, 2K] (gate | up) with silu_mul
    weight: torch.Tensor,  # [N, K]
    norm_weight: torch.Tensor | None = None,  # [K]: rms_norm(x) first
    eps: float = 0.0,
    silu_mul: bool = False,
    residual: torch.Tensor | None = None,  # [M, N]: added after the product
) -> torch.Tensor:  # [M, N]
    """The twin of the fused Triton GEMV: the unfused sequence of ops it replaces."""
    if silu_mul:
        x = silu_and_mul(x)
    if norm_weight is not None:
        x = rms_norm(x, norm_weight, eps)
    y = F.linear(x, weight)
    return y if residual is None else y + residual


def rotary_store(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    cos: torch.Tensor, sin: torch.Tensor, kv_cache: torch.Tensor, slot_ids: torch.Tensor,
) -> torch.Tensor:
    """Rope, then K/V into the pages; returns the rotated q."""
    q, k = rotary(positions, q, k, cos, sin)
    store_kv(kv_cache, k, v, slot_ids)
    return q


def paged_decode(
    q: torch.Tensor,  # [B, Hq, D] one query token per sequence
    kv_cache: torch.Tensor,  # [num_pages, 2, page_size, Hkv, D] (0 = K, 1 = V), q.dtype
    page_table: torch.Tensor,  # [B, P] int32: key t of sequence b is in page [b, t // page_size]
    kv_lens: torch.Tensor,  # [B] int32/int64: keys 0..kv_lens[b]-1 are attended
    scale: float,  # softmax scale
    num_splits: int,  # the Triton kernel's key split count; the result does not depend on it
) -> torch.Tensor:  # [B, Hq, D] q.dtype
    """Decode attention over paged K/V with GQA (query head h reads KV head h // (Hq / Hkv)),
    exact float32 softmax, the batch padded to its longest sequence (one gather, one softmax:
    CPU serving runs chain draft steps through this). The reference the Triton kernel is tested
    against; it reads the longest length on the host (SYNC), so it is not for CUDA graphs. A
    length of 0 gives a zero row, as the kernel does."""
    assert num_splits >= 1
    bs, num_q_heads, d = q.shape
    page_size, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    group = num_q_heads // num_kv_heads
    longest = int(kv_lens.max()) if bs else 0  # SYNC: the padded width
    if longest == 0:
        return torch.zeros_like(q)
    t = torch.arange(longest, device=q.device)  # [n] key positions
    pages = page_table[:, t // page_size].long()  # [B, n]
    kv = kv_cache[pages, :, t % page_size].float()  # [B, n, 2, Hkv, D]
    valid = t[None, :] < kv_lens[:, None]  # [B, n]
    qg = q.float().view(bs, num_kv_heads, group, d)  # [B, Hkv, G, D]
    scores = torch.einsum("bkgd,bnkd->bkgn", qg, kv[:, :, 0]) * scale  # [B, Hkv, G, n]
    scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
    probs = scores.softmax(-1).nan_to_num(0.0)  # an empty row (all -inf) -> zeros
    out = torch.einsum("bkgn,bnkd->bkgd", probs, kv[:, :, 1])  # [B, Hkv, G, D] float32
    return out.reshape(bs, num_q_heads, d).to(q.dtype)


def decode_rows_plan(
    table: torch.Tensor,  # [B, P] int32 page table of each sequence
    base: torch.Tensor,  # [B] int64 position of each sequence's first row
    rows_per_seq: int,  # R: row j of sequence b sits at base[b] + j
    page_size: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The device-side metadata of B * R decode rows -> (positions [B*R] int64, keys attended
    positions + 1 [B*R] int64, K/V slots page * page_size + offset [B*R] int64, each row's page
    table [B*R, P] int32: `table` itself when R == 1, else its rows repeated R times)."""
    offsets = torch.arange(rows_per_seq, device=base.device)  # [R]
    positions = (base[:, None] + offsets[None, :]).reshape(-1)  # [B * R]
    rows = table if rows_per_seq == 1 else table.repeat_interleave(rows_per_seq, dim=0)
    page = rows.gather(1, (positions // page_size).unsqueeze(1)).squeeze(1).long()  # [B * R]
    return positions, positions + 1, page * page_size + positions % page_size, rows


def row_max(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, V] -> (values [M] x.dtype, indices [M] int64): each row's largest entry and its
    first column (torch.max's order: NaN is the largest)."""
    return tuple(x.max(dim=-1))
