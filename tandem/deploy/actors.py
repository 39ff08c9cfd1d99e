"""The Ray actor edges of the two worker kinds. They convert and delegate: each is a
`WorkerFront` (worker/front.py) over one worker (plain Python, see prefill_node/ and
decode_node/) driven by a loop thread, and turns its outputs into events on its routers'
channels (worker/channels.py): a request costs the router a short command (`StartPrefill` to
prefill, `Reserve` to decode: messages/commands.py), never an actor call slot for its whole
life, so control calls (health, abort, route) are never queued behind requests. The router's
commands arrive by one method, `command`, and are told apart by type; the worker's, on every
rank, by `worker.apply` (the same way). A crashed worker exits for Ray to restart it
(`max_restarts` in the launcher; see worker/front.py).

A worker of `tp` ranks (or a decode worker of `dp` DP-attention ranks) is that many actors.
Rank 0 (the leader, the decode group's front) is the one the router calls; it hands every
worker command to its `GroupLoop`, which applies it on every rank (worker/group_loop.py). The
others only join the process group and follow. Values that differ per rank (endpoints, destinations) cross the
router as one blob (`ranks.encode_per_rank`), also when tp is 1; with DP, a reserve's blob
names the one DP rank that took the request (`ranks.encode_dp_destination`), and the prefill
worker pushes to that rank (`ranks.route_to_decode`). Prefill and decode TP sizes may differ when
the KV heads re-slice: each prefill rank then pushes its heads to the decode ranks that hold them.

The launcher wraps these classes with `ray.remote`; nothing here imports Ray, so the classes
can also be used in-process.

Tracing (tandem/otel.py): a command that carries a traceparent (the router's dispatch span)
starts the request's span on this worker, `prefill` (StartPrefill -> its outcome) or `decode`
(Reserve -> its last output); the command passed on to the worker carries that span's
traceparent, and the worker's phases (worker/spans.py) go under it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections import OrderedDict
from dataclasses import dataclass

from tandem import otel, trace
from tandem.decode_node.worker import DecodeWorker
from tandem.kvtransfer import ErrorKind, TransferError
from tandem.messages import (Abort, Connect, DecodeCommand, DecodeOutput, FirstToken, PerRank,
                             PrefillCommand, PrefillResult, Reserve, ReserveRoom, Route,
                             RoutePrompt, StartPrefill, SubmitPrompt, WorkerHealth)
from tandem.prefill_node.worker import PrefillWorker
from tandem.worker import (WorkerConfig, WorkerFront, WorkerLoop, encode_dp_destination,
                           encode_per_rank, route_to_decode)

log = logging.getLogger(__name__)

# How long a Ray caller waits, after a call's connection broke, for the cluster to confirm that
# the actor died before the call fails. Ray's default (1 s) made a kill -9 reach the router ~1 s
# late (1.9 s with the reconnect); 100 ms still 0.9 s with a busy actor; 0 fails the call at
# once with ActorUnavailableError (measured on the CPU, Ray 2.60), which is all the router needs:
# it fails that worker's requests and reconnects. Read when a process's Ray core worker starts:
# the launcher sets it for the driver (router) and every actor of the job.
FAST_DEATH_ENV = {"RAY_timeout_ms_task_wait_for_death_info": "0"}


@dataclass(slots=True, eq=False)
class _Room:
    """One room's commands on a PrefillActor, made by whichever of `StartPrefill`, `Route` and
    `Abort` runs first: Ray does not run an async actor's calls in submission order
    ("asynchronous or threaded actors do not guarantee the task execution order"), so a `Route`
    may overtake its `StartPrefill` and must wait for it here rather than be dropped."""

    route: asyncio.Future  # the room's `Route` command; None: aborted
    result: asyncio.Future | None = None  # the prefill's outcome, from its `StartPrefill` on
    aborted: bool = False


class PrefillActor(WorkerFront):
    role = "prefill"
    # How long a prefill waits for decode's destination (`Route`) -- the router sends it as soon
    # as decode's reserve answers, normally milliseconds later -- and how long a room made by a
    # command that overtook its `StartPrefill` waits for that `StartPrefill`.
    route_wait_s = 60.0

    def __init__(self, cfg: WorkerConfig, rank: int = 0, tp: int = 1, ep: int = 1,
                 dp: int = 1) -> None:
        self._rooms: dict[int, _Room] = {}
        # Rooms whose prefill ended (bounded): a late call for one makes no new room.
        self._ended: OrderedDict[int, None] = OrderedDict()
        # decode endpoints (per prefill rank) every rank has connected to (with DP they depend
        # on the DP rank that took the request)
        self._connected: set[tuple[tuple[bytes, ...], ...]] = set()
        self._tasks: set[asyncio.Task] = set()  # running rooms (kept referenced)
        super().__init__(cfg, rank, tp, ep, dp)

    def _make_worker(self, parallel, sync) -> PrefillWorker:
        worker = PrefillWorker(self.cfg, parallel, sync) if sync else PrefillWorker(self.cfg)
        worker.on_first = self._on_first  # called on the loop thread
        return worker

    def _room(self, room: int) -> _Room | None:
        """`room`'s record, made now if this command is its first (None: its prefill has ended).
        A record no `StartPrefill` claims within `route_wait_s` is dropped."""
        r = self._rooms.get(room)
        if r is None and room not in self._ended:
            loop = self._loop()
            r = self._rooms[room] = _Room(route=loop.create_future())
            loop.call_later(self.route_wait_s, self._drop_unclaimed, room, r)
        return r

    def _drop_unclaimed(self, room: int, r: _Room) -> None:
        if self._rooms.get(room) is r and r.result is None:
            self._end(room)

    def _end(self, room: int) -> None:
        self._rooms.pop(room, None)
        self._ended[room] = None
        while len(self._ended) > ENDED_ROOMS:
            self._ended.popitem(last=False)

    def _on_first(self, first: FirstToken) -> None:
        self._deliver(self._first_ready, first)

    def _first_ready(self, first: FirstToken) -> None:
        if first.room in self._rooms:
            trace.mark(first.room, "prefill.first")
            self.channels.emit(first.room, first)

    def _on_outputs(self, results: list[PrefillResult]) -> None:
        for r in results:
            self._deliver(self._resolve, r)

    def _resolve(self, res: PrefillResult) -> None:
        r = self._rooms.get(res.room)
        if r is not None and r.result is not None and not r.result.done():
            r.result.set_result(res)

    async def command(self, cmd: PrefillCommand) -> None:
        """A router's command (messages/commands.py), told apart by type: `StartPrefill`
        (returns at once), `Route`, `Abort`."""
        self._loop()
        match cmd:
            case StartPrefill():
                self._start(cmd)
            case Route():
                self._route(cmd)
            case Abort():
                await self._abort(cmd.room)
            case _:
                raise TypeError(f"prefill worker: no command {type(cmd).__name__}")

    def _start(self, cmd: StartPrefill) -> None:
        """Start prefilling a room. Its first token (`FirstToken`) and its outcome
        (`PrefillResult`, once its transfer is terminal) come on the command's channel.
        Decode's destination follows by `Route` (concurrent dispatch: the router sends this
        command first and decode's reserve next; the prompt's forward starts now and the
        reserve's answer reaches `_route` while it runs)."""
        self.channels.bind(cmd.room, cmd.channel)
        task = asyncio.ensure_future(self._run(cmd))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _run(self, cmd: StartPrefill) -> None:
        # The request's span on this worker (traced requests only): the worker's phases go
        # under it, as the command it passes on carries its traceparent instead of the router's
        span = _request_span("prefill", self.cfg.name, cmd.traceparent, cmd.room,
                             len(cmd.prompt_ids))
        if span is not otel.NOOP:
            cmd = dataclasses.replace(cmd, traceparent=span.traceparent)
        try:
            res = await self._prefill_room(cmd)
        except Exception as exc:  # noqa: BLE001 -- the room fails, the worker serves on
            log.exception("prefill of room %d failed", cmd.room)
            res = PrefillResult(room=cmd.room, ok=False, error=f"prefill worker: {exc!r}"[:300],
                                error_kind="worker")
        self.channels.emit(cmd.room, res, last=True)
        span.set("tandem.finished_on_prefill", res.finished)
        if not res.ok:
            span.set("tandem.error_kind", res.error_kind)
            if res.error_kind != "aborted":  # the router's abort is no failure here
                span.fail(res.error or res.error_kind)
        span.end()

    async def _prefill_room(self, cmd: StartPrefill) -> PrefillResult:
        """Prefill and push one request; returns when its transfer reached a terminal state
        (or the first token already finished it). Decode's destination comes by `Route`."""
        room = cmd.room
        trace.mark(room, "prefill.call")
        self._ended.pop(room, None)
        r = self._room(room)
        assert r is not None
        try:
            if r.aborted:  # its abort ran first
                return PrefillResult(room=room, ok=False, error="aborted", error_kind="aborted")
            r.result = self._loop().create_future()
            return await self._prefill(r, cmd)
        finally:
            self._end(room)

    async def _prefill(self, r: _Room, cmd: StartPrefill) -> PrefillResult:
        room = cmd.room
        # Layer-wise push must know its destinations before the forward (its hook starts the
        # legs then): it waits for the route first.
        early = not self.cfg.layerwise_push
        try:
            if early:
                await self._apply(SubmitPrompt(room=room, prompt_ids=cmd.prompt_ids,
                                               params=cmd.params, destinations=None,
                                               traceparent=cmd.traceparent))
            try:  # a router that died before its `Route` must not hold the forward's pages
                got = await asyncio.wait_for(asyncio.shield(r.route), self.route_wait_s)
            except asyncio.TimeoutError:
                raise RuntimeError(f"no destination from the router within "
                                   f"{self.route_wait_s:g} s") from None
            if got is None:
                raise RuntimeError("aborted before decode's destination came")
            trace.mark(room, "prefill.dest")
            # Prefill rank p: the decode ranks it feeds (r -> r with equal TP; with different
            # sizes the re-sliced set, possibly none) and their destinations.
            routes = route_to_decode(got.decode_endpoint, got.destination, self.ranks.tp)
            endpoints = tuple(x.endpoints for x in routes)  # per prefill rank
            if endpoints not in self._connected:  # the handshakes, once per set of endpoints
                try:
                    await self._apply(Connect(endpoints=PerRank(endpoints)))
                except Exception as exc:
                    raise _HandshakeFailed(str(exc)) from exc
                self._connected.add(endpoints)
            dests = PerRank(tuple(x.destinations for x in routes))
            if early and isinstance(self.loop, WorkerLoop):
                # Applied by the loop thread right after the running forward's sync (not after
                # the whole step, as a command would be); a bad destination fails the room.
                self.worker.post_route(room, dests[0])
                self.loop.wake()
            elif early:  # TP: every rank applies it at the same point (ignored if it ended)
                await self._apply(RoutePrompt(room=room, destinations=dests))
            else:
                await self._apply(SubmitPrompt(room=room, prompt_ids=cmd.prompt_ids,
                                               params=cmd.params, destinations=dests,
                                               traceparent=cmd.traceparent))
            trace.mark(room, "prefill.routed")
        except Exception as exc:  # bad request, aborted before its route, handshake
            if early:
                await self._apply(Abort(room=room))  # the forward (or its held pages) goes
            return PrefillResult(room=room, ok=False, error=str(exc),
                                 error_kind=_failure_kind(exc))
        return await r.result

    def _route(self, cmd: Route) -> None:
        """Decode's reserve answer for a room (kept for its `StartPrefill` if it comes first;
        ignored once the prefill ended)."""
        r = self._room(cmd.room)
        if r is not None and not r.route.done():
            r.route.set_result(cmd)

    async def _abort(self, room: int) -> None:
        r = self._room(room)
        if r is not None:
            r.aborted = True  # a prefill yet to run ends at once
            if not r.route.done():  # a prefill waiting for its route stops waiting
                r.route.set_result(None)
        await self._apply(Abort(room=room))

    async def health(self) -> WorkerHealth:
        self._loop()
        return self._health()


# Rooms a PrefillActor remembers as ended (late calls for them are ignored): the newest this many.
ENDED_ROOMS = 4096


def _request_span(role: str, worker: str, traceparent: str, room: int,
                  num_prompt_tokens: int) -> otel.Span:
    """A traced request's span on worker `worker` (NOOP for an untraced one: tracing on in this
    process must not start a trace of its own for a request the router does not trace)."""
    if not traceparent:
        return otel.NOOP
    span = otel.start(role, traceparent, kind=otel.SERVER)
    span.set("tandem.worker", worker)
    span.set("tandem.room", str(room))  # 64-bit unsigned: beyond an int attribute's range
    span.set("gen_ai.usage.input_tokens", num_prompt_tokens)
    return span


class _HandshakeFailed(RuntimeError):
    """Connecting to a room's decode endpoints failed (whatever the transfer layer raised)."""


def _failure_kind(exc: Exception) -> str:
    """The `error_kind` of a prefill that failed before its transfer: "handshake" when
    connecting to decode failed (or the transfer layer refused a peer), else "invalid" (a bad
    request or destination, or aborted before its route)."""
    if isinstance(exc, _HandshakeFailed):
        return "handshake"
    if isinstance(exc, TransferError) and exc.kind is ErrorKind.HANDSHAKE:
        return "handshake"
    return "invalid"


class DecodeActor(WorkerFront):
    role = "decode"

    def __init__(self, cfg: WorkerConfig, rank: int = 0, tp: int = 1, ep: int = 1,
                 dp: int = 1) -> None:
        # Rooms aborted here lately: a reserve that arrives after its abort (the router
        # dispatches both without waiting) is refused instead of holding pages to its deadline
        self._aborted: OrderedDict[int, None] = OrderedDict()
        self._spans: dict[int, otel.Span] = {}  # traced rooms' spans, from reserve to their end
        super().__init__(cfg, rank, tp, ep, dp)

    def _make_worker(self, parallel, sync) -> DecodeWorker:
        return DecodeWorker(self.cfg, parallel, sync) if sync else DecodeWorker(self.cfg)

    def _on_outputs(self, outs: list[DecodeOutput]) -> None:
        self._deliver(self._push, outs)

    def _push(self, outs: list[DecodeOutput]) -> None:
        for o in outs:
            self.channels.emit(o.room, o, last=o.finished)
            if o.finished and self._spans:
                self._end_span(o)

    def _end_span(self, out: DecodeOutput) -> None:
        span = self._spans.pop(out.room, otel.NOOP)
        span.set("gen_ai.response.finish_reasons", out.finish_reason or "")
        if out.finish_reason == "error":
            span.fail(out.error or "failed")
        span.end()

    async def command(self, cmd: DecodeCommand) -> bytes | None:
        """A router's command (messages/commands.py), told apart by type: `Reserve` (answers
        the destination blob), `Abort`."""
        self._loop()
        match cmd:
            case Reserve():
                return await self._reserve(cmd)
            case Abort():
                return await self._abort(cmd.room)
            case _:
                raise TypeError(f"decode worker: no command {type(cmd).__name__}")

    async def _reserve(self, cmd: Reserve) -> bytes:
        """Every rank's encoded Destination, as one blob (with DP: the taking rank's, tagged
        with its DP rank); the room's outputs (`DecodeOutput`) come on the command's channel.
        Raises ValueError (bad request) or OutOfCapacity."""
        room = cmd.room
        trace.mark(room, "decode.reserve")
        if room in self._aborted:
            raise ValueError(f"room: {room} was aborted before its reserve arrived")
        self.channels.bind(room, cmd.channel)
        span = _request_span("decode", self.cfg.name, cmd.traceparent, room, len(cmd.prompt_ids))
        try:
            per_rank = await self._apply(ReserveRoom(room=room, prompt_ids=cmd.prompt_ids,
                                                     params=cmd.params,
                                                     traceparent=span.traceparent))
            if span is not otel.NOOP:  # ends with the room's last output
                self._spans[room] = span
            if self.ranks.dp == 1:
                return encode_per_rank(per_rank)
            # The taking DP rank's TP ranks answered (DP-major: they are consecutive).
            owner = next(r for r, d in enumerate(per_rank) if d is not None)
            return encode_dp_destination(owner // self.ranks.tp,
                                         per_rank[owner : owner + self.ranks.tp])
        except BaseException as exc:
            self.channels.unbind(room)
            self._spans.pop(room, None)
            span.fail(exc)
            span.end()
            raise

    async def _abort(self, room: int) -> None:
        self._aborted[room] = None
        while len(self._aborted) > 4096:
            self._aborted.popitem(last=False)
        await self._apply(Abort(room=room))
        # A reserved request that never started still ends its stream (a started one's abort
        # output follows from the loop and finds the room unbound: dropped).
        aborted = DecodeOutput(room=room, token_ids=(), text_delta="", finished=True,
                               finish_reason="abort")
        self.channels.emit(room, aborted, last=True)
        if self._spans:
            self._end_span(aborted)

    async def limits(self) -> tuple[int, int, int]:
        """(vocab_size, max_model_len, max_request_tokens) the router validates against."""
        eng = self.worker.engine
        slack = eng.spec.slots_per_round
        return (eng.model_cfg.vocab_size, eng.max_model_len,
                eng.allocator.num_usable * eng.cfg.page_size - slack)

    async def health(self) -> WorkerHealth:
        """The leader of a DP worker reports pages, slots, running requests and acceptance
        counts summed over its DP ranks (what placement and the router's stats should see);
        a follower, its own."""
        self._loop()
        front = self.ranks.rank == 0
        st = self.worker.group_spec_totals() if front else self.worker.spec_totals()
        load = self.worker.group_load() if front else self.worker.pool_load()
        return dataclasses.replace(
            self._health(), mean_acceptance_length=st.mean_acceptance_length,
            per_position=st.per_position(), num_rounds=st.num_rounds,
            num_free_slots=load.num_free_slots, num_slots=load.num_slots,
            num_free_pages=load.num_free_pages, num_pages=load.num_pages,
            num_running=load.num_running)
