"""Load levels and request arrival schedules.

A level is either closed-loop (`concurrency` clients, each sending its next request when the
previous one finished) or open-loop (Poisson arrivals at `request_rate` requests/s, optionally
capped at `max_concurrency` in flight). Arrival times are a pure function of (rate, count, seed).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass


@dataclass(frozen=True, slots=True, kw_only=True)
class LoadLevel:
    concurrency: int | None = None  # closed loop: this many requests in flight
    request_rate: float | None = None  # open loop: Poisson arrivals, requests/s (inf: all at once)
    max_concurrency: int | None = None  # open loop: cap on requests in flight (None: no cap)

    def __post_init__(self) -> None:
        if (self.concurrency is None) == (self.request_rate is None):
            raise ValueError("load: give exactly one of concurrency, request_rate")
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError(f"concurrency: must be >= 1, got {self.concurrency}")
        if self.request_rate is not None and not self.request_rate > 0:
            raise ValueError(f"request_rate: must be > 0, got {self.request_rate}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"max_concurrency: must be >= 1, got {self.max_concurrency}")

    @property
    def x(self) -> float:
        """The level's value on a plot's x axis."""
        return float(self.concurrency if self.concurrency is not None else self.request_rate)

    @property
    def label(self) -> str:
        if self.concurrency is not None:
            return f"concurrency {self.concurrency}"
        cap = f", max {self.max_concurrency} in flight" if self.max_concurrency else ""
        return f"rate {self.request_rate:g}/s{cap}"

    def to_json(self) -> dict[str, float | int | str | None]:
        """An infinite rate is written "inf" (JSON has no infinity)."""
        rate = self.request_rate
        return {"concurrency": self.concurrency,
                "request_rate": "inf" if rate is not None and math.isinf(rate) else rate,
                "max_concurrency": self.max_concurrency}

    def default_num_requests(self) -> int:
        """Enough requests that the steady state dominates: 4 rounds of the clients, or 20 s
        of arrivals; at least 16."""
        if self.concurrency is not None:
            return max(16, 4 * self.concurrency)
        if math.isinf(self.request_rate or 0.0):
            return 64
        return max(16, min(1000, int(20 * (self.request_rate or 0.0))))


def parse_levels(concurrency: str | None, request_rate: str | None,
                 max_concurrency: int | None = None) -> tuple[LoadLevel, ...]:
    """'1,16,64' concurrency levels and/or '0.5,2,inf' request rates (the CLI's syntax)."""
    levels: list[LoadLevel] = []
    for part in _split(concurrency):
        try:
            levels.append(LoadLevel(concurrency=int(part)))
        except ValueError as exc:
            raise ValueError(f"concurrency: '{part}' is not a positive integer ({exc})") from exc
    for part in _split(request_rate):
        try:
            levels.append(LoadLevel(request_rate=float(part), max_concurrency=max_concurrency))
        except ValueError as exc:
            raise ValueError(f"request_rate: '{part}' is not a positive number ({exc})") from exc
    if not levels:
        raise ValueError("concurrency/request_rate: give at least one load level")
    return tuple(levels)


def _split(text: str | None) -> list[str]:
    return [p.strip() for p in (text or "").split(",") if p.strip()]


def poisson_arrivals(rate: float, num: int, seed: int) -> list[float]:
    """`num` send times (seconds from the start, the first at 0): exponential gaps of mean
    1/rate from a generator seeded with `seed`, so a run can be repeated exactly. An infinite
    rate sends everything at once."""
    if num <= 0:
        return []
    if math.isinf(rate):
        return [0.0] * num
    rng = random.Random(seed)
    times, t = [0.0], 0.0
    for _ in range(num - 1):
        t += rng.expovariate(rate)
        times.append(t)
    return times
