"""`ColocatedDispatcher`: the router's `Dispatcher` when each worker is one engine (prefill and
decode together) run by an `EngineLoop` in the router's process.

Owns its `EngineLoop`s (starts and stops them) and the map request id -> worker of the requests
in flight. The engines themselves are owned by their loops. Per-request acceptance stats are
derived here from the loop's outputs: with a speculative engine every output after a request's
first token is one round of (accepted drafts + 1) tokens.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass

from tandem import otel, trace
from tandem.engine.engine_loop import (
    AcceptanceSnapshot,
    EngineLoop,
    LoopError,
    LoopErrorKind,
    LoopRequest,
)
from tandem.router.dispatch import (
    CapacityExceeded,
    DeadlineExceeded,
    DispatchError,
    DispatcherStats,
    ModelInfo,
    RequestFailed,
    RequestRejected,
    RoutedRequest,
    SpecAcceptance,
    SpecCounts,
    acceptance_from_rounds,
    TokenChunk,
    WorkerCounts,
    WorkerInfo,
    WorkerRole,
    WorkerTotals,
    WorkerUnavailable,
)


@dataclass(frozen=True, slots=True, kw_only=True)
class ColocatedWorker:
    name: str
    model: str
    loop: EngineLoop  # started by the dispatcher


def model_info_of(engine, model: str) -> ModelInfo:
    """Limits of one engine; a speculative round needs `slots_per_round` KV slots past the
    committed tokens, so those are kept out of what a request may ask for."""
    spec = getattr(engine, "spec", None)
    scratch = spec.slots_per_round if spec is not None else 0
    return ModelInfo(
        name=model, vocab_size=engine.model_cfg.vocab_size, max_model_len=engine.max_model_len,
        max_request_tokens=engine.allocator.num_usable * engine.cfg.page_size - scratch)


class ColocatedDispatcher:
    def __init__(self, workers: Sequence[ColocatedWorker]) -> None:
        if not workers:
            raise ValueError("workers: a colocated dispatcher needs at least one worker")
        self._workers = {w.name: w for w in workers}
        if len(self._workers) != len(workers):
            raise ValueError("workers: names must be unique")
        models: dict[str, ModelInfo] = {}
        for w in workers:
            info = model_info_of(w.loop.engine, w.model)
            prev = models.get(w.model)
            if prev is not None:  # several workers of a model: the smallest limits apply
                info = ModelInfo(name=w.model, vocab_size=min(prev.vocab_size, info.vocab_size),
                                 max_model_len=min(prev.max_model_len, info.max_model_len),
                                 max_request_tokens=min(prev.max_request_tokens,
                                                        info.max_request_tokens))
            models[w.model] = info
        self._models = tuple(models.values())
        self._in_flight: dict[str, ColocatedWorker] = {}
        for w in workers:
            if not w.loop.started:
                w.loop.start()

    @staticmethod
    def from_engine(engine, name: str = "colocated-0", model: str = "default"
                    ) -> ColocatedDispatcher:
        return ColocatedDispatcher([ColocatedWorker(name=name, model=model,
                                                    loop=EngineLoop(engine, name))])

    def loop(self, worker: str) -> EngineLoop:
        return self._workers[worker].loop

    def models(self) -> Sequence[ModelInfo]:
        return self._models

    def workers(self) -> Sequence[WorkerInfo]:
        out = []
        for w in self._workers.values():
            s = w.loop.stats
            healthy = w.loop.alive
            out.append(WorkerInfo(
                name=w.name, role=WorkerRole.COLOCATED, model=w.model, healthy=healthy,
                error="" if healthy else (w.loop.error or f"worker '{w.name}' is not running"),
                num_running=s.num_running, num_waiting=s.num_waiting,
                num_free_pages=s.num_free_pages, num_pages=s.num_pages,
                speculative=s.acceptance is not None))
        return out

    async def submit(self, request: RoutedRequest) -> AsyncGenerator[TokenChunk, None]:
        p = request.placement
        worker = self._workers.get(p.prefill_worker)
        if worker is None or p.decode_worker != p.prefill_worker:
            raise RequestRejected(
                f"decode_worker: a colocated worker prefills and decodes; got prefill "
                f"'{p.prefill_worker}', decode '{p.decode_worker}'")
        if not worker.loop.alive:
            raise WorkerUnavailable(worker.name, worker.loop.error
                                    or f"worker '{worker.name}' is not running")
        trace.mark(request.room, "router.submit")
        # The engine's part of the request (queue, prefill, decode), under the request's span
        span = otel.start("router.dispatch", request.traceparent)
        span.set("tandem.worker", worker.name)
        stream = worker.loop.submit(LoopRequest(
            req_id=request.request_id, prompt_ids=request.prompt_ids, params=request.params,
            deadline=request.deadline))
        self._in_flight[request.request_id] = worker
        speculative = getattr(worker.loop.engine, "spec", None) is not None
        rounds: list[int] = []  # tokens per speculative round
        num_outputs = num_tokens = 0
        try:
            async for out in stream:
                if out.error is not None:
                    raise _dispatch_error(worker.name, request.request_id, out.error)
                if num_outputs > 0 and out.token_ids:
                    rounds.append(len(out.token_ids))
                elif num_outputs == 0:
                    trace.mark(request.room, "router.first")
                    span.event("first_token")
                num_outputs += 1
                num_tokens += len(out.token_ids)
                if out.finish_reason is not None:
                    span.set("gen_ai.response.finish_reasons", out.finish_reason.value)
                spec = None
                if out.finish_reason is not None and speculative:
                    spec = acceptance_from_rounds(rounds, worker.loop.engine.spec.num_steps)
                yield TokenChunk(request_id=request.request_id, token_ids=out.token_ids,
                                 text_delta=out.text_delta, finish_reason=out.finish_reason,
                                 spec=spec, logprobs=out.logprobs, queue_s=out.queue_s)
        except DispatchError as exc:
            span.fail(exc)
            raise
        finally:
            stream.cancel()  # no-op when the stream ended; otherwise aborts in the engine
            self._in_flight.pop(request.request_id, None)
            span.set("gen_ai.usage.output_tokens", num_tokens)
            span.end()

    async def abort(self, request_id: str) -> bool:
        worker = self._in_flight.get(request_id)
        if worker is None:
            return False
        worker.loop.abort(request_id)
        return True

    def stats(self) -> DispatcherStats:
        """Acceptance over the workers, the engines' running and waiting requests, and every
        worker for the metrics (an engine in this process never restarts: its counts are the
        totals). Reads only the loops' snapshots, so a scrape may call it from another thread."""
        loops = {name: w.loop.stats for name, w in self._workers.items()}
        workers = tuple(
            WorkerTotals(name=name, role=WorkerRole.COLOCATED,
                         healthy=self._workers[name].loop.alive,
                         num_free_pages=s.num_free_pages, num_pages=s.num_pages, num_restarts=0,
                         counts=_counts(s.acceptance))
            for name, s in loops.items())
        return DispatcherStats(spec=_acceptance([s.acceptance for s in loops.values()]),
                               num_running=sum(s.num_running for s in loops.values()),
                               num_waiting=sum(s.num_waiting for s in loops.values()),
                               workers=workers)

    async def close(self) -> None:
        await asyncio.gather(*(asyncio.to_thread(w.loop.stop) for w in self._workers.values()))

    def stop_loops(self) -> None:
        """Stop every engine loop now, from any thread (no step runs after this returns):
        what a TP engine's rank 0 needs before it releases the other ranks."""
        for w in self._workers.values():
            w.loop.stop()


def _counts(acceptance: AcceptanceSnapshot | None) -> WorkerCounts:
    """An engine's counters for the metrics: its acceptance as counts (no transfers here)."""
    if acceptance is None:
        return WorkerCounts()
    return WorkerCounts(spec=SpecCounts.from_means(
        acceptance.mean_acceptance_length, acceptance.per_position, acceptance.num_rounds))


def _acceptance(snaps: list[AcceptanceSnapshot | None]) -> SpecAcceptance | None:
    """Acceptance over the speculative workers (None when none speculates)."""
    snaps = [s for s in snaps if s is not None]
    if not snaps:
        return None
    num_rounds = sum(s.num_rounds for s in snaps)
    width = max(len(s.per_position) for s in snaps)
    weight = [s.num_rounds / num_rounds if num_rounds else 0.0 for s in snaps]
    return SpecAcceptance(
        mean_acceptance_length=sum(w * s.mean_acceptance_length for w, s in zip(weight, snaps)),
        per_position=tuple(sum(w * (s.per_position[j] if j < len(s.per_position) else 0.0)
                               for w, s in zip(weight, snaps)) for j in range(width)),
        num_rounds=num_rounds)


def _dispatch_error(worker: str, request_id: str, error: LoopError) -> DispatchError:
    if error.kind is LoopErrorKind.DEADLINE:
        return DeadlineExceeded(error.message)
    if error.kind is LoopErrorKind.REQUEST_FAILED:  # this request only: the worker serves on
        return RequestFailed(error.message, request_id=request_id)
    if error.kind is LoopErrorKind.CAPACITY:
        # The engine's only capacity refusal: prompt + max_new_tokens needs more pages than
        # the pool has (the router checks this first; this is the backstop).
        return CapacityExceeded(error.message)
    if error.kind is LoopErrorKind.REJECTED:
        return RequestRejected(error.message)
    return WorkerUnavailable(worker, error.message)
