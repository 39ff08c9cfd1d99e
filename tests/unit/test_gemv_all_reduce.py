"""The fused row-parallel GEMV + all-reduce (kernels/triton_gemv_ar.py) through the Triton
interpreter, two ranks in one process.

The interpreter runs one program at a time, so the ranks cannot meet: each rank's call runs
with its peer's pushes already in its inbox. Rank 0 runs first, with rank 1's partial and
flags staged by hand; rank 1 then runs on what rank 0's kernel really pushed. Both must
return the sum of the partials in rank order, bit for bit what `gemv` + the flag one-shot
all-reduce computes, and leave the counters, flags and slots as the protocol says. The GPU
test (tests/gpu/test_tp_graphs.py) runs the two ranks for real."""

from __future__ import annotations

import pytest
import torch
from triton_interp import require_triton_interpreter

require_triton_interpreter()  # before triton is first imported

from tandem.engine.kernels import triton_gemv  # noqa: E402
from tandem.engine.kernels.triton_gemv_ar import (  # noqa: E402
    AREA,
    G_MAX,
    GemvAllReduce,
    area_offsets,
    launch_grid,
)

WORLD, SMS = 2, 4
DT = torch.bfloat16


class Pair:
    """Two ranks' inboxes [G_MAX, 2, W, AREA] and flags [G_MAX, W] as CPU tensors."""

    def __init__(self) -> None:
        self.inbox = [torch.zeros(G_MAX * 2 * WORLD * AREA, dtype=DT) for _ in range(WORLD)]
        self.flags = [torch.zeros(G_MAX * WORLD, dtype=torch.int64) for _ in range(WORLD)]
        bufs = torch.tensor([t.data_ptr() for t in self.inbox], dtype=torch.int64)
        flag_ptrs = torch.tensor([t.data_ptr() for t in self.flags], dtype=torch.int64)
        self.ranks = [GemvAllReduce(r, WORLD, self.inbox[r], bufs, flag_ptrs, SMS,
                                    keep=(self.flags[r],)) for r in range(WORLD)]

    def region(self, rank: int, slot: int, sender: int, n: int,
               config: tuple) -> torch.Tensor:
        """The indices of `sender`'s push of n rows in `rank`'s inbox, slot `slot`."""
        return area_offsets(n, config, SMS, slot, sender, WORLD)

    def pushed(self, rank: int, slot: int, sender: int, n: int, config: tuple) -> torch.Tensor:
        return self.inbox[rank][self.region(rank, slot, sender, n, config)]

    def stage(self, rank: int, slot: int, sender: int, values: torch.Tensor,
              config: tuple) -> None:
        self.inbox[rank][self.region(rank, slot, sender, values.numel(), config)] = values

    def flag(self, rank: int, program: int, sender: int) -> int:
        return int(self.flags[rank].view(-1, WORLD)[program, sender])


def _sum(parts: list[torch.Tensor]) -> torch.Tensor:
    """The flag one-shot's sum: float32 in rank order, to bf16 as the interpreter converts
    (it truncates; the GPU rounds to nearest, and the GPU test compares there)."""
    total = sum(p.float() for p in parts)
    return (total.view(torch.int32) >> 16).to(torch.int16).view(DT)


def _case(seed: int, n: int, k: int, silu: bool):
    """Each rank's x slice [1, K] (or gate | up), weight slice [N, K], and the residual."""
    g = torch.Generator().manual_seed(seed)
    xs = [torch.randn(1, 2 * k if silu else k, generator=g).to(DT) for _ in range(WORLD)]
    ws = [(0.1 * torch.randn(n, k, generator=g)).to(DT) for _ in range(WORLD)]
    return xs, ws, torch.randn(1, n, generator=g).to(DT)


@pytest.mark.parametrize("silu", [False, True])
@pytest.mark.parametrize("config", [(8, 32, 4, 0), (4, 16, 4, 1)])  # 1 and 4 blocks a program
def test_two_ranks_sum_like_gemv_then_all_reduce(config, silu):
    n, k = 64, 32
    pair = Pair()
    grid, iters = launch_grid(n, config, SMS)
    assert grid * iters == n // config[0] and (iters > 1) == (config[3] == 1)
    for call in range(3):  # areas alternate slots; the counters and flags advance
        e, slot = call + 1, (call + 1) % 2
        xs, ws, res = _case(call, n, k, silu)
        parts = [triton_gemv.gemv(xs[r], ws[r], silu_mul=silu, config=config,
                                  residual=res if r == 0 else None) for r in range(WORLD)]
        want = _sum(parts)
        # rank 1's push, staged: its partial in rank 0's inbox and its flag per program
        pair.stage(0, slot, 1, parts[1][0], config)
        pair.flags[0].view(-1, WORLD)[:grid, 1] = e
        got0 = pair.ranks[0](xs[0], ws[0], config, silu_mul=silu, residual=res)
        assert torch.equal(got0, want)
        assert torch.equal(pair.pushed(1, slot, 0, n, config), parts[0][0])  # rank 0's push
        assert all(pair.flag(1, g, 0) == e for g in range(grid))
        assert pair.flag(1, grid, 0) == 0  # programs past the grid raise nothing
        assert pair.ranks[0].count[:grid].eq(e).all() and pair.ranks[0].count[grid] == 0
        got1 = pair.ranks[1](xs[1], ws[1], config, silu_mul=silu)  # on rank 0's real push
        assert torch.equal(got1, want)
        assert torch.equal(pair.pushed(0, slot, 1, n, config), parts[1][0])
        assert pair.ranks[1].count[:grid].eq(e).all()


def test_a_peer_one_call_ahead_leaves_this_calls_slot_alone():
    """Rank 1 may finish call e + 1 before rank 0 reads call e: its flag reads e + 1 and its
    call-e + 1 values sit in the other slot; rank 0 still sums call e's."""
    n, k, config = 64, 32, (8, 32, 4, 0)
    pair = Pair()
    grid, _ = launch_grid(n, config, SMS)
    xs, ws, res = _case(7, n, k, False)
    part1 = triton_gemv.gemv(xs[1], ws[1], config=config)
    pair.stage(0, 1, 1, part1[0], config)  # call 1 in slot 1
    pair.stage(0, 0, 1, torch.full((n,), 1000.0, dtype=DT), config)  # call 2, ahead
    pair.flags[0].view(-1, WORLD)[:grid, 1] = 2
    got = pair.ranks[0](xs[0], ws[0], config, residual=res)
    part0 = triton_gemv.gemv(xs[0], ws[0], config=config, residual=res)
    assert torch.equal(got, _sum([part0, part1]))


def test_launch_grid_keeps_the_config_grid_within_its_areas():
    assert launch_grid(4096, (2, 2048, 4, 0), 132) == (2048, 1)  # one block a program
    assert launch_grid(4096, (1, 4096, 4, 0), 132) == (2048, 2)  # G_MAX programs at most
    assert launch_grid(4096, (8, 512, 4, 4), 132) == (512, 1)
    assert launch_grid(14336, (16, 512, 8, 1), 132) == (132, 7)
    assert launch_grid(65536, (16, 512, 8, 1), 132) is None  # 32 blocks of 16 > AREA


def test_the_flag_one_shot_kernel_sums_like_the_fused_one():
    """The production flag one-shot (kernels/triton_allreduce.py), which shares the fused
    kernel's flag meeting and rank-order sum, run the same way: rank 0 with rank 1's push
    staged, then rank 1 on what rank 0 pushed; both return the rank-order sum."""
    from tandem.engine.kernels import triton_allreduce as ar

    n, slot, programs = 300, 512, ar.PROGRAMS
    inbox = [torch.zeros(2 * WORLD * slot, dtype=DT) for _ in range(WORLD)]
    flags = [torch.zeros(programs * WORLD, dtype=torch.int64) for _ in range(WORLD)]
    bufs = torch.tensor([t.data_ptr() for t in inbox], dtype=torch.int64)
    flag_ptrs = torch.tensor([t.data_ptr() for t in flags], dtype=torch.int64)
    counts = [torch.zeros(programs, dtype=torch.int64) for _ in range(WORLD)]
    g = torch.Generator().manual_seed(3)
    xs = [torch.randn(n, generator=g).to(DT) for _ in range(WORLD)]
    block, iters = ar.launch_shape(n)

    def call(rank: int) -> torch.Tensor:
        out = torch.empty(n, dtype=DT)
        ar._one_shot_kernel[(programs,)](xs[rank], out, bufs, flag_ptrs, counts[rank], n, slot,
                                         RANK=rank, WORLD=WORLD, BLOCK=block, ITERS=iters)
        return out

    inbox[0].view(2, WORLD, slot)[1, 1, :n] = xs[1]  # call 1: slot 1, rank 1's region
    flags[0].view(-1, WORLD)[:, 1] = 1
    want = _sum(xs)
    assert torch.equal(call(0), want)
    assert torch.equal(inbox[1].view(2, WORLD, slot)[1, 0, :n], xs[0])  # rank 0's push
    assert torch.equal(call(1), want)
    assert counts[0].eq(1).all() and counts[1].eq(1).all()
