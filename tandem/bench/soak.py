"""`tandem soak`: hold a router under concurrent streaming load with client cancels and short
deadlines for a fixed time, and check the promises of docs/reliability.md.

N clients each send one streaming Generate after another until the time is up. Each request is,
at random: a normal one (it must end OK), one the client cancels after a random delay (it must
end CANCELLED, or OK if it finished first), or one with a short deadline (DEADLINE_EXCEEDED, or
OK if it finished first). Meanwhile a probe calls the router's `grpc.health.v1` Check every
`probe_period_s` and records how long each answer took. Afterwards the workers must have every
KV page back.

Owns nothing beyond one run: `run_soak` opens its channel and closes it. Talks to one router
address (tests use 127.0.0.1 only); bounded by `duration_s` and per-request deadlines.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tandem.proto import router_pb2 as pb
from tandem.proto import router_pb2_grpc as pb_grpc

# How a request ends that is never a fault of the client: anything else counts as a failure.
EXPECTED = {
    "normal": {"OK"},
    "cancel": {"OK", "CANCELLED"},
    "deadline": {"OK", "DEADLINE_EXCEEDED"},
}


@dataclass(frozen=True, slots=True, kw_only=True)
class SoakConfig:
    target: str  # host:port of the router
    clients: int = 32
    duration_s: float = 60.0
    cancel_fraction: float = 0.2  # requests the client cancels after a random delay
    deadline_fraction: float = 0.2  # requests with a short deadline
    cancel_after_s: tuple[float, float] = (0.05, 2.0)  # uniform range
    short_deadline_s: tuple[float, float] = (0.2, 2.0)
    normal_deadline_s: float = 120.0  # a normal request must finish well within this
    max_tokens: int = 48
    prompts: tuple[str, ...] = ("What is the capital of France?",)
    allow_resource_exhausted: bool = False  # over a configured queue bound: refusals expected
    auth_token: str | None = None
    probe_period_s: float = 0.1
    seed: int = 0

    def __post_init__(self) -> None:
        if self.clients < 1:
            raise ValueError(f"clients: must be >= 1, got {self.clients}")
        if not self.duration_s > 0:
            raise ValueError(f"duration_s: must be > 0, got {self.duration_s}")
        if not 0 <= self.cancel_fraction + self.deadline_fraction <= 1:
            raise ValueError("cancel_fraction + deadline_fraction: must be within [0, 1]")


@dataclass(slots=True, kw_only=True)
class SoakReport:
    """What a soak saw. `failures` lists every request that ended in a status its kind does not
    allow (with the server's message); `ok` is True when there are none and nothing leaked."""

    duration_s: float
    counts: Counter = field(default_factory=Counter)  # status name -> requests
    by_kind: dict[str, Counter] = field(default_factory=dict)  # kind -> status -> requests
    failures: list[str] = field(default_factory=list)
    deadline_overrun_s: list[float] = field(default_factory=list)  # end - deadline, deadlines
    cancel_latency_s: list[float] = field(default_factory=list)  # cancel -> end of the call
    tokens: int = 0
    health_ms: list[float] = field(default_factory=list)  # router health answers
    health_failures: int = 0
    leaks: list[str] = field(default_factory=list)  # workers whose pages did not all come back
    # Per worker: (p50, p99) ms of its health answers to the router's poll, as the router saw
    # them over its recent polls (ListWorkers); empty when the router does not poll workers.
    worker_health_ms: dict[str, tuple[float, float]] = field(default_factory=dict)

    @property
    def num_requests(self) -> int:
        return sum(self.counts.values())

    @property
    def ok(self) -> bool:
        return not self.failures and not self.leaks and not self.health_failures

    def summary(self) -> str:
        lines = [f"{self.num_requests} requests in {self.duration_s:.0f} s, "
                 f"{self.tokens} tokens streamed"]
        lines.append("  by status: " + ", ".join(f"{k} {v}" for k, v in
                                                   sorted(self.counts.items())))
        for kind, c in sorted(self.by_kind.items()):
            lines.append(f"  {kind:8s}: " + ", ".join(f"{k} {v}" for k, v in sorted(c.items())))
        if self.deadline_overrun_s:
            lines.append(f"  deadline overrun: max {max(self.deadline_overrun_s):.3f} s")
        if self.cancel_latency_s:
            lines.append(f"  cancel to end: max {max(self.cancel_latency_s):.3f} s")
        if self.health_ms:
            lines.append(f"  router health: p50 {percentile(self.health_ms, 50):.1f} ms, "
                         f"p99 {percentile(self.health_ms, 99):.1f} ms, "
                         f"max {max(self.health_ms):.1f} ms over {len(self.health_ms)} probes, "
                         f"{self.health_failures} failed")
        for name, (p50, p99) in sorted(self.worker_health_ms.items()):
            lines.append(f"  worker {name} health: p50 {p50:.1f} ms, p99 {p99:.1f} ms")
        lines.append("  leaks: " + ("none" if not self.leaks else "; ".join(self.leaks)))
        if self.failures:
            lines.append(f"  {len(self.failures)} unexpected outcomes, first ones:")
            lines += [f"    {f}" for f in self.failures[:10]]
        return "\n".join(lines)


def percentile(values: list[float], q: float) -> float:
    s = sorted(values)
    if not s:
        return float("nan")
    k = min(len(s) - 1, max(0, round(q / 100 * (len(s) - 1))))
    return s[k]


def _request(cfg: SoakConfig, rng: random.Random) -> pb.GenerateRequest:
    msg = pb.GenerateRequest(sampling=pb.SamplingParams(max_tokens=cfg.max_tokens,
                                                        temperature=0.0))
    msg.messages.append(pb.ChatMessage(role="user", content=rng.choice(cfg.prompts)))
    return msg


async def _one(stub, cfg: SoakConfig, rng: random.Random, report: SoakReport,
               metadata) -> None:
    roll = rng.random()
    kind = ("cancel" if roll < cfg.cancel_fraction else
            "deadline" if roll < cfg.cancel_fraction + cfg.deadline_fraction else "normal")
    timeout = (rng.uniform(*cfg.short_deadline_s) if kind == "deadline"
               else cfg.normal_deadline_s)
    cancel_after = rng.uniform(*cfg.cancel_after_s) if kind == "cancel" else None
    t0 = time.monotonic()
    call = stub.Generate(_request(cfg, rng), timeout=timeout, metadata=metadata)
    cancelled_at: float | None = None
    status, details, tokens = "OK", "", 0

    async def read() -> None:
        nonlocal tokens
        async for msg in call:
            tokens += len(msg.token_ids)

    reader = asyncio.ensure_future(read())
    try:
        if cancel_after is not None:
            done, _ = await asyncio.wait({reader}, timeout=cancel_after)
            if not done:
                cancelled_at = time.monotonic()
                call.cancel()
        await reader
    except asyncio.CancelledError:
        if cancelled_at is None:
            raise
        status = "CANCELLED"
    except grpc.aio.AioRpcError as exc:
        status, details = exc.code().name, exc.details() or ""
    end = time.monotonic()
    report.counts[status] += 1
    report.by_kind.setdefault(kind, Counter())[status] += 1
    report.tokens += tokens
    if status == "DEADLINE_EXCEEDED":
        report.deadline_overrun_s.append(end - (t0 + timeout))
    if cancelled_at is not None:
        report.cancel_latency_s.append(end - cancelled_at)
    allowed = EXPECTED[kind] | ({"RESOURCE_EXHAUSTED"} if cfg.allow_resource_exhausted else set())
    if status not in allowed:
        report.failures.append(f"{kind} request after {end - t0:.2f} s: {status}: {details}")
        await asyncio.sleep(0.1)  # as a client would: no tight loop of failing requests


async def _probe(channel, cfg: SoakConfig, report: SoakReport, stop: asyncio.Event,
                 metadata) -> None:
    stub = health_pb2_grpc.HealthStub(channel)
    while not stop.is_set():
        t0 = time.perf_counter()
        try:
            await stub.Check(health_pb2.HealthCheckRequest(), timeout=5.0, metadata=metadata)
            report.health_ms.append((time.perf_counter() - t0) * 1e3)
        except grpc.aio.AioRpcError:
            report.health_failures += 1
        try:
            await asyncio.wait_for(stop.wait(), cfg.probe_period_s)
        except asyncio.TimeoutError:
            pass


async def check_pages(stub, metadata, settle_s: float = 10.0) -> list[str]:
    """Workers whose KV pages are not all free, after waiting up to `settle_s` for in-flight
    aborts and transfers to wind down ([] when every page is back)."""
    deadline = time.monotonic() + settle_s
    while True:
        resp = await stub.ListWorkers(pb.ListWorkersRequest(), timeout=10.0, metadata=metadata)
        leaks = [f"{w.name}: {w.num_pages - w.num_free_pages} of {w.num_pages} pages in use, "
                 f"{w.num_running} running" for w in resp.workers
                 if w.num_free_pages != w.num_pages or w.num_running]
        if not leaks or time.monotonic() > deadline:
            return leaks
        await asyncio.sleep(0.25)


async def run_soak(cfg: SoakConfig, progress: bool = False) -> SoakReport:
    metadata = (("authorization", f"Bearer {cfg.auth_token}"),) if cfg.auth_token else None
    report = SoakReport(duration_s=cfg.duration_s)
    async with grpc.aio.insecure_channel(cfg.target) as channel:
        await asyncio.wait_for(channel.channel_ready(), timeout=60)
        stub = pb_grpc.RouterStub(channel)
        stop = asyncio.Event()
        probe = asyncio.ensure_future(_probe(channel, cfg, report, stop, metadata))
        end_at = time.monotonic() + cfg.duration_s
        bar = None
        if progress:
            from tqdm import tqdm

            bar = tqdm(total=int(cfg.duration_s), desc="soak", unit="s", leave=False)

        async def client(i: int) -> None:
            rng = random.Random(cfg.seed * 100_003 + i)
            while time.monotonic() < end_at:
                await _one(stub, cfg, rng, report, metadata)

        async def tick() -> None:
            last = 0
            while time.monotonic() < end_at:
                await asyncio.sleep(1.0)
                now = int(cfg.duration_s - (end_at - time.monotonic()))
                if bar is not None:
                    bar.update(max(0, now - last))
                    bar.set_postfix(requests=report.num_requests,
                                    failed=len(report.failures), refresh=False)
                last = now

        ticker = asyncio.ensure_future(tick())
        try:
            await asyncio.gather(*(client(i) for i in range(cfg.clients)))
        finally:
            stop.set()
            ticker.cancel()
            await probe
            if bar is not None:
                bar.close()
        report.leaks = await check_pages(stub, metadata)
        resp = await stub.ListWorkers(pb.ListWorkersRequest(), timeout=10.0, metadata=metadata)
        report.worker_health_ms = {w.name: (w.health_p50_ms, w.health_p99_ms)
                                   for w in resp.workers if w.health_p99_ms > 0}
    return report
