"""Torch twins of the fused-MoE Triton kernels (triton_moe): the same maths over the same
block layout (moe_blocks.MoeBlocks), written as batched matmuls one block at a time, so the
CPU engine runs them and the kernels are tested against them.

Rounding follows the expert loop it replaced (moe_reference.expert_loop): the gate_up and
down products are rounded to the model dtype, SiLU * up in the model dtype, each output
weighted in the model dtype, and a token's k outputs added from zero in ascending expert id,
rounding after each add. In float32 the twins equal the loop up to the matmuls' summation
order.
"""

from __future__ import annotations

import torch

from tandem.engine.kernels.moe_blocks import MoeBlocks
from tandem.engine.kernels.torch_ops import silu_and_mul


def _blocks_of(rows: torch.Tensor, blocks: MoeBlocks) -> torch.Tensor:
    """[R, C] -> [R // block, block, C]."""
    return rows.view(blocks.num_rows // blocks.block, blocks.block, rows.shape[-1])


def moe_gate_up(
    x: torch.Tensor,  # [T, H] token rows
    w13: torch.Tensor,  # [E_local, 2I, H] gate rows then up rows per expert
    blocks: MoeBlocks,
) -> torch.Tensor:  # [R, I] silu(gate) * up of each sorted row (0 on padding rows)
    tokens = blocks.sorted_pairs // blocks.top_k  # [R]; padding rows -> T, the zero row
    rows = torch.cat([x, x.new_zeros(1, x.shape[1])])[tokens]  # [R, H]
    # Unused blocks borrow expert 0: their rows are zero, so are their outputs.
    w = w13[blocks.block_expert.clamp(min=0)]  # [R // block, 2I, H]
    gate_up = torch.bmm(_blocks_of(rows, blocks), w.transpose(1, 2))  # [R // block, block, 2I]
    return silu_and_mul(gate_up.view(blocks.num_rows, w13.shape[1]))


def moe_down(
    h: torch.Tensor,  # [R, I] from moe_gate_up
    w2: torch.Tensor,  # [E_local, H, I]
    blocks: MoeBlocks,
) -> torch.Tensor:  # [A, H] unweighted expert output of each pair; 0 for other ranks' pairs
    w = w2[blocks.block_expert.clamp(min=0)]  # [R // block, H, I]
    y = torch.bmm(_blocks_of(h, blocks), w.transpose(1, 2))  # [R // block, block, H]
    # One extra row takes every padding row (pair id A) and is cut off: the other rows are
    # written once each.
    out = h.new_zeros(blocks.num_pairs + 1, w2.shape[1])
    out.index_copy_(0, blocks.sorted_pairs, y.view(blocks.num_rows, w2.shape[1]))
    return out[: blocks.num_pairs]


def moe_weighted_sum(
    y: torch.Tensor,  # [T, k, H] per-slot expert outputs
    weights: torch.Tensor,  # [T, k] routing weights, y.dtype
    slot_order: torch.Tensor,  # [T, k] int64 slots by ascending expert id (experts.argsort)
) -> torch.Tensor:  # [T, H] sum_j weights * y, added from zero in slot_order
    y = y * weights[..., None]  # [T, k, H]
    y = y.gather(1, slot_order[..., None].expand(-1, -1, y.shape[-1]))
    out = torch.zeros_like(y[:, 0])
    for j in range(y.shape[1]):
        out = out + y[:, j]
    return out
