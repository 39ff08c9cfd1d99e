"""`WorkerFront`: what a worker's Ray actor is made of, without Ray -- one rank's worker (a
prefill or decode node's) and the loop thread that drives it, the routers' event channels, and
the hand-over between the loop thread and the actor's event loop. deploy/actors.py subclasses it
per worker kind; the launcher wraps those with `ray.remote`, and tests use them in-process.

A worker of one rank starts at once, driven by a `WorkerLoop`. A worker of `tp` ranks (or `dp`
DP-attention ranks) is that many actors: each builds its worker in `join` (the process group),
driven by a `GroupLoop`; rank 0 takes every command and its loop applies it on every rank.

Supervision: a worker whose loop crashed (a whole forward failed; one request's failure only
fails that request) exits its process when it runs as a Ray actor, so that Ray restarts it; the
restarted actor has a new `incarnation` and new transfer endpoints, which the router picks up
from its health answers.
"""

from __future__ import annotations

import asyncio
import logging
import os
import uuid
from collections.abc import AsyncIterator

from tandem import otel
from tandem.kvtransfer import TransferMetrics
from tandem.messages import GetEndpoint, TransferTotals, WorkerHealth
from tandem.worker.channels import EventChannels
from tandem.worker.config import WorkerConfig
from tandem.worker.group_loop import CommandedWorker, GroupLoop
from tandem.worker.loop import WorkerLoop
from tandem.worker.process import in_ray_actor, node_id, tune_process
from tandem.worker.ranks import (RankInfo, encode_per_rank, join_group, leave_group,
                                 rendezvous_address)

log = logging.getLogger(__name__)


class WorkerFront:
    """Owns one rank's worker and the loop thread that drives it, the routers' event channels
    (rank 0's are the ones read), and the actor's event loop once the first call captured it.
    Subclasses say how to build the worker and turn its outputs into events."""

    role = ""  # "prefill" | "decode": what the health answer says

    def __init__(self, cfg: WorkerConfig, rank: int = 0, tp: int = 1, ep: int = 1,
                 dp: int = 1) -> None:
        tune_process()
        # Traces when the launcher passed a collector (TANDEM_OTLP_ENDPOINT in the runtime_env)
        otel.configure_from_env(f"tandem-{self.role}",
                                instance=cfg.name if rank == 0 else f"{cfg.name}-rank{rank}")
        self.cfg = cfg
        self.ranks = RankInfo(rank=rank, tp=tp, ep=ep, dp=dp)
        self.incarnation = uuid.uuid4().hex
        self.channels = EventChannels()  # the routers' event streams (used on the event loop)
        self._aio = None  # the actor's event loop, captured on the first async call
        self.worker = None
        self.loop: WorkerLoop | GroupLoop | None = None
        if self.ranks.world_size == 1:  # a single rank starts at once; others wait for join()
            self.worker = self._make_worker(None, None)
            self.loop = WorkerLoop(self.worker, self._on_outputs, name=f"{cfg.name}-loop",
                                   on_error=self._on_loop_error)

    def _make_worker(self, parallel, sync) -> CommandedWorker:
        """This rank's worker (parallel and sync None: a worker of one rank)."""
        raise NotImplementedError

    def _on_loop_error(self, exc: BaseException) -> None:
        """The loop thread stopped on a failed step. Inside a Ray actor the process exits, so
        Ray restarts the worker (its requests end with UNAVAILABLE at the router, whose event
        stream breaks); in-process the worker stays down and reports unhealthy."""
        if in_ray_actor():
            log.critical("worker %s: step failed (%r); exiting so that Ray restarts it",
                         self.cfg.name, exc)
            logging.shutdown()
            os._exit(70)

    def _on_outputs(self, outs: list) -> None:
        """Rank 0's worker outputs of one step, on the loop thread: hand them to the actor's
        event loop (`_deliver`) as events."""
        raise NotImplementedError

    async def rendezvous(self) -> tuple[str, int]:
        """Rank 0: where the worker's process group meets."""
        return rendezvous_address()

    async def join(self, host: str, port: int) -> None:
        """Ranks of a multi-rank worker: join the process group (returns when every rank
        joined), build this rank's worker and start its loop."""
        self._loop()

        def start() -> None:
            parallel, sync = join_group(self.ranks, host, port, self.cfg.engine.device)
            self.worker = self._make_worker(parallel, sync)
            on_outputs = self._on_outputs if self.ranks.rank == 0 else None
            self.loop = GroupLoop(self.worker, sync, on_outputs,
                                  name=f"{self.cfg.name}-rank{self.ranks.rank}-loop")

        await asyncio.to_thread(start)

    async def _apply(self, cmd) -> list:
        """`cmd` (a worker command) applied on every rank between two steps; the per-rank
        results."""
        if isinstance(self.loop, GroupLoop):
            return await asyncio.wrap_future(self.loop.submit(cmd))
        return [await asyncio.wrap_future(self.loop.submit(self.worker.apply, cmd))]

    async def endpoint(self) -> bytes:
        """Every rank's transfer endpoint, as one blob."""
        self._loop()
        return encode_per_rank(await self._apply(GetEndpoint()))

    async def events(self, channel: str) -> AsyncIterator[list]:
        """The event stream of router channel `channel`: batches of this worker's events for
        the rooms submitted with that channel name (an empty batch now and then while idle).
        A streaming-generator method: the router reads it with `num_returns="streaming"`."""
        self._loop()
        async for batch in self.channels.stream(channel):
            yield batch

    async def shutdown(self) -> None:
        if self.loop is not None:
            if isinstance(self.loop, GroupLoop) and self.ranks.rank != 0:
                # rank 0's close() stops every rank's loop
                await asyncio.to_thread(self.loop.wait_stopped, 10.0)
            else:
                self.loop.close()
        if self.worker is not None:
            self.worker.close()
        if self.ranks.world_size > 1:
            leave_group()
        # The spans of the last requests, before the actor is killed (bounded: a collector that
        # is away must not hold up the deployment's shutdown)
        otel.flush(timeout_s=2.0)

    def _loop(self) -> asyncio.AbstractEventLoop:
        if self._aio is None:
            self._aio = asyncio.get_running_loop()
        return self._aio

    def _deliver(self, fn, *args) -> None:
        """From the worker thread onto the actor's event loop."""
        if self._aio is not None:
            self._aio.call_soon_threadsafe(fn, *args)

    def _health(self) -> WorkerHealth:
        """This rank's health: its loop, engine pages and requests, and its transfer counts
        (the worker's `transfer_metrics()`; a subclass adds its own fields)."""
        eng = self.worker.engine
        err = repr(self.loop.error) if self.loop.error else ""
        return WorkerHealth(
            name=self.cfg.name, role=self.role, healthy=self.loop.error is None, error=err,
            num_running=len(eng.scheduler.running), num_waiting=len(eng.scheduler.waiting),
            num_free_pages=eng.allocator.num_free, num_pages=eng.allocator.num_usable,
            node=node_id(), incarnation=self.incarnation, pid=os.getpid(),
            transfer=transfer_totals(self.cfg.transfer_backend, self.worker.transfer_metrics()))


def transfer_totals(backend: str, m: TransferMetrics) -> TransferTotals:
    """The health answer's form of an endpoint's transfer metrics (cumulative counts only: the
    router turns them into Prometheus counters)."""
    return TransferTotals(backend=backend, num_done=m.num_done, num_bytes=m.bytes_moved,
                          latency_bounds_s=m.latency_bounds_s, latency_counts=m.latency_counts,
                          latency_sum_s=m.busy_s, failures=m.failures)
