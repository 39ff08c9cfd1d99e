"""The Ray actor edges of the two worker kinds. They convert and delegate: each owns one
worker (plain Python, see prefill_node/ and decode_node/) driven by a `WorkerLoop` thread, and
turns its outputs into awaitable results and per-request streams on the actor's event loop.

The launcher wraps these classes with `ray.remote`; nothing here imports Ray, so the classes
can also be used in-process.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import AsyncIterator
from dataclasses import dataclass

from tandem.decode_node.worker import DecodeOutput, DecodeWorker, OutOfCapacity
from tandem.deploy.loop import WorkerLoop
from tandem.deploy.worker_config import WorkerConfig
from tandem.engine.sampling import SamplingParams
from tandem.prefill_node.worker import PrefillResult, PrefillWorker

log = logging.getLogger(__name__)

# Quiet transfer libraries and keep UCX on loopback-capable transports (NOTES.md).
QUIET_ENV = {"MC_LOG_LEVEL": "WARNING", "NIXL_LOG_LEVEL": "WARN", "RAY_DEDUP_LOGS": "1"}


@dataclass(frozen=True, slots=True, kw_only=True)
class WorkerHealth:
    name: str
    role: str  # "prefill" | "decode"
    healthy: bool
    error: str
    num_running: int
    num_waiting: int
    num_free_pages: int
    num_pages: int
    node: str  # Ray node id / hostname the actor runs on
    mean_acceptance_length: float = 0.0
    per_position: tuple[float, ...] = ()
    num_rounds: int = 0


def _node_id() -> str:
    """The Ray node this actor runs on (hostname outside Ray)."""
    try:
        import ray

        if ray.is_initialized():
            return ray.get_runtime_context().get_node_id()
    except ImportError:
        pass
    return os.uname().nodename


class _ActorBase:
    role = ""

    def __init__(self, cfg: WorkerConfig) -> None:
        for k, v in QUIET_ENV.items():
            os.environ.setdefault(k, v)
        self.cfg = cfg
        self._aio = None  # the actor's event loop, captured on the first async call

    def _loop(self) -> asyncio.AbstractEventLoop:
        if self._aio is None:
            self._aio = asyncio.get_running_loop()
        return self._aio

    def _deliver(self, fn, *args) -> None:
        """From the worker thread onto the actor's event loop."""
        if self._aio is not None:
            self._aio.call_soon_threadsafe(fn, *args)

    def _health(self, worker, extra: dict | None = None) -> WorkerHealth:
        eng = worker.engine
        err = repr(self.loop.error) if self.loop.error else ""
        return WorkerHealth(
            name=self.cfg.name, role=self.role, healthy=self.loop.error is None, error=err,
            num_running=len(eng.scheduler.running), num_waiting=len(eng.scheduler.waiting),
            num_free_pages=eng.allocator.num_free, num_pages=eng.allocator.num_usable,
            node=_node_id(), **(extra or {}))


class PrefillActor(_ActorBase):
    role = "prefill"

    def __init__(self, cfg: WorkerConfig) -> None:
        super().__init__(cfg)
        self.worker = PrefillWorker(cfg)
        self._waiters: dict[int, asyncio.Future] = {}
        self.loop = WorkerLoop(self.worker, self._on_outputs, name=f"{cfg.name}-loop")

    def _on_outputs(self, results: list[PrefillResult]) -> None:
        for r in results:
            self._deliver(self._resolve, r)

    def _resolve(self, r: PrefillResult) -> None:
        fut = self._waiters.pop(r.room, None)
        if fut is not None and not fut.done():
            fut.set_result(r)

    async def endpoint(self) -> bytes:
        self._loop()
        return await asyncio.to_thread(self.loop.call, self.worker.endpoint)

    async def prefill(self, room: int, prompt_ids: list[int], params: SamplingParams,
                      destination: bytes, decode_endpoint: bytes) -> PrefillResult:
        """Prefill and push one request; returns when its transfer reached a terminal state
        (or the first token already finished it)."""
        loop = self._loop()
        fut = loop.create_future()
        self._waiters[room] = fut
        try:
            await asyncio.to_thread(self.loop.call, self.worker.connect, decode_endpoint)
            await asyncio.to_thread(self.loop.call, self.worker.submit, room, prompt_ids, params,
                                    destination)
        except Exception as exc:
            self._waiters.pop(room, None)
            return PrefillResult(room=room, ok=False, error=str(exc),
                                 error_kind="handshake" if "handshake" in str(exc) else "invalid")
        return await fut

    async def abort(self, room: int) -> None:
        await asyncio.to_thread(self.loop.call, self.worker.abort, room)

    async def health(self) -> WorkerHealth:
        self._loop()
        return self._health(self.worker)

    async def shutdown(self) -> None:
        self.loop.close()
        self.worker.close()


class DecodeActor(_ActorBase):
    role = "decode"

    def __init__(self, cfg: WorkerConfig) -> None:
        super().__init__(cfg)
        self.worker = DecodeWorker(cfg)
        self._streams: dict[int, asyncio.Queue] = {}
        self.loop = WorkerLoop(self.worker, self._on_outputs, name=f"{cfg.name}-loop")

    def _on_outputs(self, outs: list[DecodeOutput]) -> None:
        for o in outs:
            self._deliver(self._push, o)

    def _push(self, o: DecodeOutput) -> None:
        q = self._streams.get(o.room)
        if q is not None:
            q.put_nowait(o)

    async def endpoint(self) -> bytes:
        self._loop()
        return await asyncio.to_thread(self.loop.call, self.worker.endpoint)

    async def reserve(self, room: int, prompt_ids: list[int], params: SamplingParams) -> bytes:
        """The encoded Destination. Raises ValueError (bad request) or OutOfCapacity."""
        self._loop()
        self._streams[room] = asyncio.Queue()
        try:
            return await asyncio.to_thread(self.loop.call, self.worker.reserve, room, prompt_ids,
                                           params)
        except (ValueError, OutOfCapacity):
            self._streams.pop(room, None)
            raise

    async def stream(self, room: int) -> AsyncIterator[DecodeOutput]:
        """The request's outputs, in order, ending with a finished one. A streaming-generator
        method: the router reads it with `num_returns="streaming"`."""
        q = self._streams.get(room)
        if q is None:
            raise ValueError(f"room: {room} was not reserved on this worker")
        try:
            while True:
                o = await q.get()
                yield o
                if o.finished:
                    return
        finally:
            self._streams.pop(room, None)

    async def abort(self, room: int) -> None:
        await asyncio.to_thread(self.loop.call, self.worker.abort, room)
        q = self._streams.get(room)
        if q is not None:  # a reserved request that never started still ends its stream
            q.put_nowait(DecodeOutput(room=room, token_ids=(), text_delta="", finished=True,
                                      finish_reason="abort"))

    async def limits(self) -> tuple[int, int, int]:
        """(vocab_size, max_model_len, max_request_tokens) the router validates against."""
        eng = self.worker.engine
        slack = eng.spec.slots_per_round
        return (eng.model_cfg.vocab_size, eng.max_model_len,
                eng.allocator.num_usable * eng.cfg.page_size - slack)

    async def health(self) -> WorkerHealth:
        self._loop()
        st = self.worker.engine.spec_stats
        return self._health(self.worker, {
            "mean_acceptance_length": st.mean_acceptance_length,
            "per_position": tuple(st.per_position()), "num_rounds": st.num_rounds})

    async def shutdown(self) -> None:
        self.loop.close()
        self.worker.close()
