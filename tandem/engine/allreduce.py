"""All-reduce of small TP messages over NVLink through torch symmetric memory, next to NCCL.

A TP decode step all-reduces two [batch, hidden] activations per layer; at batch 1 that is
8 KiB, where NCCL's fixed cost (~10-20 us a call) is most of the collective. Symmetric memory
lets a kernel read its peers' buffers directly over NVLink:

- one-shot: each rank copies its input into its own symmetric buffer, all ranks meet at a
  barrier, and each reads every peer's buffer and sums (one NVLink read of the whole message
  per peer; fused with the copy in `one_shot_all_reduce_copy_out`).
- two-shot: each rank reduces its 1/W slice from every peer, then every rank gathers the
  reduced slices (reduce-scatter + all-gather; less NVLink traffic for larger messages).
- flag one-shot (kernels/triton_allreduce.py, up to 1 MiB): our own one-shot in one Triton
  launch that pushes its input into every peer's inbox and meets its peers once per call (a
  flag per program and peer, two inbox slots used in turn) instead of torch's two barriers
  and remote reads.

Each op starts and ends with a barrier over the group's signal pads, so one buffer serves
every call in stream order (the next call's copy cannot overwrite data a peer still reads).
Multicast (multimem) ops are never used: NVLink multicast stays off on these machines.

Which method runs is chosen per message size BY MEASUREMENT at start-up: `measure` times NCCL
and each custom method inside CUDA graphs (how decode runs) at the sizes the engine will send,
the ranks take the slowest rank's time of each (an all-reduce MAX: every rank must choose the
same method for the same message, or the collectives would not meet), and `choose_methods`
keeps the fastest. The resulting `MethodTable` is frozen, logged, and kept on the
`FastAllReduce` that owns the buffer. On the CPU (gloo), with TP 1, under DP attention, or when
`EngineConfig.all_reduce` is "nccl", nothing is set up and `ParallelGroup.all_reduce` is NCCL
(or gloo) as before.

torch.distributed._symmetric_memory is imported lazily (GPU-only).
"""

from __future__ import annotations

import bisect
import dataclasses
import logging
import math
import os
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from tandem.engine.graph_timing import graph_us
from tandem.engine.parallel import ParallelContext, ParallelGroup

log = logging.getLogger(__name__)

NCCL, ONE_SHOT, TWO_SHOT = "nccl", "one_shot", "two_shot"
FLAG_ONE_SHOT = "flag_one_shot"  # kernels/triton_allreduce.py: one flag exchange per call
METHODS = (NCCL, ONE_SHOT, TWO_SHOT, FLAG_ONE_SHOT)  # NCCL first: it wins ties
MODES = ("auto", *METHODS)  # EngineConfig.all_reduce: "auto" measures; a method forces it
MAX_BYTES = 8 << 20  # symmetric buffer per rank; larger messages always take NCCL
FLAG_MAX_BYTES = 1 << 20  # the flag one-shot's slots (two per rank); larger: other methods
# kernels/triton_gemv_ar.py: a one-row row-parallel GEMV and its all-reduce in one launch,
# where the table takes the flag one-shot for the product's size. Opt-in (=1) until measured.
GEMV_AR_ENV = "TANDEM_GEMV_AR"
ALIGN = 16  # bytes: the symm_mem kernels' vector width; smaller alignments are not offered
CUSTOM_DTYPES = (torch.bfloat16, torch.float32)  # what the symm_mem reduce kernels support


@dataclass(frozen=True, slots=True, kw_only=True)
class MethodTable:
    """The measured cost of each method at each message size, and the method each size takes.

    A message of n bytes takes the choice of the smallest measured size >= n; a message larger
    than every measured size takes NCCL (the buffer may not hold it, and nothing says a custom
    method wins there). Identical on every rank of the group."""

    sizes: tuple[int, ...]  # ascending message sizes, bytes
    methods: tuple[str, ...]  # the columns of `us`
    us: tuple[tuple[float, ...], ...]  # [len(sizes)][len(methods)] us per call (inf: failed)
    chosen: tuple[str, ...]  # [len(sizes)] the method each size takes

    def __post_init__(self) -> None:
        if list(self.sizes) != sorted(set(self.sizes)) or any(s <= 0 for s in self.sizes):
            raise ValueError(f"sizes: must be positive and strictly ascending, got {self.sizes}")
        unknown = set(self.methods) - set(METHODS)
        if unknown or len(set(self.methods)) != len(self.methods):
            raise ValueError(f"methods: {self.methods} (known: {METHODS})")
        if len(self.us) != len(self.sizes) or any(len(r) != len(self.methods) for r in self.us):
            raise ValueError(f"us: need {len(self.sizes)} rows of {len(self.methods)} timings")
        if len(self.chosen) != len(self.sizes) or set(self.chosen) - set(METHODS):
            raise ValueError(f"chosen: need one known method per size, got {self.chosen}")

    def method_for(self, nbytes: int) -> str:
        i = bisect.bisect_left(self.sizes, nbytes)
        return self.chosen[i] if i < len(self.sizes) else NCCL

    @property
    def max_custom_bytes(self) -> int:
        """The largest measured size that takes a custom method (0: none does)."""
        return max((s for s, m in zip(self.sizes, self.chosen) if m != NCCL), default=0)

    def describe(self) -> str:
        head = "bytes".rjust(9) + "".join(m.rjust(10) for m in self.methods) + "  chosen"
        rows = [f"{s:9d}" + "".join(f"{t:10.1f}" for t in r) + f"  {c}"
                for s, r, c in zip(self.sizes, self.us, self.chosen)]
        return "\n".join([head + "  (us per call, CUDA graph)", *rows])


def choose_methods(sizes: Sequence[int], methods: Sequence[str],
                   us: Sequence[Sequence[float]], mode: str = "auto") -> MethodTable:
    """The table from timings: "auto" takes the fastest finite method of each size (ties go to
    the earlier column, NCCL first); a forced method is taken wherever it ran (finite), NCCL
    elsewhere. A non-finite time means the method failed or is unavailable at that size."""
    if mode not in MODES:
        raise ValueError(f"mode: '{mode}' is not one of {', '.join(MODES)}")
    if NCCL not in methods:
        raise ValueError("methods: NCCL must be measured (it is the fallback)")
    chosen = []
    for row in us:
        finite = [(t, i) for i, t in enumerate(row) if math.isfinite(t)]
        if mode == "auto":
            chosen.append(methods[min(finite)[1]] if finite else NCCL)
        else:
            ok = mode in methods and math.isfinite(row[methods.index(mode)])
            chosen.append(mode if ok else NCCL)
    return MethodTable(sizes=tuple(sizes), methods=tuple(methods),
                       us=tuple(tuple(float(t) for t in r) for r in us), chosen=tuple(chosen))


def message_sizes(hidden: int, itemsize: int, token_counts: Sequence[int],
                  max_bytes: int = MAX_BYTES) -> tuple[int, ...]:
    """The all-reduce sizes a model of `hidden` sends for these token counts ([T, hidden]
    activations), plus every power-of-two token count, capped at max_bytes, ascending."""
    row = hidden * itemsize
    counts = set(token_counts) | {1 << k for k in range(31) if (1 << k) * row <= max_bytes}
    return tuple(sorted({n * row for n in counts if 0 < n * row <= max_bytes}))


def custom_eligible(dtype: torch.dtype, buffer_dtype: torch.dtype, nbytes: int,
                    offset_bytes: int, contiguous: bool, max_bytes: int) -> bool:
    """Whether a message may take a custom method at all (else NCCL): the buffer's dtype, a
    contiguous tensor whose start and size are ALIGN-byte aligned, at most max_bytes. Every
    rank sends the same shapes, so every rank decides alike."""
    return (dtype == buffer_dtype and contiguous and 0 < nbytes <= max_bytes
            and nbytes % ALIGN == 0 and offset_bytes % ALIGN == 0)


class FastAllReduce:
    """Owns one symmetric-memory buffer [max_bytes] of `dtype` per rank, rendezvoused over a
    TP group, and the `MethodTable` that says which messages use it.

    Invariants: the buffer never moves (CUDA graphs captured over it stay valid); it is used in
    stream order only (one stream: the engine's); the table is set once, at start-up, and is
    the same on every rank. `all_reduce` returns a new tensor and never writes its input."""

    def __init__(self, group: ParallelGroup, device: torch.device, dtype: torch.dtype,
                 max_bytes: int = MAX_BYTES) -> None:
        # No multimem op runs here, so the buffer needs no NVLink multicast object: keep torch
        # from creating one (cuMulticastCreate) -- multicast can take a shared host's GPUs out
        # of service (the device machines keep it off; so does this, wherever it runs).
        os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"
        import torch.distributed._symmetric_memory as symm_mem

        self.group, self.device, self.dtype = group, device, dtype
        self.max_bytes = max_bytes - max_bytes % ALIGN
        self.group_name: str = group.handle.group_name
        enable = getattr(symm_mem, "enable_symm_mem_for_group", None)
        if enable is not None:  # needed by older torch; deprecated (a no-op) by newer
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)
                enable(self.group_name)
        itemsize = torch.empty((), dtype=dtype).element_size()
        self._buffer = symm_mem.empty(self.max_bytes // itemsize, dtype=dtype,  # [N] dtype
                                      device=device)
        symm_mem.rendezvous(self._buffer, self.group_name)
        ops = torch.ops.symm_mem
        self._has_copy_op = hasattr(ops, "one_shot_all_reduce_copy_out")
        self._has_two_shot_out = hasattr(ops, "two_shot_all_reduce_out")
        self._flag = self._build_flag_one_shot(min(self.max_bytes, FLAG_MAX_BYTES))
        self._gemv_ar = (self._build_gemv_all_reduce()
                         if os.environ.get(GEMV_AR_ENV, "0") == "1" else None)
        self._gemv_ar_configs: dict[tuple, tuple[int, ...]] = {}  # agreed over the group
        self.table: MethodTable | None = None

    def _build_flag_one_shot(self, max_bytes: int) -> Any:
        """The flag one-shot's buffers (collective), or None where Triton is missing (on every
        rank alike: one image per machine)."""
        try:
            from tandem.engine.kernels.triton_allreduce import OneShot
        except ImportError as exc:
            log.warning("flag one-shot all-reduce unavailable: %s", exc)
            return None
        return OneShot(self.group_name, self.group.size, self.device, self.dtype, max_bytes)

    def _build_gemv_all_reduce(self) -> Any:
        """The fused GEMV all-reduce's buffers (collective), or None without Triton."""
        try:
            from tandem.engine.kernels.triton_gemv import sm_count
            from tandem.engine.kernels.triton_gemv_ar import GemvAllReduce
        except ImportError as exc:
            log.warning("fused GEMV all-reduce unavailable: %s", exc)
            return None
        return GemvAllReduce.build(self.group_name, self.group.size, self.device, self.dtype,
                                   sm_count(self.device))

    def gemv_all_reduce(self, x: torch.Tensor, weight: torch.Tensor, *, silu_mul: bool,
                        residual: torch.Tensor | None) -> torch.Tensor | None:
        """sum over the group of weight @ prologue(x) (+ residual, given on rank 0 only) in one
        launch (kernels/triton_gemv_ar.py), for x [1, K] where the table takes the flag
        one-shot for the [1, N] result; None elsewhere (the caller runs the GEMV and
        `all_reduce`). The first call of a shape agrees its config over the group (rank 0's
        one-row choice, broadcast): eager, at warm-up, never inside a capture."""
        fused = self._gemv_ar
        n_rows = weight.shape[0]
        if (fused is None or self.table is None or x.shape[0] != 1 or x.dtype != self.dtype
                or weight.dtype != self.dtype
                or self.table.method_for(n_rows * x.element_size()) != FLAG_ONE_SHOT):
            return None
        key = (tuple(weight.shape), silu_mul)  # the same on every rank (residual is not)
        config = self._gemv_ar_configs.get(key)
        if config is None:
            config = self._agree_config(key, x, weight, silu_mul, residual)
        if not fused.fits(n_rows, config):  # alike on every rank: the config is agreed
            return None
        return fused(x, weight, config, silu_mul=silu_mul, residual=residual)

    def _agree_config(self, key: tuple, x: torch.Tensor, weight: torch.Tensor,
                      silu_mul: bool, residual: torch.Tensor | None) -> tuple[int, ...]:
        import torch.distributed as dist

        from tandem.engine.kernels.triton_gemv import one_row_choice

        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"gemv all-reduce {key}: config not agreed before CUDA graph "
                               "capture")
        mine = (one_row_choice(x, weight, silu_mul=silu_mul, residual=residual)
                if self.group.rank == 0 else (0, 0, 0, 0))
        agreed = torch.tensor(mine, dtype=torch.int64, device=self.device)
        dist.broadcast(agreed, src=dist.get_global_rank(self.group.handle, 0),
                       group=self.group.handle)
        config = tuple(int(v) for v in agreed.tolist())  # SYNC: first call of a shape only
        self._gemv_ar_configs[key] = config
        log.info("fused GEMV all-reduce %s: config %s (rank 0's)", key, config)
        return config

    def set_table(self, table: MethodTable) -> None:
        if self.table is not None:
            raise RuntimeError("FastAllReduce.set_table: the table is set once, at start-up")
        self.table = table

    def method_for(self, x: torch.Tensor) -> str:
        nbytes = x.numel() * x.element_size()
        if self.table is None or not custom_eligible(
                x.dtype, self.dtype, nbytes, x.storage_offset() * x.element_size(),
                x.is_contiguous(), self.max_bytes):
            return NCCL
        return self.table.method_for(nbytes)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor | None:
        """Sum over the group by the table's method for this message; None when that is NCCL
        (the caller runs it)."""
        method = self.method_for(x)
        return None if method == NCCL else self.run(x, method)

    def run(self, x: torch.Tensor, method: str) -> torch.Tensor:
        """Sum of `x` over the group by `method` (benchmarks and `measure` call it directly).
        Capturable: the copy into the buffer is a kernel on the current stream."""
        ops = torch.ops.symm_mem
        out = torch.empty_like(x)
        if method == NCCL:
            import torch.distributed as dist

            out.copy_(x)
            dist.all_reduce(out, group=self.group.handle)
            return out
        if method == FLAG_ONE_SHOT:
            nbytes = x.numel() * x.element_size()
            if self._flag is None or nbytes > self._flag.max_bytes:
                raise RuntimeError(f"flag one-shot: {nbytes} bytes over its "
                                   f"{self._flag.max_bytes if self._flag else 0}-byte slots")
            return self._flag(x)
        buf = self._buffer[: x.numel()].view(x.shape)  # this call's slice of the buffer
        if method == ONE_SHOT:
            if self._has_copy_op and x.storage_offset() == 0:  # the copy fused in the kernel
                return ops.one_shot_all_reduce_copy_out(buf, x, "sum", self.group_name, out)
            buf.copy_(x)
            return ops.one_shot_all_reduce_out(buf, "sum", self.group_name, out)
        if method == TWO_SHOT:
            buf.copy_(x)
            if self._has_two_shot_out:
                return ops.two_shot_all_reduce_out(buf, "sum", self.group_name, out)
            ops.two_shot_all_reduce_(buf, "sum", self.group_name)
            return out.copy_(buf)
        raise ValueError(f"method: '{method}' is not one of {', '.join(METHODS)}")


def time_in_graph(fn: Callable[[], Any], calls: int = 20, replays: int = 7) -> float:
    """Microseconds per call of `fn` replayed from a CUDA graph of `calls` calls (median of
    `replays` replays). `fn` runs twice eagerly first (rendezvous lookups, NCCL set-up)."""
    fn()
    fn()
    return graph_us(fn, calls, replays)


def measure(fast: FastAllReduce, sizes: Sequence[int],
            methods: Sequence[str] = METHODS) -> list[list[float]]:
    """[len(sizes)][len(methods)] us per call in a CUDA graph, the slowest rank's (all ranks
    call this together, with the same sizes). A method that raises gets inf; it raised on
    every rank alike (the same checks on the same shapes) or the run fails at start-up."""
    import torch.distributed as dist

    itemsize = torch.empty((), dtype=fast.dtype).element_size()
    rows = []
    for nbytes in sizes:
        x = torch.randn(nbytes // itemsize, device=fast.device).to(fast.dtype)  # [n] dtype
        row = []
        for method in methods:
            if method == FLAG_ONE_SHOT and nbytes > FLAG_MAX_BYTES:
                row.append(math.inf)  # past its slots: never a candidate, nothing to time
                continue
            try:
                row.append(time_in_graph(lambda m=method: fast.run(x, m)))
            except RuntimeError as exc:
                log.warning("all-reduce %s at %d bytes failed: %s", method, nbytes, exc)
                row.append(math.inf)
        rows.append(row)
    worst = torch.tensor(rows, dtype=torch.float32, device=fast.device)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX, group=fast.group.handle)
    return worst.tolist()


def attach_fast_all_reduce(par: ParallelContext, mode: str, device: torch.device,
                           dtype: torch.dtype, hidden: int, token_counts: Sequence[int]
                           ) -> ParallelContext:
    """`par` with a measured `FastAllReduce` on its TP group (and on EP when EP is the same
    group), or `par` itself when none applies: mode "nccl", no CUDA, TP 1, DP attention, a
    dtype the kernels lack, or symmetric memory failing on any rank (all ranks agree)."""
    if mode not in MODES:
        raise ValueError(f"all_reduce: '{mode}' is not one of {', '.join(MODES)}")
    tp = par.tp
    if (mode == NCCL or device.type != "cuda" or tp.size == 1 or par.dp.size > 1
            or tp.handle is None or dtype not in CUSTOM_DTYPES):
        return par
    import torch.distributed as dist

    fast, error = None, ""
    try:
        fast = FastAllReduce(tp, device, dtype)
    except Exception as exc:  # noqa: BLE001 -- an optional fast path: NCCL serves instead
        error = repr(exc)
    ok = torch.tensor([int(fast is not None)], dtype=torch.int32, device=device)
    dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=tp.handle)
    if not int(ok.item()):  # SYNC: start-up only
        log.warning("custom all-reduce off (NCCL only): symmetric memory failed on a rank %s",
                    error)
        return par
    itemsize = torch.empty((), dtype=dtype).element_size()
    sizes = message_sizes(hidden, itemsize, token_counts, fast.max_bytes)
    table = choose_methods(sizes, METHODS, measure(fast, sizes), mode)
    fast.set_table(table)
    log.info("TP all-reduce (rank %d of %d, mode %s): custom up to %d bytes\n%s", tp.rank,
             tp.size, mode, table.max_custom_bytes, table.describe())
    new_tp = dataclasses.replace(tp, fast=fast)
    ep = new_tp if par.ep is tp or par.ep == tp else par.ep
    return dataclasses.replace(par, tp=new_tp, ep=ep)
