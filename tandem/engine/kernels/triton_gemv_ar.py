"""A row-parallel TP projection and its all-reduce in one launch, for one row of x (decode
at batch 1, the draft head's steps).

Under TP a row-parallel projection (o_proj, down) is a GEMV of this rank's input slice
followed by a sum over the ranks. Run as two launches (`gemv_kernel`, then the flag one-shot
all-reduce of kernels/triton_allreduce.py), the all-reduce costs a launch and a flag round
trip (~5 us on 2 H100s, 64 calls per 8B step). Here the GEMV's programs push their rows
straight into the peers' inboxes as they finish them, and sum after one flag exchange:

- program g of a persistent grid G computes its row blocks g, g + G, ... (`gemv_block`, the
  one-row kernel's math and config), stores each block's value (rounded to the output dtype:
  this rank's partial, rank 0's with the residual added) into its own `out` and into region
  `rank` of inbox slot e % 2 of every peer (NVLink writes), for call number e;
- then it raises flag [g, rank] to e at every peer (release, system scope, after a CTA
  barrier), waits until its own flags [g, p] reach e (acquire), and sums every rank's value
  of its rows in rank order in float32, into `out` -- the flag one-shot's sum, so the result
  equals `gemv` + that all-reduce bit for bit when both run the same config.
- e is one counter per TP group ([1] int64, local): every program reads it at its start, and
  the last program to finish (a `done` counter) stores e and resets `done`. Every rank runs
  the same calls in the same order, so e agrees; consecutive calls alternate slots, and a
  rank can run at most one call ahead of a peer (its next call waits for the peer's flags),
  so a slot is never rewritten while a peer still reads it (triton_allreduce's argument).
  Flags only grow (`>= e`).
- Every program pushes all its blocks before it waits, so a program never waits for a block
  of its own rank; the grid is capped at a few programs per SM. The ranks must launch the
  same grid (per-program flags): the config is agreed over the group at first use
  (`FastAllReduce.gemv_all_reduce`), never timed per rank.

The buffers are symmetric memory on GPUs (`GemvAllReduce.build`); the CPU tests run the
kernel through the Triton interpreter with ordinary tensors, one rank at a time, the peers'
pushes staged in its inbox (tests/unit/test_gemv_all_reduce.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tandem.engine.kernels.gemv_kernels import gemv_block
from tandem.engine.kernels.gemv_tuning import Config

PROGRAMS_PER_SM = 4  # the grid cap for configs without one of their own (programs per SM)


@triton.jit
def _gemv_ar_kernel(
    x_ptr, w_ptr, out_ptr, norm_ptr, res_ptr, n_rows, n_cols, stride_w, eps,
    bufs_ptr, flags_ptr, count_ptr, done_ptr, slot_elems,
    RANK: tl.constexpr, WORLD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    NUM_K: tl.constexpr, ITERS: tl.constexpr, EVEN: tl.constexpr, NORM: tl.constexpr,
    SILU_MUL: tl.constexpr, RESIDUAL: tl.constexpr,
):
    pid = tl.program_id(0)
    grid = tl.num_programs(0)
    e = tl.load(count_ptr, volatile=True) + 1  # this call's number (int64)
    dtype = out_ptr.dtype.element_ty
    my_region = ((e % 2) * WORLD + RANK) * slot_elems  # region `RANK` of slot e % 2
    for it in range(ITERS):
        part, rows, rmask = gemv_block(
            x_ptr, w_ptr, norm_ptr, res_ptr, n_rows, n_cols, stride_w, eps, pid + it * grid,
            BLOCK_N, BLOCK_K, NUM_K, EVEN, NORM, SILU_MUL, RESIDUAL)
        part = part.to(dtype)
        tl.store(out_ptr + rows, part, mask=rmask)
        for p in tl.static_range(WORLD):
            if p != RANK:
                inbox = tl.load(bufs_ptr + p).to(tl.pointer_type(dtype)) + my_region
                tl.store(inbox + rows, part, mask=rmask)
    tl.debug_barrier()  # every thread's pushes before the release below
    for p in tl.static_range(WORLD):
        if p != RANK:
            peer_flags = tl.load(flags_ptr + p).to(tl.pointer_type(tl.int64))
            tl.atomic_xchg(peer_flags + pid * WORLD + RANK, e, sem="release", scope="sys")
    my_flags = tl.load(flags_ptr + RANK).to(tl.pointer_type(tl.int64))
    for p in tl.static_range(WORLD):
        if p != RANK:
            seen = tl.atomic_add(my_flags + pid * WORLD + p, 0, sem="acquire", scope="sys")
            while seen < e:
                seen = tl.atomic_add(my_flags + pid * WORLD + p, 0, sem="acquire",
                                     scope="sys")
    tl.debug_barrier()  # the acquire above before any thread reads the inbox
    mine = tl.load(bufs_ptr + RANK).to(tl.pointer_type(dtype)) + (e % 2) * WORLD * slot_elems
    for it in range(ITERS):
        rows = (pid + it * grid) * BLOCK_N + tl.arange(0, BLOCK_N)
        rmask = rows < n_rows
        acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        for p in tl.static_range(WORLD):
            if p == RANK:
                v = tl.load(out_ptr + rows, mask=rmask, other=0.0)
            else:
                v = tl.load(mine + p * slot_elems + rows, mask=rmask, other=0.0,
                            cache_modifier=".cg")
            acc += v.to(tl.float32)
        tl.store(out_ptr + rows, acc.to(dtype), mask=rmask)
    if tl.atomic_add(done_ptr, 1) == grid - 1:  # the last program: e is this call's number
        tl.store(count_ptr, e)
        tl.store(done_ptr, 0)


def launch_grid(n_rows: int, config: Config, sm_count: int) -> tuple[int, int]:
    """(grid, iters) of the fused kernel for an [n_rows]-row weight under `config`: at most
    the config's programs per SM (PROGRAMS_PER_SM for a config without), the fewest blocks
    per program, spread evenly (grid * iters == blocks where iters divides them: no masked
    weight loads)."""
    block_n, _, _, per_sm = config
    blocks = triton.cdiv(n_rows, block_n)
    iters = triton.cdiv(blocks, (per_sm or PROGRAMS_PER_SM) * sm_count)
    return triton.cdiv(blocks, iters), iters


class GemvAllReduce:
    """The inboxes, flags and call counter of one TP group's fused GEMV all-reduce (module
    docstring). `build` makes them collectively (symmetric memory); the constructor takes
    ready tensors (the CPU tests' stand-ins). Calls are capturable in CUDA graphs and must be
    issued in the same order, with the same configs, on every rank, on one stream."""

    def __init__(self, rank: int, world: int, inbox: torch.Tensor, bufs: torch.Tensor,
                 flag_ptrs: torch.Tensor, max_programs: int, sm_count: int,
                 keep: tuple = ()) -> None:
        self.rank, self.world = rank, world
        self.dtype, self.device = inbox.dtype, inbox.device
        self.slot_elems = inbox.numel() // (2 * world)  # inbox [2, W, slot_elems]
        self.bufs, self.flag_ptrs = bufs, flag_ptrs  # [W] int64 each: every rank's address
        self.max_programs, self.sm_count = max_programs, sm_count
        self.count = torch.zeros(1, dtype=torch.int64, device=self.device)  # last call's e
        self.done = torch.zeros(1, dtype=torch.int32, device=self.device)  # programs done
        self._keep = (inbox, *keep)

    @classmethod
    def build(cls, group_name: str, world: int, device: torch.device, dtype: torch.dtype,
              max_elems: int, sm_count: int) -> GemvAllReduce:
        """Collective: every rank of the group at once (two symmetric-memory rendezvous)."""
        import torch.distributed._symmetric_memory as symm_mem

        max_programs = PROGRAMS_PER_SM * sm_count
        inbox = symm_mem.empty(2 * world * max_elems, dtype=dtype, device=device)
        inbox_h = symm_mem.rendezvous(inbox, group_name)
        flags = symm_mem.empty(max_programs * world, dtype=torch.int64, device=device)
        flags.zero_()  # [G, W]: program g's flag from rank p at [g, p]
        torch.cuda.synchronize(device)
        flags_h = symm_mem.rendezvous(flags, group_name)
        inbox_h.barrier()  # every rank's flags are zero before anyone signals
        bufs = torch.tensor(inbox_h.buffer_ptrs, dtype=torch.int64, device=device)
        flag_ptrs = torch.tensor(flags_h.buffer_ptrs, dtype=torch.int64, device=device)
        return cls(inbox_h.rank, world, inbox, bufs, flag_ptrs, max_programs, sm_count,
                   keep=(flags, inbox_h, flags_h))

    def fits(self, n_rows: int) -> bool:
        return 0 < n_rows <= self.slot_elems

    def __call__(
        self, x: torch.Tensor, weight: torch.Tensor, config: Config, *,
        norm_weight: torch.Tensor | None = None, eps: float = 0.0, silu_mul: bool = False,
        residual: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """sum over the group of weight @ prologue(x) (+ residual where given: rank 0's),
        [1, N] new, in this group's dtype. x [1, K] ([1, 2K] gate | up with silu_mul)."""
        n_rows, n_cols = weight.shape
        assert x.dim() == 2 and x.shape[0] == 1 and x.is_contiguous() and self.fits(n_rows)
        assert weight.stride(1) == 1 and x.shape[1] == (2 * n_cols if silu_mul else n_cols)
        assert residual is None or (residual.shape == (1, n_rows) and residual.is_contiguous())
        out = torch.empty(1, n_rows, dtype=self.dtype, device=x.device)
        block_n, block_k, warps, _ = config
        grid, iters = launch_grid(n_rows, config, self.sm_count)
        assert grid <= self.max_programs, (grid, self.max_programs)
        _gemv_ar_kernel[(grid,)](
            x, weight, out, norm_weight if norm_weight is not None else x,
            residual if residual is not None else out, n_rows, n_cols, weight.stride(0), eps,
            self.bufs, self.flag_ptrs, self.count, self.done, self.slot_elems,
            RANK=self.rank, WORLD=self.world, BLOCK_N=block_n, BLOCK_K=block_k,
            NUM_K=triton.cdiv(n_cols, block_k), ITERS=iters,
            EVEN=(n_rows % block_n == 0 and n_cols % block_k == 0 and grid * iters
                  == triton.cdiv(n_rows, block_n)),
            NORM=norm_weight is not None, SILU_MUL=silu_mul, RESIDUAL=residual is not None,
            num_warps=warps,
        )
        return out
