"""Serving metrics as the serving community defines them (vLLM's and SGLang's serving
benchmarks), as pure functions over per-request timelines measured by the client.

Definitions (all times in seconds, measured at the client from the moment the request was sent):
- TTFT: time to the first streamed token.
- latency (E2E): time to the last token.
- TPOT: (latency - TTFT) / (output_tokens - 1); undefined (None) for one-token answers.
- ITL: the gaps between streamed tokens, over all tokens of all requests. A chunk of n tokens
  (a speculative round streams several at once) that arrives g after the previous chunk counts
  as n gaps of g / n; the extra tokens of the first chunk count as gaps of 0. So a request
  contributes exactly output_tokens - 1 gaps summing to latency - TTFT: its mean ITL is its TPOT.
- request / output-token / total-token throughput: completed requests (tokens) over the level's
  duration, from the first request sent to the last one finished.
- goodput: completed requests per second that met both SLOs (TTFT <= ttft_s and TPOT <= tpot_s;
  a one-token answer has no TPOT and meets that SLO).
- percentiles: linear interpolation between order statistics (numpy's default method).
- acceptance length tau: tokens committed per speculative round (accepted drafts + 1), averaged
  over rounds (a request with more rounds weighs more), and per draft position j the
  probability that draft j was accepted, averaged the same way.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True, kw_only=True)
class SpecRecord:
    """A request's speculative decoding stats, as the server reports them."""

    mean_acceptance_length: float
    per_position: tuple[float, ...]  # [num_steps] P(draft j+1 accepted)
    num_rounds: int


@dataclass(frozen=True, slots=True, kw_only=True)
class RequestRecord:
    """One request as the client saw it. Times are seconds since the request was sent."""

    chunk_times_s: tuple[float, ...]  # [num_chunks] arrival time of each streamed chunk
    chunk_tokens: tuple[int, ...]  # [num_chunks] tokens in each chunk
    prompt_tokens: int
    start_s: float = 0.0  # when it was sent, seconds since the level started
    error: str | None = None  # None: completed
    spec: SpecRecord | None = None
    server_ttft_s: float | None = None  # the router's own TTFT (receipt -> first token)

    def __post_init__(self) -> None:
        if len(self.chunk_times_s) != len(self.chunk_tokens):
            raise ValueError("chunk_times_s, chunk_tokens: lengths differ")
        if any(b < a for a, b in zip(self.chunk_times_s, self.chunk_times_s[1:])):
            raise ValueError("chunk_times_s: must not decrease")

    @property
    def ok(self) -> bool:
        return self.error is None and self.output_tokens > 0

    @property
    def output_tokens(self) -> int:
        return sum(self.chunk_tokens)

    @property
    def end_s(self) -> float:
        """When it finished, seconds since the level started."""
        return self.start_s + (self.chunk_times_s[-1] if self.chunk_times_s else 0.0)


def ttft(r: RequestRecord) -> float:
    return r.chunk_times_s[0]


def latency(r: RequestRecord) -> float:
    return r.chunk_times_s[-1]


def tpot(r: RequestRecord) -> float | None:
    n = r.output_tokens
    return (latency(r) - ttft(r)) / (n - 1) if n > 1 else None


def itls(r: RequestRecord) -> list[float]:
    """output_tokens - 1 inter-token gaps (see the module docstring)."""
    out = [0.0] * (r.chunk_tokens[0] - 1) if r.chunk_tokens else []
    for i in range(1, len(r.chunk_times_s)):
        n = r.chunk_tokens[i]
        if n:
            out += [(r.chunk_times_s[i] - r.chunk_times_s[i - 1]) / n] * n
    return out


def percentile(values: Sequence[float], q: float) -> float:
    """q in [0, 100]; linear interpolation between the closest ranks (numpy's default)."""
    if not values:
        return math.nan
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


@dataclass(frozen=True, slots=True, kw_only=True)
class Distribution:
    mean: float
    p50: float
    p90: float
    p99: float

    @staticmethod
    def of(values: Sequence[float]) -> Distribution:
        mean = sum(values) / len(values) if values else math.nan
        return Distribution(mean=mean, p50=percentile(values, 50), p90=percentile(values, 90),
                            p99=percentile(values, 99))


@dataclass(frozen=True, slots=True, kw_only=True)
class SLO:
    ttft_s: float
    tpot_s: float

    def met(self, r: RequestRecord) -> bool:
        t = tpot(r)
        return ttft(r) <= self.ttft_s and (t is None or t <= self.tpot_s)


@dataclass(frozen=True, slots=True, kw_only=True)
class Acceptance:
    mean_length: float  # tau
    per_position: tuple[float, ...]
    num_rounds: int


def acceptance(records: Sequence[RequestRecord]) -> Acceptance | None:
    """Round-weighted tau and per-position acceptance; None when no request reported any."""
    specs = [r.spec for r in records if r.spec is not None and r.spec.num_rounds > 0]
    rounds = sum(s.num_rounds for s in specs)
    if not rounds:
        return None
    tau = sum(s.mean_acceptance_length * s.num_rounds for s in specs) / rounds
    width = max(len(s.per_position) for s in specs)
    per_pos = tuple(
        sum(s.per_position[j] * s.num_rounds for s in specs if j < len(s.per_position)) / rounds
        for j in range(width))
    return Acceptance(mean_length=tau, per_position=per_pos, num_rounds=rounds)


@dataclass(frozen=True, slots=True, kw_only=True)
class LevelMetrics:
    """Everything measured at one load level."""

    num_requests: int  # sent (warm-up excluded)
    num_completed: int
    num_failed: int
    duration_s: float
    request_throughput: float  # completed requests / s
    output_throughput: float  # output tokens / s
    total_token_throughput: float  # (prompt + output) tokens / s
    goodput: float  # requests / s meeting the SLO
    slo_attainment: float  # fraction of completed requests meeting the SLO
    mean_prompt_tokens: float
    mean_output_tokens: float
    effective_concurrency: float  # mean requests in flight (Little's law: sum latency / duration)
    ttft_s: Distribution
    tpot_s: Distribution
    itl_s: Distribution
    latency_s: Distribution
    acceptance: Acceptance | None


def duration(records: Sequence[RequestRecord]) -> float:
    """First send to last completion (0 when nothing completed)."""
    done = [r for r in records if r.ok]
    if not done:
        return 0.0
    return max(r.end_s for r in done) - min(r.start_s for r in records)


def summarize(records: Sequence[RequestRecord], slo: SLO) -> LevelMetrics:
    done = [r for r in records if r.ok]
    dur = duration(records)
    rate = (lambda x: x / dur) if dur > 0 else (lambda x: 0.0)
    out_tokens = sum(r.output_tokens for r in done)
    prompt_tokens = sum(r.prompt_tokens for r in done)
    good = sum(1 for r in done if slo.met(r))
    tpots = [t for t in (tpot(r) for r in done) if t is not None]
    n = len(done)
    return LevelMetrics(
        num_requests=len(records), num_completed=n, num_failed=len(records) - n,
        duration_s=dur, request_throughput=rate(n), output_throughput=rate(out_tokens),
        total_token_throughput=rate(out_tokens + prompt_tokens), goodput=rate(good),
        slo_attainment=good / n if n else 0.0,
        mean_prompt_tokens=prompt_tokens / n if n else 0.0,
        mean_output_tokens=out_tokens / n if n else 0.0,
        effective_concurrency=rate(sum(latency(r) for r in done)),
        ttft_s=Distribution.of([ttft(r) for r in done]),
        tpot_s=Distribution.of(tpots),
        itl_s=Distribution.of([g for r in done for g in itls(r)]),
        latency_s=Distribution.of([latency(r) for r in done]),
        acceptance=acceptance(done),
    )
