"""Which launch configuration each GEMV shape runs: the candidates (`CONFIGS` for one row of x,
`ROWS_CONFIGS` for 2..8), this process's choices (each timed once, at the first call of its
shape, the way decode runs it: inside a CUDA graph), and the record of choices that outlives
the process (`choose`, `tuning_file`).

Owns: this process's choice tables (`tuned_configs` shows them) and the tuning files it read or
wrote. `triton_gemv` asks `one_row_config` / `rows_config` and launches what they return."""

from __future__ import annotations

import itertools
import json
import logging
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, NamedTuple

import torch
import triton

from tandem.engine.cache_root import default_cache_root
from tandem.engine.graph_timing import graph_us
from tandem.engine.kernels.gemv_kernels import INTERPRET

log = logging.getLogger(__name__)


# (BLOCK_N, BLOCK_K, num_warps, programs per SM or 0 for one program per row block)
# candidates; the first call of each shape and variant times them all and keeps the fastest.
Config = tuple[int, int, int, int]
# Pruned from a sweep of 17 on an H200 (benchmarks/gpu_micro.py): these won for every Llama-8B
# site, plain and fused; the small-K ones serve SmolLM2-sized rows.
CONFIGS: tuple[Config, ...] = (
    (2, 2048, 4, 0), (4, 2048, 8, 0), (1, 4096, 4, 0), (2, 4096, 8, 0), (8, 512, 4, 0),
    (16, 512, 8, 0), (8, 512, 4, 4), (16, 256, 4, 0), (4, 1024, 4, 0), (32, 256, 8, 0),
)
_best: dict[tuple, Config] = {}  # this process's one-row choices, by shape and variant


class RowsConfig(NamedTuple):
    """A launch of `rows_kernel` (a type of its own: never mistaken for a one-row Config)."""

    block_n: int  # weight rows per program (the grid is cdiv(N, block_n))
    block_k: int  # K per pipelined step
    num_warps: int
    num_stages: int  # software-pipeline depth of the K loop
    # SiLU-and-mul variants: run SiLU-and-mul once as its own kernel and the product on its
    # [M, K] output, instead of in the prologue, where every program recomputes it over all
    # M_PAD rows of the (wide: 14,336 on the 8B shape) input. Ignored by other variants.
    split_silu: bool = False


class FmaConfig(NamedTuple):
    """A launch of `rows_fma_kernel`: the x rows one after another on the CUDA cores, each
    weight tile loaded once (the one-row kernel's tile shapes: few weight rows, long K)."""

    block_n: int
    block_k: int
    num_warps: int


@dataclass(frozen=True, slots=True)
class GridConfig:
    """A launch of `gemv_kernel` over a 2-D grid, program axis 1 the x row: each row is the
    one-row product (bitwise), and each reads the weight itself -- M reads, which for a weight
    that fits the L2 cache are mostly hits after the first. For SmolLM2's narrow weights the
    single-read kernels took ~4.2-5.8 us a projection at M = 5 (H200) where one row takes
    ~2.7: those products are launch-latency bound, not bandwidth bound. (A dataclass, not a
    tuple: equal fields must not make it equal to an FmaConfig in the tuner's tables.)"""

    block_n: int
    block_k: int
    num_warps: int


# Grid candidates only for weights of at most this many bytes: an H100/H200 has 50 MB of L2,
# and a larger weight's M reads would come from HBM (8B-shaped sites: 29-117 MB).
GRID_MAX_WEIGHT_BYTES = 8 << 20


# The sentinel candidate "run the unfused sequence": cuBLAS F.linear with the Triton RMSNorm /
# SiLU-mul kernels and a torch add, what M > 1 ran before `rows_kernel` existed.
UNFUSED: Literal["unfused"] = "unfused"
RowsChoice = RowsConfig | FmaConfig | GridConfig | Literal["unfused"]
# Candidates for 2..8 rows, timed like CONFIGS at the first call of each shape, variant and
# row count. The first is the interpreter's; UNFUSED stays in so a shape where cuBLAS wins
# keeps it. Pruned from a sweep of 44 at M = 5 on an H100 (benchmarks/gpu_micro.py --skinny
# --sweep): the winners of every Llama-8B site, plain and fused (8 warps never won); the
# (8, 128) one is for SmolLM2's narrow rows (N = 576).
ROWS_CONFIGS: tuple[RowsChoice, ...] = (
    RowsConfig(32, 256, 4, 4), RowsConfig(64, 256, 4, 4), RowsConfig(16, 256, 4, 4),
    RowsConfig(64, 256, 4, 3), RowsConfig(128, 128, 4, 3), RowsConfig(16, 128, 4, 5),
    RowsConfig(32, 512, 4, 3), RowsConfig(8, 128, 4, 3),
    # For the down projection (SiLU-mul + residual), whose prologue is the one site where the
    # fused kernel lost to UNFUSED on an H100 (58.7 vs 47.6 us at M = 5, while its plain
    # product took 42.2): the plain winners with SiLU split out. Not yet timed on a GPU.
    RowsConfig(32, 512, 4, 3, True), RowsConfig(64, 256, 4, 4, True),
    # On the CUDA cores, for narrow weights (SmolLM2: on an H200 the tensor-core kernel took
    # ~4.2 us a call at M = 5 where the one-row kernel takes ~2.8, and UNFUSED won gate_up):
    # the tile shapes of the one-row winners there, all of K = 576 / 1536 in one step.
    FmaConfig(4, 1024, 4), FmaConfig(4, 2048, 8), FmaConfig(16, 256, 4),
    # The one-row kernel per row (`GridConfig`), with the one-row winners' tiles for small K:
    # offered for weights of at most GRID_MAX_WEIGHT_BYTES (`rows_candidates`).
    GridConfig(8, 512, 4), GridConfig(16, 256, 4), GridConfig(4, 1024, 4), GridConfig(16, 512, 8),
    UNFUSED,
)
_best_rows: dict[tuple, RowsChoice] = {}  # ... and multi-row ones (the key adds M)


def rows_candidates(weight: torch.Tensor, silu_mul: bool) -> tuple[RowsChoice, ...]:
    """The ROWS_CONFIGS a site times: split SiLU only where there is SiLU, the per-row grid
    only for weights small enough to stay in L2."""
    small = weight.numel() * weight.element_size() <= GRID_MAX_WEIGHT_BYTES
    return tuple(c for c in ROWS_CONFIGS if (silu_mul or not getattr(c, "split_silu", False))
                 and (small or not isinstance(c, GridConfig)))


def one_row_config(key: tuple, launch: Callable, weight: torch.Tensor) -> Config:
    """This process's choice among CONFIGS for one row of x at `key` (timed on first use)."""
    return _best.get(key) or _tune(key, launch, weight, CONFIGS, _best)


def rows_config(key: tuple, launch: Callable, weight: torch.Tensor,
                candidates: tuple[RowsChoice, ...]) -> RowsChoice:
    """This process's choice among `candidates` (of ROWS_CONFIGS) for 2..8 rows at `key`."""
    return _best_rows.get(key) or _tune(key, launch, weight, candidates, _best_rows)


def _tune(key: tuple, launch, weight: torch.Tensor, candidates: tuple, best_of: dict):
    """Time every candidate once per process (the interpreter takes the first) the way decode
    runs it: back to back inside a CUDA graph, cycling through copies of the weight that
    together exceed twice the L2 cache, so that no call finds its weight there (`_copies`).
    (Timing single calls with do_bench picked configs 10% slower in the model.) Records the
    winner in `best_of[key]`. A choice an earlier process made on this kind of GPU is taken
    without timing (`tuning_file`). Syncs the device: warm-up only, never inside a captured
    graph."""
    if INTERPRET or weight.device.type != "cuda":
        best = candidates[0]
    else:
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"gemv {key}: not tuned before CUDA graph capture")

        def time_all() -> dict:
            n = _copies(weight)
            weights = (weight, *(torch.empty_like(weight).normal_(0.0, 0.02)  # freed after
                                 for _ in range(n - 1)))
            times = {}
            for cfg in candidates:
                try:
                    times[cfg] = _graph_time(cfg, launch, weights, calls=max(8, n))
                except triton.runtime.errors.OutOfResources:  # pipeline stages over a
                    continue  # smaller GPU's shared memory: not a candidate there
            return times

        best = choose(key, candidates, time_all, tuning_file(weight.device))
    best_of[key] = best
    return best


# ---- tuning results that outlive the process ---------------------------------------------------
# Timing picks between near-equal candidates differently from one process to the next, and two
# configurations round bf16 differently: greedy output could change across restarts at
# near-ties (it did on an H200, docs/perf.md session 9). So the first process on a kind of GPU
# records its choices, and later ones (restarts, every worker of the machine) take them.
# In the file name: a new candidate set is timed afresh (a recorded choice stands otherwise).
# 2: GridConfig.
CANDIDATES_VERSION = 2
TUNING_ENV = "TANDEM_GEMV_TUNING_CACHE"  # a JSON file to use instead; "0": time every process
_tables: dict[Path, dict[str, object]] = {}  # file -> its choices, as read or written


def tuning_file(device: torch.device) -> Path | None:
    """Where this GPU kind's choices live: $TANDEM_GEMV_TUNING_CACHE, else
    $TANDEM_CACHE/gemv-tuning/<device name>-triton-<version>.json; None when set to 0."""
    env = os.environ.get(TUNING_ENV)
    if env == "0":
        return None
    if env:
        return Path(env).expanduser()
    name = re.sub(r"[^A-Za-z0-9._-]+", "_", torch.cuda.get_device_name(device))
    return (default_cache_root() / "gemv-tuning"
            / f"{name}-triton-{triton.__version__}-c{CANDIDATES_VERSION}.json")


def _encode(choice: Config | RowsChoice) -> object:
    if isinstance(choice, FmaConfig):  # tagged: its fields could read as a one-row Config
        return ["fma", *choice]
    if isinstance(choice, GridConfig):
        return ["grid", choice.block_n, choice.block_k, choice.num_warps]
    return choice if isinstance(choice, str) else list(choice)


def _read(path: Path) -> dict[str, object]:
    try:
        table = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return table if isinstance(table, dict) else {}


def choose(key: tuple, candidates: tuple, time_all: Callable[[], dict],
           path: Path | None) -> Config | RowsChoice:
    """The recorded choice for `key` when `path` has one among `candidates`; else the fastest
    of `time_all()` (candidate -> ms), recorded in `path`. Writers merge into what the file
    holds, and a key already there keeps its choice (the first process's word stands)."""
    def recorded(table: dict[str, object]) -> Config | RowsChoice | None:
        raw = table.get(repr(key))
        return next((c for c in candidates if _encode(c) == raw), None)

    if path is not None:
        if path not in _tables:
            _tables[path] = _read(path)
        found = recorded(_tables[path])
        if found is not None:
            return found
    times = time_all()
    best = min(times, key=times.__getitem__)
    if path is None:
        return best
    table = _read(path)  # what other processes recorded meanwhile
    _tables[path] = table
    found = recorded(table)
    if found is not None:  # another process's word stands
        return found
    table[repr(key)] = _encode(best)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(table, indent=0, sort_keys=True))
        os.replace(tmp, path)  # atomic: readers see the old file or the new one
    except OSError as exc:
        log.warning("gemv tuning: cannot record choices in %s (%s)", path, exc)
    return best


def _copies(weight: torch.Tensor) -> int:
    """Weights to cycle through while timing: together > 2x the L2 cache, as a forward's
    layers are (2 for an 8B-sized weight; SmolLM2's 0.7-3.5 MB ones sat in L2 with 2)."""
    l2 = getattr(torch.cuda.get_device_properties(weight.device), "L2_cache_size", 50 << 20)
    return min(256, max(2, -(-2 * l2 // (weight.numel() * weight.element_size()))))


def _graph_time(cfg: Config | RowsChoice, launch, weights: tuple[torch.Tensor, ...],
                calls: int = 8, reps: int = 5) -> float:
    """Median ms of one call of `cfg`, from replays of a graph of `calls` calls."""
    launch(cfg, weights[0])  # compile and warm up outside the capture
    cycle = itertools.cycle(weights)  # call i of the graph reads weights[i % len(weights)]
    return graph_us(lambda: launch(cfg, next(cycle)), calls, reps) / 1e3


def tuned_configs() -> dict[tuple, Config | RowsChoice]:
    """Every tuned shape's choice. One-row keys: (N, K, weight dtype, norm, silu_mul,
    residual, out dtype); multi-row keys add the row count M last, and their choice is a
    RowsConfig or UNFUSED."""
    return {**_best, **_best_rows}
