"""A one-shot all-reduce for small TP messages in one Triton launch, with one flag exchange.

torch's symmetric-memory one-shot kernel meets its peers at a barrier before and after the
sum, and reads their inputs across NVLink (~9-10 us for 8 KiB on 2 H100s, slower than NCCL's
8.6 us in a CUDA graph). This one pushes instead and meets its peers once per call:

- every rank owns, in symmetric memory, an inbox of two slots, one region per sender
  [2, W, slot_elems], and a flag area [G, W] int64 (program g's flag from rank p at [g, p]),
  and, in ordinary device memory, one call counter per program [G] int64. All G programs run
  in every call.
- program g of call e (its counter + 1) writes its range of the input into region `rank` of
  slot e % 2 of every peer's inbox (NVLink writes, no round trip), then stores e into flag
  [g, rank] of every peer (release, system scope, after a CTA barrier: cumulativity publishes
  every thread's writes), waits until its own flags [g, p] reach e (acquire; a local poll),
  reads the peers' regions from its own inbox and sums every rank's values in rank order in
  float32 (so every rank rounds the same sum the same way), and stores e as its counter.

Why two slots and one exchange suffice: a rank writes slot e % 2 of a peer's inbox in call e
only after its call e - 1 ended, which waited for that peer's flag e - 1; the peer raises it
in its call e - 1, which starts after its call e - 2 (the last reader of slot e % 2) completed
(one stream, kernels in order). A peer can run at most one call ahead (its next call waits for
this rank's flag), so flags only grow and `>= e` never misses. Every program runs in every
call, so all counters agree; they are int64 (no wrap in any realistic uptime).

The grid, the block and the per-program range depend on the message size only, which every
rank sends alike. GPU only (imported lazily by engine/allreduce.py); its checks are
tests/gpu/test_tp_graphs.py (every method's sum == NCCL's, bitwise, and graph == eager) and
benchmarks/gpu_tp.py's flag_stress (mixed sizes replayed in a graph, bitwise vs NCCL).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tandem.engine.kernels import pdl

PROGRAMS = 16  # G: programs of every call (flags and counters are per program)
MAX_BLOCK = 2048  # elements a program moves per iteration


@triton.jit
def meet_peers(flags_ptr, pid, e, RANK: tl.constexpr, WORLD: tl.constexpr):
    """Program `pid`'s one meeting of call e: after a CTA barrier (every thread's pushes
    before the release), raise flag [pid, RANK] to e at every peer (release, system scope),
    wait until this rank's flags [pid, p] reach e (acquire), and a CTA barrier again (the
    acquire before any thread reads the inbox). flags_ptr: [W] addresses of each rank's
    [G, W] int64 flags."""
    tl.debug_barrier()
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
    tl.debug_barrier()


@triton.jit
def sum_in_rank_order(own_ptrs, peer_ptrs, peer_stride, mask, RANK: tl.constexpr,
                      WORLD: tl.constexpr):
    """float32 sum of one block over the ranks, in rank order (so every rank rounds the same
    sum the same way): this rank's values at own_ptrs, rank p's at peer_ptrs + p * peer_stride
    (its region of this rank's inbox, read past L1: a peer wrote it)."""
    acc = tl.zeros(own_ptrs.shape, dtype=tl.float32)
    for p in tl.static_range(WORLD):
        if p == RANK:
            v = tl.load(own_ptrs, mask=mask, other=0.0)
        else:
            v = tl.load(peer_ptrs + p * peer_stride, mask=mask, other=0.0, cache_modifier=".cg")
        acc += v.to(tl.float32)
    return acc


@triton.jit
def _one_shot_kernel(
    x_ptr, out_ptr, bufs_ptr, flags_ptr, count_ptr, n, slot_elems,
    RANK: tl.constexpr, WORLD: tl.constexpr, BLOCK: tl.constexpr, ITERS: tl.constexpr,
    PDL: tl.constexpr = False,
):
    if PDL:  # launched as a programmatic dependent (kernels/pdl.py): the input is ready after
        tl.extra.cuda.gdc_wait()
    pid = tl.program_id(0)
    e = tl.load(count_ptr + pid) + 1  # this call's number (int64)
    dtype = x_ptr.dtype.element_ty
    start = pid * (ITERS * BLOCK)
    # region `sender` of slot e % 2 of an inbox [2, W, slot_elems]
    my_region = ((e % 2) * WORLD + RANK) * slot_elems
    for p in tl.static_range(WORLD):
        if p != RANK:
            inbox = tl.load(bufs_ptr + p).to(tl.pointer_type(dtype)) + my_region
            for i in range(ITERS):
                offs = start + i * BLOCK + tl.arange(0, BLOCK)
                m = offs < n
                tl.store(inbox + offs, tl.load(x_ptr + offs, mask=m), mask=m)
    meet_peers(flags_ptr, pid, e, RANK, WORLD)
    mine = tl.load(bufs_ptr + RANK).to(tl.pointer_type(dtype)) + (e % 2) * WORLD * slot_elems
    for i in range(ITERS):
        offs = start + i * BLOCK + tl.arange(0, BLOCK)
        m = offs < n
        acc = sum_in_rank_order(x_ptr + offs, mine + offs, slot_elems, m, RANK, WORLD)
        tl.store(out_ptr + offs, acc.to(dtype), mask=m)
    tl.store(count_ptr + pid, e)


def launch_shape(n: int) -> tuple[int, int]:
    """(BLOCK, ITERS) for n elements over PROGRAMS programs: program g covers
    [g * ITERS * BLOCK, (g + 1) * ITERS * BLOCK) (clipped to n; ranges past n are empty)."""
    per_program = max(1, -(-n // PROGRAMS))
    block = min(MAX_BLOCK, max(128, triton.next_power_of_2(per_program)))
    return block, -(-per_program // block)


class OneShot:
    """The buffers and counters of one TP group's one-shot kernel (see the module docstring).

    Built collectively (every rank of the group at once: two symmetric-memory rendezvous).
    `__call__` is capturable in CUDA graphs and must be issued in the same order on every
    rank, on one stream, like any collective."""

    def __init__(self, group_name: str, world: int, device: torch.device, dtype: torch.dtype,
                 max_bytes: int) -> None:
        import torch.distributed._symmetric_memory as symm_mem

        itemsize = torch.empty((), dtype=dtype).element_size()
        self.dtype, self.slot_elems = dtype, max_bytes // itemsize
        self.max_bytes = self.slot_elems * itemsize
        data = symm_mem.empty(2 * world * self.slot_elems, dtype=dtype,  # [2, W, slot]
                              device=device)
        data_h = symm_mem.rendezvous(data, group_name)
        self.rank, self.world = data_h.rank, data_h.world_size
        assert self.world == world, (self.world, world)
        flags = symm_mem.empty(PROGRAMS * self.world, dtype=torch.int64, device=device)
        flags.zero_()  # [G, W] flags from each rank
        torch.cuda.synchronize(device)
        flags_h = symm_mem.rendezvous(flags, group_name)
        data_h.barrier()  # every rank's flags are zero before anyone signals
        self._keep = (data, flags, data_h, flags_h)
        self.bufs = torch.tensor(data_h.buffer_ptrs, dtype=torch.int64, device=device)  # [W]
        self.flags = torch.tensor(flags_h.buffer_ptrs, dtype=torch.int64, device=device)
        self.counts = torch.zeros(PROGRAMS, dtype=torch.int64, device=device)  # [G]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of x (contiguous, this dtype, at most max_bytes) over the group, new tensor."""
        assert x.dtype == self.dtype and x.is_contiguous() and x.numel() <= self.slot_elems
        out = torch.empty_like(x)
        block, iters = launch_shape(x.numel())
        _one_shot_kernel[(PROGRAMS,)](
            x, out, self.bufs, self.flags, self.counts, x.numel(), self.slot_elems,
            RANK=self.rank, WORLD=self.world, BLOCK=block, ITERS=iters, PDL=pdl.ENABLED,
            num_warps=4, **pdl.launch_options())
        return out
