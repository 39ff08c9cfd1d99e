"""`DisaggregatedDispatcher`: prefill and decode on separate Ray actors, KV over Mooncake/NIXL.

Per request (the orchestration of DESIGN §2 lives here, in one place):
  1. the prefill worker gets the request and starts its forward; at the same time the decode
     worker reserves pages + a seed slot and answers with the KV destination, which goes on to
     the prefill worker (`route`) while the forward runs;
  2. decode's output stream is opened; the prefill worker pushes target KV, draft KV and the
     seed; its `prefill` call returns when the transfer is terminal;
  3. the first token comes from the prefill worker (`first_token`) as soon as the forward is
     over, while the KV moves; every later token streams from the decode worker (its first
     output repeats the first token, which is dropped here); a prefill/transfer failure, a
     dead actor or the deadline ends the request with the right error, and both workers are
     told to abort.

Worker health comes from a background poll of every actor (`health()`), so `workers()` is a
cheap snapshot; a dead actor shows up unhealthy within one poll period.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, Sequence

from tandem.engine import trace
from tandem.engine.request import FinishReason
from tandem.router.colocated import acceptance_from_rounds
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
    WorkerRole,
    WorkerUnavailable,
)

log = logging.getLogger(__name__)

# Health polls: an answer later than HEALTH_TIMEOUT_S is a missed poll; a worker is marked
# down after SLOW_POLLS_DOWN missed polls in a row (a busy worker may answer late once), at once
# when the call fails (the actor died or raised).
HEALTH_TIMEOUT_S = 5.0
SLOW_POLLS_DOWN = 3

_FINISH = {"stop": FinishReason.STOP, "length": FinishReason.LENGTH, "abort": FinishReason.ABORT}


class DisaggregatedDispatcher:
    def __init__(self, prefill: dict[str, object], decode: dict[str, object],
                 decode_endpoints: dict[str, bytes], model: ModelInfo,
                 num_steps: int, health_period_s: float = 0.5) -> None:
        self._prefill, self._decode = dict(prefill), dict(decode)
        self._endpoints = dict(decode_endpoints)
        self._model, self._num_steps = model, num_steps
        self._health: dict[str, WorkerInfo] = {
            n: WorkerInfo(name=n, role=WorkerRole.PREFILL, model=model.name)
            for n in self._prefill} | {
            n: WorkerInfo(name=n, role=WorkerRole.DECODE, model=model.name, speculative=True)
            for n in self._decode}
        self._spec: dict[str, SpecAcceptance] = {}
        self._in_flight: dict[str, tuple[str, str, int]] = {}  # request -> prefill, decode, room
        self._aborted: set[str] = set()  # in flight and aborted by abort()
        self._period = health_period_s
        self._poller: asyncio.Task | None = None
        self._missed: dict[str, int] = {}  # worker -> health polls missed in a row

    # ---- snapshots --------------------------------------------------------------------------

    def models(self) -> Sequence[ModelInfo]:
        return (self._model,)

    def workers(self) -> Sequence[WorkerInfo]:
        if self._poller is None:
            try:
                self._poller = asyncio.get_running_loop().create_task(self._poll_health())
            except RuntimeError:
                pass
        return list(self._health.values())

    async def _poll_health(self) -> None:
        while True:
            await asyncio.gather(*(self._check(n, h) for n, h in
                                   [*self._prefill.items(), *self._decode.items()]))
            await asyncio.sleep(self._period)

    async def _check(self, name: str, handle) -> None:
        role = WorkerRole.PREFILL if name in self._prefill else WorkerRole.DECODE
        try:
            h = await asyncio.wait_for(_await_ref(handle.health.remote()),
                                       timeout=HEALTH_TIMEOUT_S)
        except asyncio.TimeoutError:
            missed = self._missed[name] = self._missed.get(name, 0) + 1
            if missed < SLOW_POLLS_DOWN and self._health[name].healthy:
                return  # keep the last report: one late answer is not a dead worker
            self._health[name] = WorkerInfo(
                name=name, role=role, model=self._model.name, healthy=False,
                error=f"unreachable: no health answer within {HEALTH_TIMEOUT_S:g} s, "
                      f"{missed} polls in a row")
            return
        except Exception as exc:
            self._health[name] = WorkerInfo(name=name, role=role, model=self._model.name,
                                            healthy=False, error=f"unreachable: {exc!r}"[:300])
            return
        self._missed.pop(name, None)
        self._health[name] = WorkerInfo(
            name=name, role=role, model=self._model.name, healthy=h.healthy, error=h.error,
            address=h.node, num_running=h.num_running, num_waiting=h.num_waiting,
            num_free_pages=h.num_free_pages, num_pages=h.num_pages,
            speculative=role is WorkerRole.DECODE)
        if role is WorkerRole.DECODE and h.num_rounds:
            self._spec[name] = SpecAcceptance(mean_acceptance_length=h.mean_acceptance_length,
                                              per_position=h.per_position,
                                              num_rounds=h.num_rounds)

    def stats(self) -> DispatcherStats:
        snaps = list(self._spec.values())
        if not snaps:
            return DispatcherStats(spec=None)
        total = sum(s.num_rounds for s in snaps)
        width = max(len(s.per_position) for s in snaps)
        return DispatcherStats(spec=SpecAcceptance(
            mean_acceptance_length=sum(s.mean_acceptance_length * s.num_rounds for s in snaps)
            / total,
            per_position=tuple(sum((s.per_position[j] if j < len(s.per_position) else 0.0)
                                   * s.num_rounds for s in snaps) / total for j in range(width)),
            num_rounds=total))

    # ---- requests ---------------------------------------------------------------------------

    async def submit(self, request: RoutedRequest) -> AsyncGenerator[TokenChunk, None]:
        pname, dname = request.placement.prefill_worker, request.placement.decode_worker
        prefill, decode = self._prefill.get(pname), self._decode.get(dname)
        if prefill is None:
            raise RequestRejected(f"prefill_worker: no prefill worker named '{pname}'")
        if decode is None:
            raise RequestRejected(f"decode_worker: no decode worker named '{dname}'")
        rid, room = request.request_id, request.room
        trace.mark(room, "router.submit")
        prompt = list(request.prompt_ids)
        self._in_flight[rid] = (pname, dname, room)
        prefill_task: asyncio.Task | None = None
        first_task: asyncio.Task | None = None
        early: tuple[int, str] | None = None  # the first token, streamed from prefill
        finished = False
        release_decode = False  # decode reserved pages nothing will be sent into
        try:
            # Concurrent dispatch: the prefill goes first (the prompt's forward starts at once),
            # decode's reserve next, and the reserve's answer follows to prefill by `route`
            # while the forward runs: the reserve's round trip overlaps the forward instead of
            # preceding it. (Passing the reserve's ObjectRef inside the prefill call instead
            # cost the router ~1.4 ms per request in Ray's nested-reference bookkeeping.)
            prefill_task = asyncio.ensure_future(_await_ref(prefill.prefill.remote(
                room, prompt, request.params)))
            trace.mark(room, "router.prefill_sent")
            reserved = decode.reserve.remote(room, prompt, request.params)
            trace.mark(room, "router.reserve_sent")
            first_task = asyncio.ensure_future(_await_ref(prefill.first_token.remote(room)))
            dest = await self._call(dname, reserved, request)  # its refusal is the request's error
            trace.mark(room, "router.reserved")
            prefill.route.remote(room, dest, self._endpoints[dname])  # outcome: prefill_task
            gen = decode.stream.options(num_returns="streaming").remote(room)
            rounds: list[int] = []
            outputs = 0
            stream = gen.__aiter__()
            next_chunk = asyncio.ensure_future(stream.__anext__())
            while True:
                waits = {next_chunk} | {t for t in (prefill_task, first_task) if t is not None}
                done, _ = await asyncio.wait(waits, timeout=_remaining(request),
                                             return_when=asyncio.FIRST_COMPLETED)
                if not done:
                    next_chunk.cancel()
                    raise DeadlineExceeded(f"request '{rid}' passed its deadline")
                if first_task is not None and first_task in done:
                    early = _first_or_none(first_task) if outputs == 0 else None
                    first_task = None
                    if early is not None:
                        trace.mark(room, "router.first")
                        yield TokenChunk(request_id=rid, token_ids=(early[0],),
                                         text_delta=early[1])
                if prefill_task is not None and prefill_task in done:
                    # Once decode has produced output the KV has landed: a late prefill-side
                    # outcome (e.g. an abort racing the sender's DONE) no longer matters.
                    if rid in self._aborted:  # abort() raced the prefill: end as aborted
                        finished = True
                        yield TokenChunk(request_id=rid, token_ids=(), text_delta="",
                                         finish_reason=FinishReason.ABORT)
                        return
                    res = self._prefill_result(pname, prefill_task) if outputs == 0 else None
                    prefill_task = None
                    if res is not None:  # the first token ended the request on prefill
                        next_chunk.cancel()
                        finished = release_decode = True
                        yield TokenChunk(request_id=rid, token_ids=(res.first_token,),
                                         text_delta=res.first_text,
                                         finish_reason=_FINISH.get(res.finish_reason or "stop"))
                        return
                if next_chunk in done:
                    try:
                        o = await _await_ref(next_chunk.result())
                    except StopAsyncIteration:
                        raise WorkerUnavailable(dname, f"decode worker '{dname}' closed the "
                                                       "stream early") from None
                    except Exception as exc:
                        raise WorkerUnavailable(dname, f"decode worker '{dname}' failed: "
                                                       f"{exc!r}"[:300]) from exc
                    if o.finish_reason == "error":
                        raise WorkerUnavailable(dname, f"KV transfer failed: {o.error}")
                    spec = None
                    tokens, text = tuple(o.token_ids), o.text_delta
                    if outputs > 0 and o.token_ids:
                        rounds.append(len(o.token_ids))
                    elif early is not None:  # decode's first output repeats the first token
                        tokens, text = _drop_first(tokens, text, early, rid)
                    else:  # decode's output came first: prefill's first token is moot
                        trace.mark(room, "router.first")
                        if first_task is not None:
                            first_task.cancel()
                            first_task = None
                    outputs += 1
                    reason = _FINISH.get(o.finish_reason) if o.finished else None
                    if reason is not None:
                        spec = acceptance_from_rounds(rounds, self._num_steps)
                        finished = True
                    if tokens or text or reason is not None:
                        yield TokenChunk(request_id=rid, token_ids=tokens, text_delta=text,
                                         finish_reason=reason, spec=spec)
                    if reason is not None:
                        return
                    next_chunk = asyncio.ensure_future(stream.__anext__())
        finally:
            self._in_flight.pop(rid, None)
            self._aborted.discard(rid)
            for task in (prefill_task, first_task):
                if task is not None:
                    task.cancel()
            if not finished or release_decode:  # cancelled, deadline, error, or decode's
                # pages wait for a transfer that will not come: stop it everywhere
                await self._abort_both(pname, dname, room)

    def _prefill_result(self, pname: str, task: asyncio.Task):
        """None while the request goes on on decode; the result when prefill finished it;
        raises when prefill or the transfer failed."""
        try:
            res = task.result()
        except Exception as exc:
            raise WorkerUnavailable(pname, f"prefill worker '{pname}' failed: {exc!r}"[:300]
                                    ) from exc
        if not res.ok:
            raise WorkerUnavailable(pname, f"prefill/transfer failed on '{pname}': {res.error}")
        return res if res.finished else None

    async def _call(self, worker: str, ref, request: RoutedRequest):
        try:
            return await asyncio.wait_for(_await_ref(ref), timeout=_remaining(request))
        except asyncio.TimeoutError:
            raise DeadlineExceeded(f"request '{request.request_id}' passed its deadline") from None
        except Exception as exc:
            cause = getattr(exc, "cause", None) or exc
            text = str(cause)
            if type(cause).__name__ == "OutOfCapacity":
                raise CapacityExceeded(f"decode worker '{worker}' is full: {text}") from exc
            if isinstance(cause, ValueError):
                raise RequestRejected(text) from exc
            raise WorkerUnavailable(worker, f"worker '{worker}' failed: {exc!r}"[:300]) from exc

    async def _abort_both(self, pname: str, dname: str, room: int) -> None:
        for name, handle in ((pname, self._prefill.get(pname)), (dname, self._decode.get(dname))):
            if handle is None:
                continue
            try:
                await asyncio.wait_for(_await_ref(handle.abort.remote(room)), timeout=5.0)
            except Exception as exc:  # a dead worker has nothing left to abort
                log.warning("abort of room %d on %s failed: %r", room, name, exc)

    async def abort(self, request_id: str) -> bool:
        entry = self._in_flight.get(request_id)
        if entry is None:
            return False
        self._aborted.add(request_id)
        await self._abort_both(*entry)
        return True

    async def close(self) -> None:
        if self._poller is not None:
            self._poller.cancel()


async def _await_ref(ref):
    return await ref


def _first_or_none(task: asyncio.Task) -> tuple[int, str] | None:
    """The prefill worker's (first token, text), or None: there is none (the request ended or
    its first token finished it), or the call failed -- the `prefill` call reports why."""
    try:
        first = task.result()
    except Exception:  # noqa: BLE001 -- the prefill call's outcome carries the error
        return None
    return None if first is None else (int(first[0]), str(first[1]))


def _drop_first(tokens: tuple[int, ...], text: str, early: tuple[int, str], rid: str
                ) -> tuple[tuple[int, ...], str]:
    """Decode's first output without the first token the client already has from prefill (an
    output without tokens -- e.g. the end of an aborted request -- passes as it is)."""
    if not tokens:
        return tokens, text
    if tokens[:1] == (early[0],) and text.startswith(early[1]):
        return tokens[1:], text[len(early[1]):]
    log.error("request '%s': decode's first output %r / %r does not start with prefill's first "
              "token %r / %r", rid, tokens[:1], text[:20], early[0], early[1][:20])
    return tokens, text


def _remaining(request: RoutedRequest) -> float | None:
    if request.deadline is None:
        return None
    return max(0.0, request.deadline - time.time())
