"""GPU time of a short call, measured the way it runs in serving: `calls` calls captured in one
CUDA graph and replayed, so launch costs are those of a replay (start-up tuning and benchmarks
alike: the GEMV tuner, the all-reduce method table, `benchmarks/gpu_micro.py`)."""

from __future__ import annotations

import statistics
from collections.abc import Callable

import torch


def graph_us(fn: Callable[[], object], calls: int, replays: int) -> float:
    """Median microseconds per call of `fn` over `replays` replays of a graph of `calls` calls
    (one untimed replay first). The caller has run `fn` eagerly before (compilation, lazy
    set-up and allocations must not happen inside the capture)."""
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    del graph
    return statistics.median(times)
