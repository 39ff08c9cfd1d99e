"""The fused MoE path (kernels.moe_experts + moe_weighted_sum, torch twins on the CPU) equals
the per-expert loop it replaced (kernels/moe_reference.py), in float32:

- the block layout (moe_blocks.align_blocks): every local pair in exactly one row, each block
  one expert's, padding within the static bound, other ranks' pairs left out;
- one MoE layer's maths for Mixtral- and Qwen3-MoE-shaped configs, 1..64 tokens, experts with
  no tokens, and EP shards (a rank's experts only; the shards' partial sums add up to the
  whole, as the all-reduce does);
- no host read and no `nonzero` on the way (a CUDA graph can hold it);
- whole tiny Mixtral and Qwen3-MoE models: prompt logits with the fused path equal those of the
  loop within 1e-5 (relative).

The Triton kernels are checked against these twins in test_fused_moe_triton.py."""

from __future__ import annotations

import contextlib
from unittest import mock

import pytest
import torch

from hf_tiny import save_tiny
from rank_helpers import prompt_logits
from tandem.engine import EngineConfig, LLMEngine, ParallelGroup, kernels
from tandem.engine.kernels.moe_blocks import align_blocks, max_sorted_rows
from tandem.engine.kernels.moe_reference import expert_loop, expert_rows_loop

# name: (hidden, intermediate, experts, top_k, norm_topk)
SHAPES = {
    "mixtral": (32, 24, 8, 2, True),
    "qwen3_moe": (48, 20, 16, 4, True),
    "qwen3_moe_unnormed": (40, 16, 12, 3, False),
}
TOKENS = (1, 2, 7, 33, 64)


def _routing(num_tokens: int, num_experts: int, top_k: int, dead: int, seed: int):
    """(weights [T, k] float32, experts [T, k] int64) as SparseMoE.route makes them, with the
    last `dead` experts never picked."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(num_tokens, num_experts, generator=g)
    logits[:, num_experts - dead :] = -1e9
    weights, experts = torch.topk(torch.softmax(logits, -1), top_k, dim=-1)
    return weights, experts


def _weights(hidden: int, inter: int, num_experts: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    w13 = torch.randn(num_experts, 2 * inter, hidden, generator=g) / hidden**0.5
    w2 = torch.randn(num_experts, hidden, inter, generator=g) / inter**0.5
    return w13, w2


def _fused(x, w13, w2, weights, experts, expert_start):
    y = kernels.moe_experts(x, w13, w2, experts, expert_start)  # [T, k, H]
    return kernels.moe_weighted_sum(y, weights, experts)


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    scale = want.abs().max().clamp(min=1e-30)
    assert (got - want).abs().max() <= 1e-5 * scale, (got - want).abs().max()


# ---- the block layout ------------------------------------------------------------------------

@pytest.mark.parametrize("num_tokens", TOKENS)
@pytest.mark.parametrize(("expert_start", "num_local", "block"), [(0, 16, 16), (4, 4, 16),
                                                                  (12, 4, 4), (0, 16, 64)])
def test_blocks_hold_every_local_pair_once_and_one_expert_per_block(
    num_tokens, expert_start, num_local, block
):
    _, experts = _routing(num_tokens, 16, 4, dead=5, seed=num_tokens)
    blocks = align_blocks(experts, expert_start, num_local, block)
    num_pairs = num_tokens * 4
    assert blocks.num_rows == max_sorted_rows(num_pairs, num_local, block)
    assert blocks.num_rows % block == 0 and blocks.block_expert.shape == (blocks.num_rows // block,)
    flat = experts.reshape(-1)
    local = ((flat >= expert_start) & (flat < expert_start + num_local)).nonzero()[:, 0]
    real = blocks.sorted_pairs[blocks.sorted_pairs < num_pairs]
    assert sorted(real.tolist()) == local.tolist()  # each local pair once, nothing else
    rows_expert = blocks.block_expert.repeat_interleave(block)  # [R] expert of each row
    for row, pair in enumerate(blocks.sorted_pairs.tolist()):
        if pair < num_pairs:
            assert rows_expert[row] == flat[pair] - expert_start, (row, pair)
    # blocks whose rows are all padding are exactly the unused ones (-1)
    used = (blocks.sorted_pairs.view(-1, block) < num_pairs).any(dim=1)
    assert torch.equal(used, blocks.block_expert >= 0)


def test_no_pairs_no_rows():
    blocks = align_blocks(torch.empty(0, 2, dtype=torch.int64), 0, 4, 16)
    assert blocks.num_rows == 0 and blocks.block_expert.numel() == 0


# ---- one layer against the loop --------------------------------------------------------------

@pytest.mark.parametrize("num_tokens", TOKENS)
@pytest.mark.parametrize("shape", SHAPES)
def test_fused_equals_the_expert_loop(shape, num_tokens):
    hidden, inter, num_experts, top_k, _ = SHAPES[shape]
    w13, w2 = _weights(hidden, inter, num_experts, seed=1)
    x = torch.randn(num_tokens, hidden, generator=torch.Generator().manual_seed(num_tokens))
    weights, experts = _routing(num_tokens, num_experts, top_k, dead=3, seed=7 + num_tokens)
    want = expert_loop(x, w13, w2, weights, experts, 0)
    _close(_fused(x, w13, w2, weights, experts, 0), want)


@pytest.mark.parametrize("num_tokens", (1, 9, 64))
@pytest.mark.parametrize("ep", (2, 4))
def test_ep_shards_equal_the_loop_and_sum_to_the_whole(ep, num_tokens):
    hidden, inter, num_experts, top_k, _ = SHAPES["qwen3_moe"]
    w13, w2 = _weights(hidden, inter, num_experts, seed=2)
    x = torch.randn(num_tokens, hidden, generator=torch.Generator().manual_seed(3))
    weights, experts = _routing(num_tokens, num_experts, top_k, dead=0, seed=4)
    per = num_experts // ep
    parts = []
    for rank in range(ep):
        start = rank * per
        w13_r, w2_r = w13[start : start + per], w2[start : start + per]
        part = _fused(x, w13_r, w2_r, weights, experts, start)
        _close(part, expert_loop(x, w13_r, w2_r, weights, experts, start))
        parts.append(part)
    _close(sum(parts), expert_loop(x, w13, w2, weights, experts, 0))


def test_a_rank_whose_experts_get_no_token_gives_zeros():
    hidden, inter, num_experts, top_k, _ = SHAPES["mixtral"]
    w13, w2 = _weights(hidden, inter, num_experts, seed=5)
    x = torch.randn(5, hidden)
    weights, experts = _routing(5, num_experts, top_k, dead=4, seed=6)  # experts 4..7 unused
    assert torch.equal(_fused(x, w13[4:], w2[4:], weights, experts, 4), torch.zeros(5, hidden))


@pytest.mark.parametrize("rows", (1, 12, 40))
def test_received_rows_equal_the_row_loop(rows):
    """The all-to-all receiving side: one slot per row, local ids, -1 on padding rows."""
    hidden, inter, num_local = 24, 16, 4
    w13, w2 = _weights(hidden, inter, num_local, seed=8)
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, hidden, generator=g)
    local = torch.randint(-1, num_local - 1, (rows,), generator=g)  # expert 3 never, padding
    got = kernels.moe_experts(x, w13, w2, local[:, None], 0)[:, 0]
    _close(got, expert_rows_loop(x, w13, w2, local))


def test_sparse_moe_layer_equals_the_loop():
    from tandem.engine.layers.mlp import SparseMoE

    hidden, inter, num_experts, top_k, norm = SHAPES["qwen3_moe"]
    moe = SparseMoE(hidden, inter, num_experts, top_k, norm, ParallelGroup(), ParallelGroup(),
                    torch.float32)
    g = torch.Generator().manual_seed(9)
    moe.router.load_weight("router", torch.randn(num_experts, hidden, generator=g))
    moe.w13.data.copy_(torch.randn(moe.w13.shape, generator=g))
    moe.w2.data.copy_(torch.randn(moe.w2.shape, generator=g))
    x = torch.randn(17, hidden, generator=g)
    weights, experts = moe.route(x)
    _close(moe(x), expert_loop(x, moe.w13, moe.w2, weights, experts, 0))


# ---- nothing reads the host ------------------------------------------------------------------

@contextlib.contextmanager
def _no_host_reads():
    def refuse(*_args, **_kwargs):
        raise AssertionError("host read / nonzero in the fused MoE path")

    with mock.patch.object(torch.Tensor, "item", refuse), \
            mock.patch.object(torch.Tensor, "tolist", refuse), \
            mock.patch.object(torch.Tensor, "nonzero", refuse), \
            mock.patch.object(torch, "nonzero", refuse):
        yield


def test_fused_path_reads_nothing_back():
    hidden, inter, num_experts, top_k, _ = SHAPES["qwen3_moe"]
    w13, w2 = _weights(hidden, inter, num_experts, seed=10)
    x = torch.randn(6, hidden)
    weights, experts = _routing(6, num_experts, top_k, dead=2, seed=11)
    with _no_host_reads():
        _fused(x, w13[8:], w2[8:], weights, experts, 8)
    with _no_host_reads(), pytest.raises(AssertionError, match="host read"):
        expert_loop(x, w13, w2, weights, experts, 0)


# ---- whole models ----------------------------------------------------------------------------

@pytest.mark.parametrize("arch", ("mixtral", "qwen3_moe"))
def test_model_logits_equal_the_loops(tmp_path, arch):
    from tandem.engine.layers.mlp import SparseMoE

    model_dir, _ = save_tiny(arch, tmp_path, seed=3)
    engine = LLMEngine.from_config(EngineConfig(model=str(model_dir), dtype="float32",
                                                num_pages=64, page_size=4))
    prompt = [(37 * i + 11) % 256 for i in range(23)]
    fused = prompt_logits(engine, prompt)

    def loop(self, x, weights, experts):
        return expert_loop(x, self.w13, self.w2, weights, experts, self.expert_start)

    with mock.patch.object(SparseMoE, "_local_experts_by_token", loop):
        want = prompt_logits(engine, prompt)
    _close(fused, want)
