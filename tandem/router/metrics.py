"""`RouterMetrics`: one router's Prometheus metrics, named like vLLM's `vllm:*` (and SGLang's)
with the `tandem:` prefix so that dashboards port; `render` gives the text a scrape gets.

Two sources, one registry:
- request metrics, recorded by `Router.generate` as a request goes (`RequestTimer`): outcomes by
  finish reason and by status code, TTFT, inter-token latency, time per output token,
  end-to-end latency, queue time, prompt and generation tokens;
- worker metrics, read from the dispatcher at each scrape (`DispatcherStats`): running and
  waiting requests, KV pages, health and restarts per worker, speculative acceptance, and KV
  transfer bytes, latency and failures per worker and backend. Worker counters are cumulative
  counts the workers report, kept monotonic across restarts by the dispatcher
  (router/worker_counts.py).

The registry is the router's own, never prometheus-client's global one: several routers in one
process (tests, the bench) would collide there. A scrape may come from another thread
(prometheus-client's HTTP server): the collector reads only values their owners replace whole.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram
from prometheus_client import generate_latest
from prometheus_client.metrics_core import (CounterMetricFamily, GaugeMetricFamily,
                                            HistogramMetricFamily, Metric)
from prometheus_client.registry import Collector

from tandem.messages import FinishReason, TransferTotals
from tandem.router.dispatch import DispatcherStats, SpecCounts, TokenChunk, WorkerTotals

# Bucket upper bounds (seconds). Whole requests and first tokens: from a short answer on a GPU
# to a long one on a CPU. Gaps between tokens: one decode step (ms on a GPU) to a stall.
LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
                     120.0, 300.0, 600.0)
TOKEN_GAP_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.25,
                       0.5, 1.0, 2.5, 5.0)
OK = "OK"  # the status code of a request that ended with a finish reason


class RouterMetrics:
    """Owns one router's registry and the request metrics in it (Prometheus' metric objects are
    thread-safe); the worker metrics come from `stats` (the dispatcher's) at each scrape."""

    def __init__(self, stats: Callable[[], DispatcherStats]) -> None:
        self.registry = r = CollectorRegistry()
        self.finished = Counter("tandem:request_success", "Requests that ended with a finish "
                                "reason (stop, length, abort, error)", ["finished_reason"],
                                registry=r)
        self.by_code = Counter("tandem:requests", "Requests answered, by final status code (OK, "
                               "or the gRPC code of the error; refused ones included)", ["code"],
                               registry=r)
        self.prompt_tokens = Counter("tandem:prompt_tokens", "Prompt tokens of the requests "
                                     "dispatched", registry=r)
        self.generation_tokens = Counter("tandem:generation_tokens", "Tokens streamed to "
                                         "clients", registry=r)
        self.ttft = Histogram("tandem:time_to_first_token_seconds", "Router receipt -> first "
                              "token", buckets=LATENCY_BUCKETS_S, registry=r)
        self.itl = Histogram("tandem:inter_token_latency_seconds", "Gap between a request's "
                             "consecutive outputs with tokens (one speculative round may bring "
                             "several)", buckets=TOKEN_GAP_BUCKETS_S, registry=r)
        self.tpot = Histogram("tandem:request_time_per_output_token_seconds", "Per request: "
                              "(last token - first token) / (tokens - 1)",
                              buckets=TOKEN_GAP_BUCKETS_S, registry=r)
        self.e2e = Histogram("tandem:e2e_request_latency_seconds", "Router receipt -> last "
                             "token, of requests that ended with a finish reason",
                             buckets=LATENCY_BUCKETS_S, registry=r)
        self.queue = Histogram("tandem:request_queue_time_seconds", "Time a request waited for "
                               "its turn in the router's admission (a running slot, decode "
                               "pages); disaggregated only", buckets=LATENCY_BUCKETS_S,
                               registry=r)
        for reason in FinishReason:  # every series from the start: rates need a first sample
            self.finished.labels(reason.value)
        self.by_code.labels(OK)
        r.register(WorkerCollector(stats))

    def refused(self, code: str) -> None:
        """A request refused before it was dispatched (validation, placement, capacity)."""
        self.by_code.labels(code).inc()

    def request(self, num_prompt_tokens: int, t0: float) -> RequestTimer:
        """A request being dispatched, received at `t0` (time.perf_counter())."""
        self.prompt_tokens.inc(num_prompt_tokens)
        return RequestTimer(self, t0)


class RequestTimer:
    """One request's timing, fed by `Router.generate` with each chunk it streams, then once
    with the request's status code. Used on the router's event loop only."""

    def __init__(self, metrics: RouterMetrics, t0: float) -> None:
        self._m, self._t0 = metrics, t0
        self._first: float | None = None  # perf_counter() of the first chunk with tokens
        self._last = t0  # ... and of the latest one
        self.num_tokens = 0  # tokens streamed so far

    @property
    def ttft_s(self) -> float | None:
        """Receipt -> first token (None before it): the metric's value and the answer's."""
        return None if self._first is None else self._first - self._t0

    def elapsed_s(self) -> float:
        """Receipt -> now."""
        return time.perf_counter() - self._t0

    def chunk(self, chunk: TokenChunk) -> None:
        now = time.perf_counter()
        if chunk.token_ids:
            self._m.generation_tokens.inc(len(chunk.token_ids))
            if self._first is None:
                self._first = now
                self._m.ttft.observe(now - self._t0)
            else:
                self._m.itl.observe(now - self._last)
            self._last = now
            self.num_tokens += len(chunk.token_ids)
        if chunk.finish_reason is None:
            return
        self._m.finished.labels(chunk.finish_reason.value).inc()
        self._m.e2e.observe(now - self._t0)
        if self._first is not None and self.num_tokens > 1:
            self._m.tpot.observe((self._last - self._first) / (self.num_tokens - 1))
        if chunk.queue_s is not None:
            self._m.queue.observe(chunk.queue_s)

    def ended(self, code: str) -> None:
        """The request is over: OK, or the status code it failed with (CANCELLED when its
        client went away)."""
        self._m.by_code.labels(code).inc()


class WorkerCollector(Collector):
    """The metrics read from the dispatcher at each scrape; families are yielded even without
    samples, so a dashboard finds every name from the first scrape on."""

    def __init__(self, stats: Callable[[], DispatcherStats]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        s = self._stats()
        yield GaugeMetricFamily("tandem:num_requests_running", "Requests being served (holding "
                                "a running slot; colocated: in the engines' batches)",
                                value=s.num_running)
        yield GaugeMetricFamily("tandem:num_requests_waiting", "Requests waiting for their turn "
                                "(a running slot or decode pages; colocated: in the engines' "
                                "queues)", value=s.num_waiting)
        yield from _worker_families(s.workers)
        yield from _spec_families(s.workers)
        yield from _transfer_families(s.workers)


_WORKER = ["worker", "role"]


def _worker_families(workers: tuple[WorkerTotals, ...]) -> Iterator[Metric]:
    free = GaugeMetricFamily("tandem:kv_pages_free", "Free KV pages of a worker (summed over "
                             "its DP ranks)", labels=_WORKER)
    used = GaugeMetricFamily("tandem:kv_pages_used", "KV pages in use on a worker",
                             labels=_WORKER)
    usage = GaugeMetricFamily("tandem:kv_cache_usage_perc", "Fraction of a worker's KV pages "
                              "in use (0-1)", labels=_WORKER)
    healthy = GaugeMetricFamily("tandem:worker_healthy", "1 while the router counts the worker "
                                "healthy, else 0", labels=_WORKER)
    restarts = CounterMetricFamily("tandem:worker_restarts", "Restarts of a worker the router "
                                   "noticed (a new process answering its health poll)",
                                   labels=_WORKER)
    for w in workers:
        who = [w.name, w.role.value]
        free.add_metric(who, w.num_free_pages)
        used.add_metric(who, w.num_pages - w.num_free_pages)
        usage.add_metric(who, 1.0 - w.num_free_pages / w.num_pages if w.num_pages else 0.0)
        healthy.add_metric(who, 1.0 if w.healthy else 0.0)
        restarts.add_metric(who, w.num_restarts)
    yield from (free, used, usage, healthy, restarts)


def _spec_families(workers: tuple[WorkerTotals, ...]) -> Iterator[Metric]:
    length = HistogramMetricFamily("tandem:spec_decode_acceptance_length", "Tokens a "
                                   "speculative round commits per request (accepted drafts + "
                                   "1)", labels=_WORKER)
    drafts = CounterMetricFamily("tandem:spec_decode_num_drafts", "Speculative rounds "
                                 "(request-rounds verified)", labels=_WORKER)
    accepted = CounterMetricFamily("tandem:spec_decode_num_accepted_tokens", "Draft tokens "
                                   "accepted", labels=_WORKER)
    per_pos = CounterMetricFamily("tandem:spec_decode_num_accepted_tokens_per_pos", "Rounds "
                                  "that accepted the draft at `position` (0: the first)",
                                  labels=[*_WORKER, "position"])
    for w in workers:
        spec = w.counts.spec
        if not spec.num_rounds and not spec.accepted_at:
            continue  # no speculative engine, or no round yet
        who = [w.name, w.role.value]
        length.add_metric(who, _length_buckets(spec), spec.num_tokens)
        drafts.add_metric(who, spec.num_rounds)
        accepted.add_metric(who, spec.num_tokens - spec.num_rounds)
        for j, n in enumerate(spec.accepted_at):
            per_pos.add_metric([*who, str(j)], n)
    yield from (length, drafts, accepted, per_pos)


def _length_buckets(spec: SpecCounts) -> list[tuple[str, float]]:
    """Cumulative buckets le = 1 .. k+1 of the tokens per round: a round commits at most m
    tokens when it accepted fewer than m drafts, i.e. all rounds but accepted_at[m-1]."""
    k = len(spec.accepted_at)
    out = [(f"{m}.0", float(spec.num_rounds - spec.accepted_at[m - 1])) for m in range(1, k + 1)]
    out += [(f"{k + 1}.0", float(spec.num_rounds)), ("+Inf", float(spec.num_rounds))]
    return out


def _transfer_families(workers: tuple[WorkerTotals, ...]) -> Iterator[Metric]:
    labels = [*_WORKER, "backend"]
    nbytes = CounterMetricFamily("tandem:kv_transfer_bytes", "KV transfer payload bytes of "
                                 "completed transfers (prefill workers: sent; decode: received)",
                                 labels=labels)
    latency = HistogramMetricFamily("tandem:kv_transfer_latency_seconds", "Latency of "
                                    "completed KV transfers, begin to completion",
                                    labels=labels)
    failures = CounterMetricFamily("tandem:kv_transfer_failures", "Failed KV transfers, by "
                                   "error kind", labels=[*labels, "kind"])
    for w in workers:
        t = w.counts.transfer
        if t is None:
            continue
        who = [w.name, w.role.value, t.backend]
        nbytes.add_metric(who, t.num_bytes)
        latency.add_metric(who, _latency_buckets(t), t.latency_sum_s)
        for kind, n in t.failures:
            failures.add_metric([*who, kind], n)
    yield from (nbytes, latency, failures)


def _latency_buckets(t: TransferTotals) -> list[tuple[str, float]]:
    out, total = [], 0
    for bound, n in zip((*(repr(float(b)) for b in t.latency_bounds_s), "+Inf"),
                        t.latency_counts):
        total += n
        out.append((bound, float(total)))
    if not out or out[-1][0] != "+Inf":  # no buckets reported: the count alone
        out.append(("+Inf", float(t.num_done)))
    return out


def render(registry: CollectorRegistry) -> tuple[bytes, str]:
    """The registry in Prometheus' text format, and the Content-Type to serve it with."""
    return generate_latest(registry), CONTENT_TYPE_LATEST
