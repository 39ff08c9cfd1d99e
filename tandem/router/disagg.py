"""`DisaggregatedDispatcher`: prefill and decode on separate Ray actors, KV over Mooncake/NIXL.

Per request (the orchestration of the request path lives here, in one place):
  1. admission: the request takes a running slot (router/admission.py), or waits for one, or
     is refused at once with RESOURCE_EXHAUSTED when the queue is full too;
  2. the prefill worker gets the request (`StartPrefill`, a short call) and starts its forward;
     at the same time the decode worker reserves pages + a seed slot (`Reserve`) and answers
     with the KV destination, which goes on to the prefill worker (`Route`) while the forward
     runs; a decode worker out of pages sends the request back to wait for capacity (step 1's
     queue). Every call to a worker is one typed command (messages/commands.py) through the
     actor's `command` method;
  3. everything the workers say about the request comes on their event channels
     (router/worker_channel.py, one stream per worker for all requests): the prefill worker's
     first token as soon as its forward is over (streamed to the client at once), its outcome
     once the KV transfer is terminal, then the decode worker's outputs (its first output
     repeats the first token, which is dropped here);
  4. the request ends with the right error, naming the side at fault: a failed or timed-out
     transfer or a failed row fails this request only (`TransferFailed`, `RequestFailed`; no
     worker is blamed for it); a worker whose event stream breaks (it died) fails its requests
     at once (`WorkerUnavailable`) -- except that a request whose prefill worker died before
     its first token is tried once more on a prefill worker that answers; the deadline gives
     `DeadlineExceeded`. Both workers are told to abort whatever is left of the request.

Owns the table of requests in flight (request id -> `Flight`, router/flight.py: the workers
and room of its current attempt, whether it was aborted, how long it waited; one record per
request, dropped in one place when it ends), the event channels and the admission. How one
attempt's events become chunks is `flight.follow`. Worker health comes from a background poll
of every actor (router/worker_health.py), so `workers()` is a cheap snapshot.

Tracing (tandem/otel.py; no-ops when off): under the request's span, `router.admission` (the
wait for a running slot) and per attempt `router.dispatch`, whose traceparent rides the
attempt's `StartPrefill` and `Reserve` so that the workers' spans hang under it;
`router.wait_for_pages` under it while decode is full.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import secrets
import time
import uuid
from collections.abc import AsyncGenerator, Sequence

from tandem import otel, trace
from tandem.messages import Abort, OutOfCapacity, Reserve, Route, StartPrefill
from tandem.router.admission import Admission, AdmissionConfig
from tandem.router.dispatch import (
    CapacityExceeded,
    DeadlineExceeded,
    DispatcherStats,
    ModelInfo,
    RequestRejected,
    RoutedRequest,
    SpecAcceptance,
    TokenChunk,
    WorkerInfo,
    WorkerUnavailable,
)
from tandem.router.flight import Flight, aborted_chunk, follow, remaining
from tandem.router.worker_channel import WorkerChannel
from tandem.router.worker_health import HEALTH_PERIOD_S, WorkerHealthTable

log = logging.getLogger(__name__)

# Short calls (StartPrefill, Reserve's answer aside, Route, Abort, endpoint) answer within this.
CALL_TIMEOUT_S = 10.0
# How long a request whose prefill worker died waits for one that answers (restarts of a CPU
# worker take ~5 s) before it gets UNAVAILABLE.
PREFILL_RETRY_WAIT_S = 20.0
# How long a request's end waits for the aborts of what is left of it on its workers.
ABORT_WAIT_S = 0.2


class DisaggregatedDispatcher:
    def __init__(self, prefill: dict[str, object], decode: dict[str, object],
                 decode_endpoints: dict[str, bytes], model: ModelInfo,
                 num_steps: int, health_period_s: float = HEALTH_PERIOD_S,
                 admission: AdmissionConfig | None = None) -> None:
        self._prefill, self._decode = dict(prefill), dict(decode)
        self._model, self._num_steps = model, num_steps
        self._flights: dict[str, Flight] = {}  # request id -> the request, until its end
        self._period = health_period_s
        self._poller: asyncio.Task | None = None
        # This router's channel name on every worker (one event stream per worker)
        self._channel_id = f"router-{uuid.uuid4().hex[:12]}"
        self._channels: dict[str, WorkerChannel] = {
            n: WorkerChannel(n, h, self._channel_id)
            for n, h in [*self._prefill.items(), *self._decode.items()]}
        self._admission: Admission | None = None
        self._admission_loop: asyncio.AbstractEventLoop | None = None
        self._tasks: set[asyncio.Task] = set()  # background aborts (kept referenced)
        self._admission_cfg = admission or AdmissionConfig()
        self.table = WorkerHealthTable(self._prefill, self._decode, decode_endpoints,
                                       model.name, self._last_batch)

    # ---- snapshots --------------------------------------------------------------------------

    def models(self) -> Sequence[ModelInfo]:
        return (self._model,)

    def workers(self) -> Sequence[WorkerInfo]:
        if self._poller is None:
            try:
                self._poller = asyncio.get_running_loop().create_task(
                    self.table.poll_forever(self._period))
            except RuntimeError:
                pass
        return self.table.infos()

    def _last_batch(self, name: str) -> float:
        channel = self._channels.get(name)
        return channel.last_batch if channel is not None else 0.0

    def stats(self) -> DispatcherStats:
        """Acceptance over the decode workers, the admission's counts (a request waiting for
        decode pages holds a running slot but counts as waiting), every worker's totals."""
        a = self._admission
        for_pages = a.num_waiting_for_pages if a is not None else 0
        return DispatcherStats(spec=self._acceptance(),
                               num_running=(a.num_running if a is not None else 0) - for_pages,
                               num_waiting=(a.num_queued if a is not None else 0) + for_pages,
                               workers=self.table.totals())

    def _acceptance(self) -> SpecAcceptance | None:
        snaps = self.table.spec_snapshots()
        if not snaps:
            return None
        total = sum(s.num_rounds for s in snaps)
        width = max(len(s.per_position) for s in snaps)
        return SpecAcceptance(
            mean_acceptance_length=sum(s.mean_acceptance_length * s.num_rounds for s in snaps)
            / total,
            per_position=tuple(sum((s.per_position[j] if j < len(s.per_position) else 0.0)
                                   * s.num_rounds for s in snaps) / total for j in range(width)),
            num_rounds=total)

    # ---- requests ---------------------------------------------------------------------------

    async def submit(self, request: RoutedRequest) -> AsyncGenerator[TokenChunk, None]:
        pname, dname = request.placement.prefill_worker, request.placement.decode_worker
        if pname not in self._prefill:
            raise RequestRejected(f"prefill_worker: no prefill worker named '{pname}'")
        if dname not in self._decode:
            raise RequestRejected(f"decode_worker: no decode worker named '{dname}'")
        rid = request.request_id
        trace.mark(request.room, "router.submit")
        loop = asyncio.get_running_loop()
        if self._admission is None or self._admission_loop is not loop:  # the loop it serves
            self._admission, self._admission_loop = Admission(self._admission_cfg), loop
        flight = self._flights[rid] = Flight(prefill=pname, decode=dname, room=request.room)
        since = time.perf_counter()
        queued = otel.start("router.admission", request.traceparent)  # the wait for a slot
        try:
            async with self._admission.slot(rid, request.deadline):
                flight.waited_s += time.perf_counter() - since
                queued.end()
                streamed = False
                try:
                    async for chunk in self._run(request, flight):
                        streamed = True
                        yield flight.on_last(chunk)
                    return
                except WorkerUnavailable as exc:
                    if streamed or exc.worker != flight.prefill:
                        raise
                    # Its prefill worker died before the first token: once more, invisibly to
                    # the client, on a prefill worker that answers (the restarted one, or
                    # another), under a new room.
                    pname = await self._prefill_for_retry(exc.worker, request)
                    log.warning("request '%s': prefill worker '%s' died before its first token; "
                                "retrying on '%s'", rid, exc.worker, pname)
                request = dataclasses.replace(request, room=_fresh_room())
                flight.prefill, flight.room = pname, request.room
                async for chunk in self._run(request, flight):
                    yield flight.on_last(chunk)
        finally:
            queued.end()  # refused, or its deadline passed in the queue
            self._flights.pop(rid, None)

    async def _prefill_for_retry(self, dead: str, request: RoutedRequest) -> str:
        """A healthy prefill worker for a request whose prefill worker died (the least busy;
        the dead one counts once it answers again), waited for until PREFILL_RETRY_WAIT_S or the
        deadline; WorkerUnavailable if none comes."""
        end = time.monotonic() + PREFILL_RETRY_WAIT_S
        # Down until its next health answer, however its death showed (a broken stream, or a
        # failed call): the retry must not go to the process that just died.
        self.table.down(dead, "died under a request; waiting for its next answer")
        while True:
            healthy = [w for w in self.table.infos() if w.name in self._prefill and w.healthy]
            if healthy:
                return min(healthy, key=lambda w: (w.num_running + w.num_waiting, w.name)).name
            left = remaining(request)
            if time.monotonic() > end or (left is not None and left <= 0.1):
                raise WorkerUnavailable(dead, f"prefill worker '{dead}' died before this "
                                              "request's first token and no prefill worker "
                                              "answered in time to retry it")
            await asyncio.sleep(0.1)

    async def _run(self, request: RoutedRequest, flight: Flight
                   ) -> AsyncGenerator[TokenChunk, None]:
        """One attempt of a request on its two workers (`flight`'s), from submission to its
        last chunk (its waits for decode pages add to `flight.waited_s`)."""
        rid, room, pname, dname = request.request_id, flight.room, flight.prefill, flight.decode
        prefill, decode = self._prefill[pname], self._decode[dname]
        pch, dch = self._channels[pname], self._channels[dname]
        events: asyncio.Queue = asyncio.Queue()  # (worker name, event), both workers
        finished = False
        release_decode = False  # decode reserved pages nothing will be sent into
        retried = False  # decode was full at an earlier attempt
        dead: str | None = None  # a worker that died under this request
        # This attempt's span; the workers' spans go under it (its traceparent rides the commands)
        span = otel.start("router.dispatch", request.traceparent, kind=otel.CLIENT)
        span.set("tandem.prefill_worker", pname)
        span.set("tandem.decode_worker", dname)
        traceparent = span.traceparent
        try:
            while True:
                if flight.aborted:  # aborted while it waited for a slot or for pages
                    finished = True
                    yield aborted_chunk(rid)
                    return
                pch.open(room, events)
                dch.open(room, events)
                # Concurrent dispatch: the prefill goes first (the prompt's forward starts at
                # once), decode's reserve next, and the reserve's answer follows to prefill by
                # `Route` while the forward runs. A request that found decode full before
                # reserves first, so that waiting for pages costs no prefill forwards.
                prompt_ids = tuple(request.prompt_ids)
                start = StartPrefill(channel=self._channel_id, room=room, prompt_ids=prompt_ids,
                                     params=request.params, traceparent=traceparent)
                submitted = prefill.command.remote(start) if not retried else None
                reserved = decode.command.remote(Reserve(
                    channel=self._channel_id, room=room, prompt_ids=prompt_ids,
                    params=request.params, traceparent=traceparent))
                trace.mark(room, "router.reserve_sent")
                try:
                    dest = await self._call(dname, reserved, request)
                except CapacityExceeded:
                    # Decode is out of pages for now: take the prefill back, wait until some
                    # request ends, and try again under a new room (the old one's late calls
                    # and events must not meet the new attempt).
                    pch.close(room)
                    dch.close(room)
                    if submitted is not None:
                        await self._abort_one(pname, prefill, room)
                    t_wait = time.perf_counter()
                    waiting = otel.start("router.wait_for_pages", span)
                    try:
                        await self._admission.wait_for_capacity(rid, request.deadline)
                    finally:
                        waiting.end()
                    flight.waited_s += time.perf_counter() - t_wait
                    room, retried = _fresh_room(), True
                    flight.room = room
                    continue
                if submitted is None:
                    submitted = prefill.command.remote(start)
                break
            trace.mark(room, "router.reserved")
            span.set("tandem.room", str(room))
            prefill.command.remote(Route(room=room, destination=dest,  # outcome: its events
                                         decode_endpoint=self.table.endpoint(dname)))
            await self._call(pname, submitted, request)  # answered long ago, normally
            async for chunk in follow(request, flight, events, num_steps=self._num_steps,
                                      table=self.table):
                if chunk.finish_reason is not None:
                    finished = True
                    release_decode = flight.ended_on_prefill
                yield chunk
        except WorkerUnavailable as exc:
            dead = exc.worker  # nothing to abort there: its process is gone
            span.fail(exc)
            raise
        except Exception as exc:
            span.fail(exc)
            raise
        finally:
            span.end()
            pch.close(room)
            dch.close(room)
            if not finished or release_decode:  # cancelled, deadline, error, or decode's
                # pages wait for a transfer that will not come: stop it everywhere. A live
                # worker answers in milliseconds; past ABORT_WAIT_S the abort goes on in the
                # background and the request ends now (a dead or restarting worker's abort
                # call may take seconds to fail).
                task = self._background(self._abort_both(pname, dname, room, skip=dead))
                await asyncio.wait({task}, timeout=ABORT_WAIT_S)

    async def _call(self, worker: str, ref, request: RoutedRequest):
        """A short call's answer, with its errors as dispatch errors (typed: ValueError means
        the request is bad, OutOfCapacity that decode is out of pages for now)."""
        left = remaining(request)
        try:
            return await asyncio.wait_for(_await_ref(ref), timeout=left)
        except asyncio.TimeoutError:
            raise DeadlineExceeded(f"request '{request.request_id}' passed its deadline") from None
        except Exception as exc:
            cause = getattr(exc, "cause", None) or exc
            if isinstance(cause, OutOfCapacity):
                raise CapacityExceeded(f"decode worker '{worker}' is full: {cause}") from exc
            if isinstance(cause, ValueError):
                raise RequestRejected(str(cause)) from exc
            raise WorkerUnavailable(worker, f"worker '{worker}' failed: {exc!r}"[:300]) from exc

    def _background(self, coro) -> asyncio.Task:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def _abort_one(self, name: str, handle, room: int) -> None:
        try:
            await asyncio.wait_for(_await_ref(handle.command.remote(Abort(room=room))),
                                   timeout=CALL_TIMEOUT_S)
        except Exception as exc:  # a dead worker has nothing left to abort
            log.warning("abort of room %d on %s failed: %r", room, name, exc)

    async def _abort_both(self, pname: str, dname: str, room: int, skip: str | None = None
                          ) -> None:
        """Abort `room` on both workers (but `skip`, one known dead)."""
        await asyncio.gather(*(self._abort_one(n, h, room) for n, h in
                               ((pname, self._prefill[pname]), (dname, self._decode[dname]))
                               if n != skip))

    async def abort(self, request_id: str) -> bool:
        flight = self._flights.get(request_id)
        if flight is None:
            return False
        flight.aborted = True
        await self._abort_both(flight.prefill, flight.decode, flight.room)
        return True

    async def close(self) -> None:
        if self._poller is not None:
            self._poller.cancel()
        await asyncio.gather(*(ch.close_all() for ch in self._channels.values()))


async def _await_ref(ref):
    return await ref


def _fresh_room() -> int:
    return secrets.randbits(64) or 1
