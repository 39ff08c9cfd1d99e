"""`PrefillWorker`: computes prompts (target and draft prefill) and pushes their KV and EAGLE
seed to the decode worker each request names.

Plain Python, single-threaded: the owner (a Ray actor's loop thread, or a test) calls `step()`
repeatedly and every other method between steps. For each request it:
  1. prefills it (chunked, batched with others) in a prefill-only SpecEngine,
  2. hands its pages + seed to the KV sender (`send`, bounded batches, completion notification),
  3. frees the pages once the sender reports a terminal state (never earlier: the backend may
     still be reading them), and reports a `PrefillResult`.
With `cfg.layerwise_push`, step 2 starts inside the forward that completes the prompt: target
layer l's pages leave right after layer l ran (layerwise.py), to every decode rank the request
goes to; the rest follows the hand-off.

With TP, every rank runs this worker (worker/group_loop.py): rank r pushes the KV heads it holds
with its own sender to decode rank r, or, when the decode worker's TP size differs, to every
decode rank taking heads from it (one `send` to several destinations; a rank whose heads lower
ranks already send has none and counts as done at once, see worker/ranks.route_to_decode).
Send outcomes arrive per rank at different times; the ranks all-gather them each step, and a
request's pages are freed (on every rank, in the same step) and its result reported only once
every rank's transfer is terminal: DONE on all, else a failure.

Owns: the room table (`_rooms`: one `_Room` per request, from `submit` until its result is
queued; its `state` says where it is and which pages it holds), the rooms that ended before
their destination came (`_ended_unrouted`), the sender and the layer-wise pusher (and `spans`,
the phases of its traced rooms: worker/spans.py). A room leaves the table where its pages go
back: to the engine (PREFILLING: `engine.abort`), from its parked hand-off (PARKED), or once its
transfer is terminal on every rank (SENDING).
"""

from __future__ import annotations

import enum
import logging
import queue
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from tandem import trace
from tandem.engine import FinishReason
from tandem.engine.parallel import ParallelContext
from tandem.engine.sampling import SamplingParams
from tandem.kvtransfer import (Destination, EndpointInfo, PrefillSender, TransferError,
                               TransferMetrics, TransferState)
from tandem.messages import (Abort, Connect, FirstToken, GetEndpoint, PrefillResult,
                             PrefillWorkerCommand, RoutePrompt, SubmitPrompt)
from tandem.prefill_node.layerwise import LayerwisePusher
from tandem.spec.handoff import PrefillHandoff
from tandem.worker import (SOLO, RankSync, RoomSpans, WorkerConfig, aux_buffer, build_engine,
                           compat_info, kv_layout)

log = logging.getLogger(__name__)

# Rooms ended before their destination came, remembered (the newest this many) so that a route
# arriving afterwards still tells decode to release what it reserved.
ENDED_UNROUTED = 4096


class RoomState(enum.Enum):
    """Where a request is on a prefill worker; it leaves the table when it ends."""

    # Its forward is queued or running in the engine, which owns its pages.
    PREFILLING = "prefilling"
    # Its forward is over; its hand-off (holding the pages) waits for decode's destination.
    PARKED = "parked"
    # Its KV + seed are being pushed; its pages are held until the transfer is terminal on
    # every rank.
    SENDING = "sending"


@dataclass(slots=True)
class _Room:
    """One request on this worker (the same entry on every rank)."""

    state: RoomState
    # One Destination per decode rank this rank feeds (empty: it sends nothing); None while
    # decode's destination is still to come (concurrent dispatch: `route`; never SENDING)
    dests: tuple[Destination, ...] | None
    handoff: PrefillHandoff | None = None  # PARKED: the forward's hand-off, holding the pages
    # SENDING: what its result needs once every rank's transfer is terminal
    page_ids: tuple[int, ...] = ()
    first_token: int = 0
    first_text: str = ""
    done: set[int] = field(default_factory=set)  # ranks whose transfer reached DONE
    failed: dict[int, tuple[str, str]] = field(default_factory=dict)  # rank -> (error, kind)


@dataclass(frozen=True, slots=True)
class _RankOutcome:
    """One rank's terminal transfer of a room (all-gathered: every rank acts on the joint view)."""

    room: int
    ok: bool
    error: str = ""  # "" when ok
    kind: str = ""  # ErrorKind value (or the terminal state's); "" when ok


class PrefillWorker:
    def __init__(self, cfg: WorkerConfig, parallel: ParallelContext | None = None,
                 sync: RankSync = SOLO) -> None:
        self.cfg, self.sync = cfg, sync
        self.engine = build_engine(cfg, parallel)
        self._rooms: dict[int, _Room] = {}  # room -> its request, from submit to its result
        self._ended_unrouted: OrderedDict[int, None] = OrderedDict()  # see ENDED_UNROUTED
        self._deferred: list[_RankOutcome] = []  # outcomes from `route` calls
        self._aux = aux_buffer(self.engine, cfg.aux_slots)  # seed staging (the sender owns it)
        layout = kv_layout(self.engine, self._aux)
        self.sender = PrefillSender(cfg.transfer_backend, layout, compat_info(self.engine, cfg),
                                    config=cfg.endpoint, faults=cfg.faults)
        # Every transfer starts (BEGIN) before the forward that completes its prompt, so the
        # decode side's grant overlaps the forward; layer-wise push also sends layer l's pages
        # while layer l+1 computes (layerwise.py).
        self.pusher = LayerwisePusher(self.sender, layout, self._dests_of,
                                      device=self.engine.device, per_layer=cfg.layerwise_push)
        self.engine.prefill_layer_hook = self.pusher.hook_for
        self.engine.prefill_synced_hook = self._after_target
        # Destinations posted from another thread (`post_route`); applied by the owner at the
        # start of a step and right after a prefill forward's sync.
        self._routes: queue.SimpleQueue[tuple[int, bytes | Sequence[bytes]]] = queue.SimpleQueue()
        self._bad_routes: list[tuple[int, str]] = []  # (room, error) found inside a step
        self._results: list[PrefillResult] = []
        self._sessions: set[int] = set()  # decode endpoints connected (not per request)
        # Called (on the stepping thread) with the first token (its text, its logprob when
        # asked) as soon as a forward completes a prompt that goes on to decode, before its KV
        # is pushed: the router streams the first token from here instead of waiting for
        # decode's admission.
        self.on_first: Callable[[FirstToken], None] | None = None
        # Traced rooms' phases (rank 0 reports them)
        self.spans = RoomSpans(reporting=sync.rank == 0, page_bytes=layout.bytes_per_page)

    def apply(self, cmd: PrefillWorkerCommand) -> bytes | None:
        """A command from the worker's front (messages/commands.py), between two steps; fields
        that differ per rank are read at this rank."""
        rank = self.sync.rank
        match cmd:
            case SubmitPrompt():
                dests = None if cmd.destinations is None else cmd.destinations[rank]
                self.submit(cmd.room, list(cmd.prompt_ids), cmd.params, dests)
                self.spans.open(cmd.room, cmd.traceparent, "prefill.queue")
                return None
            case RoutePrompt():
                return self.route(cmd.room, cmd.destinations[rank])
            case Abort():
                return self.abort(cmd.room)
            case Connect():
                return self.connect(cmd.endpoints[rank])
            case GetEndpoint():
                return self.endpoint()
        raise TypeError(f"prefill worker: no command {type(cmd).__name__}")

    def endpoint(self) -> bytes:
        return self.sender.info().encode()

    def connect(self, decode_endpoint: bytes | Sequence[bytes]) -> None:
        """Handshake with a decode endpoint, or each of several (different TP sizes); once per
        decode endpoint (idempotent)."""
        for blob in [decode_endpoint] if isinstance(decode_endpoint, bytes) else decode_endpoint:
            info = EndpointInfo.decode(blob)
            if info.session not in self._sessions:
                self.sender.connect(info)
                self._sessions.add(info.session)

    def submit(self, room: int, prompt_ids: list[int], params: SamplingParams,
               destination: bytes | Sequence[bytes] | None) -> None:
        """`destination`: one per decode rank this rank feeds (none: it sends nothing). None:
        not known yet (decode's reserve still runs): the prompt's forward starts now and its
        hand-off waits for `route` (concurrent dispatch)."""
        dests = None if destination is None else self._destinations(room, destination)
        self.engine.add_prefill_request(prompt_ids, params, str(room))
        trace.mark(room, "prefill.submit")
        self._rooms[room] = _Room(state=RoomState.PREFILLING, dests=dests)

    def post_route(self, room: int, destination: bytes | Sequence[bytes]) -> None:
        """`route`, from any thread (the one method that is): queued, and applied at the start
        of the next step or -- when it comes during a prompt's forward -- right after that
        forward's sync, so the transfer starts before the draft prefill instead of after the
        step. A destination that does not fit ends the room with a failed result. Single-rank
        workers only: with TP every rank must apply a route at the same point (`route`)."""
        self._routes.put((room, destination))

    def _apply_routes(self, on_error: Callable[[int, str], None]) -> None:
        """Apply the posted routes; `on_error(room, error)` for a destination that does not fit."""
        while True:
            try:
                room, destination = self._routes.get_nowait()
            except queue.Empty:
                return
            try:
                self.route(room, destination)
            except ValueError as exc:
                on_error(room, str(exc))

    def _fail_route(self, room: int, error: str) -> None:
        self._stop(room, error, "invalid")

    def _after_target(self, chunks) -> None:
        """The engine's `prefill_synced_hook` (inside its step): start transfers whose
        destination arrived during this forward, and queue the target KV of those started
        (pusher.after_target). A room whose destination does not fit ends after the step
        (never an abort in the middle of the engine's step)."""
        self._apply_routes(lambda room, error: self._bad_routes.append((room, error)))
        self.pusher.after_target(chunks)

    def route(self, room: int, destination: bytes | Sequence[bytes]) -> None:
        """Where a room submitted without a destination goes. Its transfer starts now if its
        forward is over (the hand-off waited), else with the forward as usual. A room that
        ended meanwhile is not sent; if it was stopped (aborted, failed) decode is told to
        release its reservation now (the router's abort of decode may never come); one its
        first token finished is left to the router (which aborts decode for it)."""
        entry = self._rooms.get(room)
        if entry is None or entry.dests is not None:
            if room in self._ended_unrouted:
                del self._ended_unrouted[room]
                try:
                    dests = self._destinations(room, destination)
                except (ValueError, TypeError):
                    return  # not a destination we could tell anything
                self.sender.decline(dests)
            return
        entry.dests = self._destinations(room, destination)
        if entry.state is RoomState.PARKED:
            h, entry.handoff = entry.handoff, None
            self._hand_off(room, entry, h, early=False, local=self._deferred)

    def _destinations(self, room: int, destination: bytes | Sequence[bytes]
                      ) -> tuple[Destination, ...]:
        blobs = [destination] if isinstance(destination, bytes) else list(destination)
        dests = tuple(Destination.decode(b) for b in blobs)
        for dest in dests:
            if dest.room != room:
                raise ValueError(f"destination: for room {dest.room}, not {room}")
            if dest.receiver_session not in self._sessions:
                raise ValueError("destination: its decode endpoint was never connected")
        return dests

    def _dests_of(self, room: int) -> tuple[Destination, ...]:
        """The layer-wise pusher's view: every decode rank the room goes to (none: this rank
        sends nothing, or the room was aborted)."""
        entry = self._rooms.get(room)
        if entry is None or entry.state is not RoomState.PREFILLING:
            return ()
        return entry.dests or ()

    def abort(self, room: int) -> None:
        self._stop(room, "aborted", "aborted")

    def _stop(self, room: int, error: str, kind: str) -> None:
        """End `room` wherever it is; a room not sending yet reports (error, kind) at once."""
        entry = self._rooms.get(room)
        if entry is None:
            return  # not here (any more)
        if entry.state is RoomState.SENDING:
            self.sender.abort(room)  # the outcome (and the page release) comes through poll()
            return
        del self._rooms[room]
        if entry.dests is None:  # no destination yet: forward running or hand-off waiting
            self._ended_unrouted[room] = None  # a route that still comes is declined
            while len(self._ended_unrouted) > ENDED_UNROUTED:
                self._ended_unrouted.popitem(last=False)
        else:  # its forward still runs
            # Decode reserved for it and waits for a BEGIN that will not come: say so, so its
            # claim goes back now and not at its transfer deadline.
            self.sender.decline(entry.dests)
        if entry.state is RoomState.PREFILLING:
            self.engine.abort(str(room))
        elif entry.handoff is not None and entry.handoff.page_ids:
            self.engine.free_pages(entry.handoff.page_ids)
        self._results.append(PrefillResult(room=room, ok=False, error=error, error_kind=kind))

    def busy(self) -> bool:
        return (self.engine.has_unfinished() or not self._routes.empty()
                or any(e.state is RoomState.SENDING for e in self._rooms.values()))

    def step(self) -> list[PrefillResult]:
        self._apply_routes(self._fail_route)
        # this rank's terminal transfers; hand-offs `route` started between steps first
        local, self._deferred = self._deferred, []
        handoffs: list[PrefillHandoff] = []
        if self.engine.has_unfinished():
            queued = self.spans.in_phase("prefill.queue") if self.spans else ()
            t0 = time.time_ns() if queued else 0
            for o in self.engine.step():
                if o.finish_reason is FinishReason.ERROR:  # never handed off
                    self._request_failed(int(o.req_id), o.error)
            handoffs = self.engine.take_handoffs()
            if queued:  # the traced rooms this step took out of the queue began their forward
                waiting = {r.req_id for r in self.engine.scheduler.waiting}
                self.spans.started((q for q in queued if str(q) not in waiting), t0)
            self._announce_first(handoffs)  # before posting the KV writes (CPU work)
            self.pusher.pump()  # before the hand-offs sync on their seeds (see pusher.pump)
        failed, self._bad_routes = self._bad_routes, []  # routes that failed in the step
        for room, error in failed:
            self._fail_route(room, error)
        for h in handoffs:
            room = int(h.req_id)
            entry = self._rooms.get(room)
            if entry is not None and entry.dests is None:
                if h.finished:  # its first token ended it: nothing to send, wherever
                    del self._rooms[room]
                    self._results.append(_finished_here(h))
                else:  # decode's destination still to come (route)
                    entry.state, entry.handoff = RoomState.PARKED, h
                    self.spans.phase(room, "prefill.wait_route")
                continue
            early = self.pusher.started(room)
            if early and (entry is None or h.finished):
                # No transfer wanted after all (layerwise.py `drop`). A finished request's pages
                # are free already; reads still in flight cannot harm them (read-only), and
                # they land in decode pages that stay leased until the room's end.
                self.pusher.drop(room, abort=entry is None)
            if entry is None:  # aborted while its last chunk ran
                if h.page_ids:
                    self.engine.free_pages(h.page_ids)
                continue
            if h.finished:
                del self._rooms[room]
                self._results.append(_finished_here(h))
                continue
            self._hand_off(room, entry, h, early=early, local=local)
        early_outcomes = self.pusher.take_outcomes()
        for outcome in early_outcomes + self.sender.poll():
            err = outcome.error
            ok = outcome.state == TransferState.DONE
            trace.mark(outcome.room, "prefill.transfer_end")
            local.append(_RankOutcome(room=outcome.room, ok=True) if ok else _RankOutcome(
                room=outcome.room, ok=False, error=str(err) if err else outcome.state.value,
                kind=err.kind.value if err else outcome.state.value))
        self._agree_on_outcomes(local)
        out, self._results = self._results, []
        self.spans.results(out)
        return out

    def _request_failed(self, room: int, error: str) -> None:
        """The engine ended `room` itself: its own row failed. Its pages are back already and
        it is not handed off; a transfer started early is left to the router's abort of
        decode, as for a request its first token finished (layerwise.py `drop`)."""
        entry = self._rooms.get(room)
        if entry is not None and entry.state is RoomState.PREFILLING:
            del self._rooms[room]
        self.pusher.drop(room, abort=False)
        self._results.append(PrefillResult(room=room, ok=False, error=error,
                                           error_kind="request"))

    def _announce_first(self, handoffs: Sequence[PrefillHandoff]) -> None:
        """`on_first` for each prompt completed in this step that goes on to decode (not
        finished by its first token, not aborted)."""
        for h in handoffs:
            room = int(h.req_id)
            trace.mark(room, "prefill.forward_end")
            self.spans.end_phase(room)
            entry = self._rooms.get(room)
            if (self.on_first is not None and not h.finished and entry is not None
                    and entry.state is not RoomState.SENDING):
                self.on_first(FirstToken(room=room, token=h.first_token, text=h.first_text,
                                         logprob=h.first_logprob))

    def _hand_off(self, room: int, entry: _Room, h: PrefillHandoff, *, early: bool,
                  local: list[_RankOutcome]) -> None:
        """Push a prompt's KV + seed (its forward is over) to the room's destinations; a
        failure to start is terminal on this rank at once (into `local`, agreed on in the next
        outcome round)."""
        trace.mark(room, "prefill.hand_off")
        self.spans.phase(room, "kv.push")
        self.spans.pages(room, len(h.page_ids))
        entry.state, entry.page_ids = RoomState.SENDING, h.page_ids
        entry.first_token, entry.first_text = h.first_token, h.first_text
        dests = entry.dests
        if not dests:  # re-sliced: every head of this rank goes from a lower rank
            local.append(_RankOutcome(room=room, ok=True))
            return
        try:
            if early:
                self.pusher.complete(room, h.page_ids, h.seed_bytes())
            else:
                self.sender.send(dests, h.page_ids, h.seed_bytes())
        except TransferError as exc:
            self.sender.abort(room)  # a leg begun must not wait for its deadline (nor decode)
            local.append(_RankOutcome(room=room, ok=False, error=str(exc), kind=exc.kind.value))

    def _agree_on_outcomes(self, local: list[_RankOutcome]) -> None:
        """All-gather every rank's terminal transfers; a room whose transfer is terminal on
        every rank frees its pages (no rank can still read them) and reports its result."""
        touched: list[int] = []
        for rank, outcomes in enumerate(self.sync.all_gather(local)):
            for o in outcomes:
                entry = self._rooms.get(o.room)
                if entry is None or entry.state is not RoomState.SENDING:
                    continue
                if o.ok:
                    entry.done.add(rank)
                else:  # the first failure is the cause (an abort of the other legs follows)
                    entry.failed.setdefault(rank, (o.error, o.kind))
                touched.append(o.room)
        for room in dict.fromkeys(touched):  # first-touch order: the same on every rank
            entry = self._rooms[room]
            if len(entry.done) + len(entry.failed) < self.sync.size:
                if entry.failed:  # one rank failed: the others' pushes are useless, stop them
                    self.sender.abort(room)
                continue
            del self._rooms[room]
            self.engine.free_pages(entry.page_ids)
            if not entry.failed:
                self._results.append(PrefillResult(room=room, ok=True,
                                                   first_token=entry.first_token,
                                                   first_text=entry.first_text))
            else:
                error, kind = entry.failed[min(entry.failed)]
                self._results.append(PrefillResult(room=room, ok=False, error=error,
                                                   error_kind=kind))

    def num_free_pages(self) -> int:
        return self.engine.allocator.num_free

    def num_pages(self) -> int:
        return self.engine.allocator.num_usable

    def transfer_metrics(self) -> TransferMetrics:
        """This rank's transfers since it started (what its health answer reports)."""
        return self.sender.metrics()

    def close(self) -> None:
        self.sender.close()


def _finished_here(h: PrefillHandoff) -> PrefillResult:
    """The result of a request its first token ended: no first token for the client when that
    token completed a stop string (docs/architecture.md, "Request semantics")."""
    return PrefillResult(room=int(h.req_id), ok=True,
                         first_token=h.first_token if h.first_token_returned else None,
                         first_text=h.first_text, finished=True, finish_reason=h.finish_reason,
                         first_logprob=h.first_logprob if h.first_token_returned else None)
