"""`WorkerHealthTable`: the router's view of its Ray workers' health, from a background poll.

Owns (the only writer), in one row per worker (`_Worker`): its last `WorkerInfo`, the
incarnation it last answered with, the round trips of its recent health answers, when it was
last heard from, the speculative acceptance its answers carry, a decode worker's transfer
endpoints, its health call in flight; and, beside the rows, the cumulative
counters of its answers (acceptance, transfers) made monotonic across restarts for the metrics
(`CountCarry`, router/worker_counts.py; `totals()`).

Judgement: a worker is down at once when its health call fails (the actor died or raised) or
when the dispatcher saw its event stream break (`down`); and when nothing has been heard from it
-- no health answer, no batch on its event stream (one a second at least) -- for DOWN_AFTER_S:
frozen (SIGSTOP, a wedged process). A busy worker whose answers come late stays up: a late
answer still counts as heard. Its next answer brings a worker back. A worker Ray restarted
answers with a new incarnation; a decode worker's new transfer endpoint is fetched before it is
reported healthy again. Used on the router's event loop only.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from tandem.messages import WorkerHealth
from tandem.router.dispatch import (SpecAcceptance, SpecCounts, WorkerCounts, WorkerInfo,
                                    WorkerRole, WorkerTotals)
from tandem.router.worker_counts import CountCarry

log = logging.getLogger(__name__)

# Polls every HEALTH_PERIOD_S, each waiting up to HEALTH_TIMEOUT_S for the answer (a later one
# still counts): a frozen worker is down within ~DOWN_AFTER_S + HEALTH_TIMEOUT_S +
# HEALTH_PERIOD_S < 3 s of its last word.
HEALTH_PERIOD_S = 0.25
HEALTH_TIMEOUT_S = 0.75
DOWN_AFTER_S = 1.75
ENDPOINT_TIMEOUT_S = 10.0
HEALTH_SAMPLES = 4096  # health round trips kept per worker (~17 min of polls)


@dataclass(slots=True)
class _Worker:
    """One worker's row of the table."""

    handle: object  # the Ray actor handle of its rank 0
    role: WorkerRole
    info: WorkerInfo  # the last judgement (replaced whole: readable from another thread)
    endpoint: bytes | None = None  # decode workers: every rank's transfer endpoints, one blob
    spec: SpecAcceptance | None = None  # decode workers: acceptance as of the last answer
    asking: asyncio.Task | None = None  # its health call in flight (one at a time)
    heard: float | None = None  # time.monotonic() of its last answer
    incarnation: str | None = None  # the incarnation it last answered with
    rtt_ms: deque[float] = field(default_factory=lambda: deque(maxlen=HEALTH_SAMPLES))


class WorkerHealthTable:
    def __init__(self, prefill: dict[str, object], decode: dict[str, object],
                 decode_endpoints: dict[str, bytes], model: str,
                 last_batch: Callable[[str], float]) -> None:
        # last_batch(name): time.monotonic() of the worker's last event-stream batch
        self._model, self._last_batch = model, last_batch
        roles = {n: WorkerRole.PREFILL for n in prefill} | {n: WorkerRole.DECODE for n in decode}
        handles = {**prefill, **decode}
        self._workers: dict[str, _Worker] = {
            n: _Worker(handle=handles[n], role=r, endpoint=decode_endpoints.get(n),
                       info=WorkerInfo(name=n, role=r, model=model,
                                       speculative=r is WorkerRole.DECODE))
            for n, r in roles.items()}
        self._since = time.monotonic()
        self._carry = CountCarry()

    # ---- reads ------------------------------------------------------------------------------

    def infos(self) -> list[WorkerInfo]:
        return [w.info for w in self._workers.values()]

    def get(self, name: str) -> WorkerInfo:
        return self._workers[name].info

    def endpoint(self, decode: str) -> bytes:
        """The decode worker's transfer endpoints (every rank's, one blob), as of its current
        incarnation."""
        endpoint = self._workers[decode].endpoint
        if endpoint is None:
            raise KeyError(decode)
        return endpoint

    def spec_snapshots(self) -> list[SpecAcceptance]:
        return [w.spec for w in self._workers.values() if w.spec is not None]

    def totals(self) -> tuple[WorkerTotals, ...]:
        """Every worker for the metrics: its state now and its counters over all its
        incarnations (safe to call from another thread: it reads values replaced whole)."""
        return tuple(
            WorkerTotals(name=name, role=w.role, healthy=w.info.healthy,
                         num_free_pages=w.info.num_free_pages, num_pages=w.info.num_pages,
                         num_restarts=self._carry.num_restarts(name),
                         counts=self._carry.totals(name))
            for name, w in list(self._workers.items()))

    # ---- judgement --------------------------------------------------------------------------

    def down(self, name: str, error: str) -> None:
        """`name` is down until its next health answer."""
        w = self._workers[name]
        w.info = WorkerInfo(name=name, role=w.role, model=self._model, healthy=False,
                            error=error)

    async def poll_forever(self, period_s: float = HEALTH_PERIOD_S) -> None:
        while True:
            await asyncio.gather(*(self.check(n) for n in self._workers))
            await asyncio.sleep(period_s)

    async def check(self, name: str) -> None:
        """One poll of `name` (see the module docstring for the judgement)."""
        w = self._workers[name]
        if w.asking is None or w.asking.done():  # one health call at a time per worker
            w.asking = asyncio.ensure_future(self._ask(name))
        task = w.asking
        await asyncio.wait({task}, timeout=HEALTH_TIMEOUT_S)
        if task.done():
            return
        heard = max(self._since if w.heard is None else w.heard, self._last_batch(name))
        silent = time.monotonic() - heard
        if silent > DOWN_AFTER_S and w.info.healthy:
            self.down(name, f"unreachable: nothing heard from it for {silent:.1f} s")

    async def _ask(self, name: str) -> None:
        """One health call, however long it takes; its answer updates the table."""
        w = self._workers[name]
        t0 = time.perf_counter()
        try:
            h: WorkerHealth = await _await_ref(w.handle.health.remote())
        except Exception as exc:  # noqa: BLE001 -- dead or restarting
            self.down(name, f"unreachable: {exc!r}"[:300])
            return
        w.heard = time.monotonic()
        w.rtt_ms.append((time.perf_counter() - t0) * 1e3)
        incarnation = h.incarnation
        if w.incarnation is not None and incarnation != w.incarnation:
            log.warning("worker %s restarted (incarnation %s)", name, incarnation[:8])
            if w.role is WorkerRole.DECODE and not await self._refresh_endpoint(name):
                return
        w.incarnation = incarnation
        rtts = sorted(w.rtt_ms)
        w.info = WorkerInfo(
            name=name, role=w.role, model=self._model, healthy=h.healthy, error=h.error,
            address=h.node, num_running=h.num_running, num_waiting=h.num_waiting,
            num_free_pages=h.num_free_pages, num_pages=h.num_pages,
            speculative=w.role is WorkerRole.DECODE, health_p50_ms=_pct(rtts, 50),
            health_p99_ms=_pct(rtts, 99))
        if w.role is WorkerRole.DECODE and h.num_rounds:
            w.spec = SpecAcceptance(mean_acceptance_length=h.mean_acceptance_length,
                                    per_position=h.per_position, num_rounds=h.num_rounds)
        self._carry.report(name, incarnation, WorkerCounts(
            spec=SpecCounts.from_means(h.mean_acceptance_length, h.per_position, h.num_rounds),
            transfer=h.transfer))

    async def _refresh_endpoint(self, name: str) -> bool:
        """A restarted decode worker listens on new transfer endpoints: fetch them before it
        gets requests again (False: not yet; the next poll tries again)."""
        w = self._workers[name]
        try:
            w.endpoint = await asyncio.wait_for(_await_ref(w.handle.endpoint.remote()),
                                                timeout=ENDPOINT_TIMEOUT_S)
        except Exception as exc:  # noqa: BLE001 -- still starting
            self.down(name, f"restarted; its endpoint is not ready: {exc!r}"[:300])
            return False
        return True


def _pct(sorted_values: list[float], q: float) -> float:
    if not sorted_values:
        return 0.0
    return sorted_values[min(len(sorted_values) - 1, round(q / 100 * (len(sorted_values) - 1)))]


async def _await_ref(ref):
    return await ref
