"""A row-parallel TP projection and its all-reduce in one launch, for one row of x (decode
at batch 1, the draft head's steps).

Under TP a row-parallel projection (o_proj, down) is a GEMV of this rank's input slice
followed by a sum over the ranks. Run as two launches (`gemv_kernel`, then the flag one-shot
all-reduce of kernels/triton_allreduce.py), the all-reduce costs a launch and a flag round
trip (~5 us on 2 H100s, 64 calls per 8B step). Here the GEMV's programs push their rows
straight into the peers' inboxes as they finish them, and sum after one flag exchange:

- program g computes its row blocks g, g + G, ... (`gemv_block`: the one-row kernel's math,
  config and grid), stores each block's value (rounded to the output dtype: this rank's
  partial, rank 0's with the residual added) into its own `out` and into its area of every
  peer's inbox (NVLink writes): inbox [G_MAX, 2, W, AREA], area (g, slot e % 2, this rank),
  where e is program g's call number (its counter [G_MAX] int64 + 1);
- then it raises flag [g, rank] to e at every peer (release, system scope, after a CTA
  barrier), waits until its own flags [g, p] reach e (acquire), and sums every rank's value
  of its rows in rank order in float32, into `out` -- the flag one-shot's sum, so the result
  equals `gemv` + that all-reduce bit for bit when both run the same config -- and stores e
  as its counter.
- Why per program: every rank runs the same calls with the same grids, so program g's counter
  agrees across ranks, and no program waits on another's bookkeeping (a shared counter cost
  an atomic per program at the end of every call). Program g's area alternates slots call
  by call; peer program g can run at most one of its calls ahead (its next one waits for
  this rank's program g), so it never rewrites an area this rank still reads (the
  triton_allreduce argument, per program). Flags only grow (`>= e`).
- Every program pushes all its blocks before it waits, so no program waits on its own rank.
  Programs past the resident ones start as earlier ones finish, in order, on both GPUs, and
  an earlier program's peer has pushed before it waits. The ranks must launch the same
  config (per-program areas and flags): it is agreed over the group at first use
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
from tandem.engine.kernels.triton_allreduce import meet_peers, sum_in_rank_order

G_MAX = 2048  # programs a call may launch (flags, counters and inbox areas per program)
AREA = 256  # elements a program pushes per call, at most (its blocks x BLOCK_N)


@triton.jit
def _gemv_ar_kernel(
    x_ptr, w_ptr, out_ptr, norm_ptr, res_ptr, n_rows, n_cols, stride_w, eps,
    bufs_ptr, flags_ptr, count_ptr,
    RANK: tl.constexpr, WORLD: tl.constexpr, AREA_ELEMS: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, NUM_K: tl.constexpr, ITERS: tl.constexpr, EVEN: tl.constexpr,
    NORM: tl.constexpr, SILU_MUL: tl.constexpr, RESIDUAL: tl.constexpr,
):
    pid = tl.program_id(0)
    grid = tl.num_programs(0)
    e = tl.load(count_ptr + pid) + 1  # this program's call number (int64)
    dtype = out_ptr.dtype.element_ty
    area = (pid * 2 + e % 2) * WORLD * AREA_ELEMS  # area (pid, slot e % 2, sender 0)
    offs = tl.arange(0, BLOCK_N)
    for it in range(ITERS):
        part, rows, rmask = gemv_block(
            x_ptr, w_ptr, norm_ptr, res_ptr, n_rows, n_cols, stride_w, eps, pid + it * grid,
            BLOCK_N, BLOCK_K, NUM_K, EVEN, NORM, SILU_MUL, RESIDUAL)
        part = part.to(dtype)
        tl.store(out_ptr + rows, part, mask=rmask)
        for p in tl.static_range(WORLD):
            if p != RANK:
                inbox = tl.load(bufs_ptr + p).to(tl.pointer_type(dtype))
                tl.store(inbox + area + RANK * AREA_ELEMS + it * BLOCK_N + offs, part,
                         mask=rmask)
    meet_peers(flags_ptr, pid, e, RANK, WORLD)  # the flag exchange of the flag one-shot
    mine = tl.load(bufs_ptr + RANK).to(tl.pointer_type(dtype)) + area
    for it in range(ITERS):
        rows = (pid + it * grid) * BLOCK_N + offs
        rmask = rows < n_rows
        acc = sum_in_rank_order(out_ptr + rows, mine + it * BLOCK_N + offs, AREA_ELEMS, rmask,
                                RANK, WORLD)  # the flag one-shot's sum
        tl.store(out_ptr + rows, acc.to(dtype), mask=rmask)
    tl.store(count_ptr + pid, e)


def launch_grid(n_rows: int, config: Config, sm_count: int) -> tuple[int, int] | None:
    """(grid, iters) of the fused kernel for an [n_rows]-row weight under `config` -- the
    one-row kernel's grid, spread over at most G_MAX programs --, or None when a program's
    share passes its AREA (the caller then runs the GEMV and the all-reduce apart)."""
    block_n, _, _, per_sm = config
    blocks = triton.cdiv(n_rows, block_n)
    grid = min(blocks, per_sm * sm_count) if per_sm else blocks
    if grid > G_MAX:
        grid = triton.cdiv(blocks, triton.cdiv(blocks, G_MAX))
    iters = triton.cdiv(blocks, grid)
    return (grid, iters) if iters * block_n <= AREA else None


def area_offsets(n_rows: int, config: Config, sm_count: int, slot: int, sender: int,
                 world: int) -> torch.Tensor:
    """[n_rows] int64: where each row of `sender`'s push lies in a flat inbox (for tests)."""
    grid, _ = launch_grid(n_rows, config, sm_count)
    block_n = config[0]
    rows = torch.arange(n_rows)
    block = rows // block_n
    program, it = block % grid, block // grid
    return (((program * 2 + slot) * world + sender) * AREA + it * block_n + rows % block_n)


class GemvAllReduce:
    """The inboxes, flags and call counter of one TP group's fused GEMV all-reduce (module
    docstring). `build` makes them collectively (symmetric memory); the constructor takes
    ready tensors (the CPU tests' stand-ins). Calls are capturable in CUDA graphs and must be
    issued in the same order, with the same configs, on every rank, on one stream."""

    def __init__(self, rank: int, world: int, inbox: torch.Tensor, bufs: torch.Tensor,
                 flag_ptrs: torch.Tensor, sm_count: int, keep: tuple = ()) -> None:
        assert inbox.numel() == G_MAX * 2 * world * AREA  # [G_MAX, 2, W, AREA]
        self.rank, self.world = rank, world
        self.dtype, self.device = inbox.dtype, inbox.device
        self.bufs, self.flag_ptrs = bufs, flag_ptrs  # [W] int64 each: every rank's address
        self.sm_count = sm_count
        self.count = torch.zeros(G_MAX, dtype=torch.int64, device=self.device)  # [G_MAX]
        self._keep = (inbox, *keep)

    @classmethod
    def build(cls, group_name: str, world: int, device: torch.device, dtype: torch.dtype,
              sm_count: int) -> GemvAllReduce:
        """Collective: every rank of the group at once (two symmetric-memory rendezvous)."""
        import torch.distributed._symmetric_memory as symm_mem

        inbox = symm_mem.empty(G_MAX * 2 * world * AREA, dtype=dtype, device=device)
        inbox_h = symm_mem.rendezvous(inbox, group_name)
        flags = symm_mem.empty(G_MAX * world, dtype=torch.int64, device=device)
        flags.zero_()  # [G, W]: program g's flag from rank p at [g, p]
        torch.cuda.synchronize(device)
        flags_h = symm_mem.rendezvous(flags, group_name)
        inbox_h.barrier()  # every rank's flags are zero before anyone signals
        bufs = torch.tensor(inbox_h.buffer_ptrs, dtype=torch.int64, device=device)
        flag_ptrs = torch.tensor(flags_h.buffer_ptrs, dtype=torch.int64, device=device)
        return cls(inbox_h.rank, world, inbox, bufs, flag_ptrs, sm_count,
                   keep=(flags, inbox_h, flags_h))

    def fits(self, n_rows: int, config: Config) -> bool:
        return n_rows > 0 and launch_grid(n_rows, config, self.sm_count) is not None

    def __call__(
        self, x: torch.Tensor, weight: torch.Tensor, config: Config, *,
        norm_weight: torch.Tensor | None = None, eps: float = 0.0, silu_mul: bool = False,
        residual: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """sum over the group of weight @ prologue(x) (+ residual where given: rank 0's),
        [1, N] new, in this group's dtype. x [1, K] ([1, 2K] gate | up with silu_mul)."""
        n_rows, n_cols = weight.shape
        assert x.dim() == 2 and x.shape[0] == 1 and x.is_contiguous()
        assert weight.stride(1) == 1 and x.shape[1] == (2 * n_cols if silu_mul else n_cols)
        assert residual is None or (residual.shape == (1, n_rows) and residual.is_contiguous())
        out = torch.empty(1, n_rows, dtype=self.dtype, device=x.device)
        block_n, block_k, warps, _ = config
        shape = launch_grid(n_rows, config, self.sm_count)
        assert shape is not None, ("gemv all-reduce: config past its area", n_rows, config)
        grid, iters = shape
        _gemv_ar_kernel[(grid,)](
            x, weight, out, norm_weight if norm_weight is not None else x,
            residual if residual is not None else out, n_rows, n_cols, weight.stride(0), eps,
            self.bufs, self.flag_ptrs, self.count,
            RANK=self.rank, WORLD=self.world, AREA_ELEMS=AREA, BLOCK_N=block_n, BLOCK_K=block_k,
            NUM_K=triton.cdiv(n_cols, block_k), ITERS=iters,
            EVEN=(n_rows % block_n == 0 and n_cols % block_k == 0 and grid * iters
                  == triton.cdiv(n_rows, block_n)),
            NORM=norm_weight is not None, SILU_MUL=silu_mul, RESIDUAL=residual is not None,
            num_warps=warps,
        )
        return out
