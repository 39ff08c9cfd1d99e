"""Transfer metrics: a mutable `MetricsRecorder` owned by one endpoint and the frozen
`TransferMetrics` snapshot it hands out (bytes, GB/s, latency percentiles and buckets, failures
by kind)."""

from __future__ import annotations

from bisect import bisect_left
from collections import Counter, deque
from dataclasses import dataclass

from tandem.kvtransfer.contract import ErrorKind

_WINDOW = 10_000  # latencies kept for percentiles (most recent)
# Upper bounds (seconds) of the latency buckets counted over the endpoint's whole life (what a
# Prometheus histogram needs; the percentiles above see only the window). A transfer on one
# machine takes ~1 ms, across nodes up to seconds; the last bound is the default deadline's order.
LATENCY_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                     10.0, 30.0, 75.0)


@dataclass(frozen=True, slots=True, kw_only=True)
class TransferMetrics:
    num_done: int
    num_failed: int
    bytes_moved: int  # payload bytes of DONE transfers (KV + aux)
    busy_s: float  # sum of DONE transfer latencies
    gbps: float  # bytes_moved / busy_s / 1e9 (GB/s, decimal); 0 when nothing moved
    latency_mean_s: float
    latency_p50_s: float
    latency_p99_s: float
    failures: tuple[tuple[str, int], ...]  # (ErrorKind value, count), sorted by kind
    latency_bounds_s: tuple[float, ...] = LATENCY_BUCKETS_S
    # [len(latency_bounds_s) + 1] DONE transfers per bucket since the endpoint started (a
    # latency equal to a bound counts in that bound's bucket; the last one is above every bound)
    latency_counts: tuple[int, ...] = ()

    def failures_of(self, kind: ErrorKind) -> int:
        return dict(self.failures).get(kind.value, 0)


def _percentile(sorted_vals: list[float], q: float) -> float:
    if not sorted_vals:
        return 0.0
    idx = min(len(sorted_vals) - 1, max(0, round(q * (len(sorted_vals) - 1))))
    return sorted_vals[idx]


class MetricsRecorder:
    """Counters of one endpoint. Sole writer: that endpoint."""

    def __init__(self) -> None:
        self._num_done = 0
        self._bytes = 0
        self._busy_s = 0.0
        self._latencies: deque[float] = deque(maxlen=_WINDOW)
        self._failures: Counter[str] = Counter()
        self._buckets = [0] * (len(LATENCY_BUCKETS_S) + 1)

    def record_done(self, nbytes: int, latency_s: float) -> None:
        self._num_done += 1
        self._bytes += nbytes
        self._busy_s += latency_s
        self._latencies.append(latency_s)
        self._buckets[bisect_left(LATENCY_BUCKETS_S, latency_s)] += 1

    def record_failure(self, kind: ErrorKind) -> None:
        self._failures[kind.value] += 1

    def snapshot(self) -> TransferMetrics:
        lat = sorted(self._latencies)
        return TransferMetrics(
            num_done=self._num_done,
            num_failed=sum(self._failures.values()),
            bytes_moved=self._bytes,
            busy_s=self._busy_s,
            gbps=self._bytes / self._busy_s / 1e9 if self._busy_s > 0 else 0.0,
            latency_mean_s=sum(lat) / len(lat) if lat else 0.0,
            latency_p50_s=_percentile(lat, 0.50),
            latency_p99_s=_percentile(lat, 0.99),
            failures=tuple(sorted(self._failures.items())),
            latency_counts=tuple(self._buckets),
        )
