"""`DecodeWorker`: reserves pages for incoming requests, admits them when their KV and seed
have landed, and runs the speculative loop with continuous batching.

Plain Python, single-threaded (the owner calls `step()` and the other methods between steps).
Page ownership over a request's life:
  reserve: the allocator hands out pages for prompt + max_new_tokens + one round's slack, and
           the KV receiver claims them (and an aux slot) for the transfer;
  landed:  the receiver's release (outcome DONE) returns the slot; the pages go to the engine
           with the admitted request, which frees them when the request ends;
  failed or aborted before landing: the receiver's release -- called only once no writer can
           touch them any more -- gives the pages back to the allocator.
Because decode reserves a request's whole budget up front, a running request never needs a
page it does not have: out of pages means `reserve` refuses (the router retries or reports
RESOURCE_EXHAUSTED), never a crash or a preemption mid-generation.

With TP, every rank runs this worker (see worker/group_loop.py) and has its own receiver: rank
r's KV lands in rank r's pool at its own time. The ranks agree on transfer events each step
(`sync.all_gather`): a request is admitted only when it landed on every rank, and its pages and
slot go back (on every rank, in the same step) only once every rank's receiver is done with
them. So the allocator and slot list stay identical on every rank, and so do the schedules.

With DP attention (`parallel.dp` of size > 1) the DP ranks hold *different* requests, pages,
seed slots and receivers; a DP rank may itself be a TP group, whose ranks agree on transfer
events as above. The DP ranks coordinate over `sync` (one voice per DP rank, ranks.split_sync):
  reserve: every rank gets the call; they all-gather their loads and the least loaded rank that
           fits (by reserved pages, ties to the lowest rank) takes it -- the others return None;
  step:    a rank admits what landed on its own receiver (no agreement needed); the ranks agree
           whether any of them has work, and then every rank steps its engine, whose phases join
           up (an idle rank runs empty target forwards, see `LLMEngine.dp_join`); the step's
           outputs of every rank are all-gathered so rank 0 can stream them, with every rank's
           load and acceptance counts, so rank 0 reports the worker's sums.

Owns: the room table (`_rooms`: one `_Room` per request from `reserve` until it is admitted or
its pages go back; its `state` says whether it still goes to the client), the free seed slots,
the receiver (and `spans`, the phases of its traced rooms: worker/spans.py). An admitted
request belongs to the engine (its scheduler's request table), which frees its pages when it
ends; the worker keeps no second record of it.
"""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass, field

import torch

from tandem import trace
from tandem.engine import FinishReason, RequestOutput
from tandem.engine.llm import validate_prompt
from tandem.engine.parallel import ParallelContext
from tandem.engine.sampling import SamplingParams
from tandem.kvtransfer import (DecodeReceiver, Received, ReceiveFailed, Release, TransferMetrics,
                               TransferState)
# OutOfCapacity: raised by `reserve`; the router matches it by type
from tandem.messages import (Abort, DecodeOutput, DecodeWorkerCommand, GetEndpoint, OutOfCapacity,
                             ReserveRoom)
from tandem.spec.engine import SpecStats
from tandem.spec.handoff import decode_first_logprob, decode_seed
from tandem.worker import (SOLO, RankSync, RoomSpans, WorkerConfig, aux_buffer, build_engine,
                           compat_info, kv_layout, split_sync)

log = logging.getLogger(__name__)


def output_of(o: RequestOutput) -> DecodeOutput:
    """The event of an engine output of request `o.req_id` (the room, as a string)."""
    failed = o.finish_reason is FinishReason.ERROR
    return DecodeOutput(
        room=int(o.req_id), token_ids=o.new_token_ids, text_delta=o.text_delta,
        finished=o.finished, finish_reason=o.finish_reason.value if o.finish_reason else None,
        error=o.error, error_kind="request" if failed else "", logprobs=o.logprobs)


class RoomState(enum.Enum):
    """Where a reserved request is on a decode worker, until admission hands it to the engine."""

    # Its pages and seed slot are claimed; its KV and seed have not landed on every rank yet.
    RESERVED = "reserved"
    # Aborted, or its failure reported: nothing more goes to the client. Its pages and slot go
    # back once every rank's receiver let go of them (or, landed after all, at once).
    ENDED = "ended"


@dataclass(slots=True)
class _Room:
    """A reserved request whose KV has not landed on every rank yet (same on every rank)."""

    state: RoomState
    prompt_ids: list[int]
    params: SamplingParams
    page_ids: tuple[int, ...]
    aux_slot: int
    landed: set[int] = field(default_factory=set)  # ranks whose KV + seed arrived
    released: set[int] = field(default_factory=set)  # ranks whose receiver gave the pages up
    payload: bytes = b""  # rank 0's seed (every rank admits from the same bytes)
    error: str = ""  # the first rank's failure; "" while none failed


@dataclass(frozen=True, slots=True)
class PoolLoad:
    """KV pages, seed slots and requests of one rank, or summed over a worker's DP ranks."""

    num_free_pages: int
    num_pages: int
    num_free_slots: int
    num_slots: int
    num_running: int

    def __add__(self, other: PoolLoad) -> PoolLoad:
        return PoolLoad(*(a + b for a, b in zip(_fields(self), _fields(other))))


def _fields(load: PoolLoad) -> tuple[int, ...]:
    return (load.num_free_pages, load.num_pages, load.num_free_slots, load.num_slots,
            load.num_running)


@dataclass(frozen=True, slots=True)
class SpecTotals:
    """Acceptance counts of one rank's engine (a copy of its SpecStats), or summed over a
    worker's DP ranks: counts add up, the means are recomputed from the sums."""

    num_rounds: int = 0  # request-rounds
    num_tokens: int = 0  # tokens committed by those rounds (accepted drafts + 1 each)
    accepted_at: tuple[int, ...] = ()  # [k] rounds accepting >= j+1 drafts

    @staticmethod
    def of(stats: SpecStats) -> SpecTotals:
        return SpecTotals(stats.num_rounds, stats.num_tokens, tuple(stats.accepted_at))

    def __add__(self, other: SpecTotals) -> SpecTotals:
        # A rank that never verified has no positions yet: missing positions count 0.
        width = max(len(self.accepted_at), len(other.accepted_at))
        mine = self.accepted_at + (0,) * (width - len(self.accepted_at))
        theirs = other.accepted_at + (0,) * (width - len(other.accepted_at))
        return SpecTotals(self.num_rounds + other.num_rounds, self.num_tokens + other.num_tokens,
                          tuple(x + y for x, y in zip(mine, theirs)))

    @property
    def mean_acceptance_length(self) -> float:
        return self.num_tokens / self.num_rounds if self.num_rounds else 0.0

    def per_position(self) -> tuple[float, ...]:
        """P(draft j accepted), j = 1 .. k."""
        return tuple(a / self.num_rounds if self.num_rounds else 0.0 for a in self.accepted_at)


@dataclass(frozen=True, slots=True)
class _ReserveBid:
    """One DP rank's answer to "can you take this request" (what reserve all-gathers)."""

    reserved_pages: int  # pages held by pending and running requests: the load
    fits: bool  # enough free pages and a free seed slot
    holds_room: bool  # this room is already on this rank
    load: PoolLoad


def choose_dp_rank(bids: list[_ReserveBid]) -> int | None:
    """The least loaded rank (by reserved pages) that fits; ties go to the lowest rank."""
    fitting = [r for r, b in enumerate(bids) if b.fits]
    return min(fitting, key=lambda r: (bids[r].reserved_pages, r), default=None)


@dataclass(frozen=True, slots=True)
class _StepReport:
    """One DP rank's step: its outputs and state (what the DP ranks all-gather every step)."""

    outputs: tuple[DecodeOutput, ...]
    busy: bool
    load: PoolLoad
    spec: SpecTotals  # this rank's acceptance counts so far (the front reports the sum)


@dataclass(frozen=True, slots=True)
class _RankEvents:
    """One rank's transfer events of one step (what the ranks all-gather)."""

    landed: tuple[tuple[int, bytes], ...]  # (room, seed bytes)
    failed: tuple[tuple[int, str], ...]  # (room, error)
    released: tuple[int, ...]  # rooms whose pages this rank's receiver gave back (not DONE)


def settle(device) -> None:
    """Wait for the work queued on `device` (SYNC: before pages go to a transfer; a step
    leaves at most its draft-extend and the next round's drafting and verify queued)."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


class DecodeWorker:
    def __init__(self, cfg: WorkerConfig, parallel: ParallelContext | None = None,
                 sync: RankSync = SOLO) -> None:
        self.cfg, self.sync = cfg, sync
        # Transfer events are agreed among the ranks that share a request (TP); reserves and
        # steps are coordinated among the ranks that split the requests (DP).
        self._tp_sync, self._dp_sync = split_sync(sync, parallel or ParallelContext())
        self.engine = build_engine(cfg, parallel)
        self.engine.overlap_ok = False  # KV lands in free pages: none reused mid-step
        self._aux = aux_buffer(self.engine, cfg.aux_slots)  # the receiver's landing slots
        self._free_slots = list(range(cfg.aux_slots))
        self._settled_at = 0  # the allocator's num_freed at the last `settle`
        self.receiver = DecodeReceiver(
            cfg.transfer_backend, kv_layout(self.engine, self._aux),
            compat_info(self.engine, cfg), release=self._on_release, config=cfg.endpoint)
        self._rooms: dict[int, _Room] = {}  # room -> reserved, KV not landed everywhere
        self._released_local: list[int] = []  # rooms released (not DONE) since the last step
        self._outputs: list[DecodeOutput] = []
        self._group_busy = False  # DP: whether any rank was busy after the last step
        self._group_load: PoolLoad | None = None  # DP: every rank's load after the last step
        self._group_spec: SpecTotals | None = None  # DP: every rank's acceptance, summed
        # Traced rooms' phases, reported by the rank that holds the room (rank 0 of a TP group)
        self.spans = RoomSpans(reporting=self._tp_sync.rank == 0,
                               page_bytes=self.receiver.layout.bytes_per_page)

    def apply(self, cmd: DecodeWorkerCommand) -> bytes | None:
        """A command from the worker's front (messages/commands.py), between two steps."""
        match cmd:
            case ReserveRoom():
                dest = self.reserve(cmd.room, list(cmd.prompt_ids), cmd.params)
                if dest is not None:  # this rank took the room
                    self.spans.open(cmd.room, cmd.traceparent, "kv.receive")
                return dest
            case Abort():
                return self.abort(cmd.room)
            case GetEndpoint():
                return self.endpoint()
        raise TypeError(f"decode worker: no command {type(cmd).__name__}")

    def endpoint(self) -> bytes:
        return self.receiver.info().encode()

    def pages_for(self, prompt_len: int, max_new_tokens: int) -> int:
        total = min(prompt_len + max_new_tokens, self.engine.max_model_len)
        return self.engine.scheduler.pages_needed(total + self.engine.spec.slots_per_round)

    def reserve(self, room: int, prompt_ids: list[int], params: SamplingParams) -> bytes | None:
        """Claim pages and a seed slot for `room`; returns the encoded Destination for the
        prefill worker -- with DP attention only on the DP rank that took it (None on the
        others). Raises ValueError (bad request) or OutOfCapacity (try later), on every rank."""
        # Checks that raise before the all-gather depend only on the request and the config:
        # every rank raises alike, so no rank waits in a collective the others skip.
        validate_prompt(prompt_ids, self.engine.model_cfg.vocab_size, self.engine.max_model_len)
        need = self.pages_for(len(prompt_ids), params.max_new_tokens)
        if need > self.engine.allocator.num_usable:
            raise ValueError(f"max_new_tokens: the request needs {need} KV pages; this decode "
                             f"worker has {self.engine.allocator.num_usable}")
        alloc = self.engine.allocator
        bids = self._dp_sync.all_gather(_ReserveBid(
            reserved_pages=alloc.num_usable - alloc.num_free,
            fits=alloc.can_alloc(need) and bool(self._free_slots),
            holds_room=room in self._rooms or str(room) in self.engine.scheduler.requests,
            load=self.pool_load()))
        if any(b.holds_room for b in bids):
            raise ValueError(f"room: {room} is already on this worker")
        owner = choose_dp_rank(bids)
        if owner is None:
            raise OutOfCapacity(
                f"need {need} pages and a seed slot; free pages "
                f"{[b.load.num_free_pages for b in bids]}, free slots "
                f"{[b.load.num_free_slots for b in bids]} (per DP rank)")
        if owner != self._dp_sync.rank:
            return None
        # A transfer writes these pages outside the stream's order; pages a step freed may
        # still be written by work it queued after its host read (draft-extend, drafting and
        # verifying ahead: spec/ahead.py). Once pages were freed, that work finishes first.
        if alloc.num_freed != self._settled_at:
            settle(self.engine.device)
            self._settled_at = alloc.num_freed
        pages = tuple(alloc.alloc(need))
        slot = self._free_slots.pop()
        dest = self.receiver.expect(room, pages, slot, timeout_s=self.cfg.transfer_timeout_s)
        self._rooms[room] = _Room(state=RoomState.RESERVED, prompt_ids=list(prompt_ids),
                                  params=params, page_ids=pages, aux_slot=slot)
        return dest.encode()

    def abort(self, room: int) -> None:
        self.spans.aborted(room)
        entry = self._rooms.get(room)
        if entry is not None:
            # The receiver releases the pages when no writer can touch them any more (a no-op
            # on a rank where the KV already landed: those pages are freed with the others').
            entry.state = RoomState.ENDED
            self.receiver.abort(room)
            return
        if self.engine.abort(str(room)):
            self._outputs.append(DecodeOutput(room=room, token_ids=(), text_delta="",
                                              finished=True, finish_reason="abort"))

    def _on_release(self, rel: Release) -> None:
        # DONE: the pages hold the request (its Received event comes with this release).
        # Otherwise no writer can touch them any more; they go back once every rank says so.
        if rel.outcome != TransferState.DONE:
            self._released_local.append(rel.room)

    def busy(self) -> bool:
        """Whether to step again at once (DP: whether any rank was busy after the last step)."""
        return self._group_busy if self._dp_sync.size > 1 else self._busy_here()

    def _busy_here(self) -> bool:
        return self.engine.has_unfinished() or bool(self._rooms)

    def step(self) -> list[DecodeOutput]:
        admitted = self._agree_on_transfers()
        if admitted and self._dp_sync.size == 1:
            # The prefill's first token streams now, not after this step's round (one round
            # of TTFT). Every TP rank admitted the same requests, so all of them skip the
            # round together; the loop steps again at once (the engine has work).
            out, self._outputs = self._outputs, []
            self.spans.outputs(out)
            return out
        has_work = self.engine.has_unfinished()
        if self._dp_sync.size > 1:
            # DP attention: while any rank has requests every rank steps its engine (an idle
            # one joins each target forward with an empty batch). The flags ride the gloo
            # control channel: no device sync.
            has_work = any(self._dp_sync.all_gather(has_work))
        if has_work:
            self._outputs += [output_of(o) for o in self.engine.step()]
        out, self._outputs = self._outputs, []
        self.spans.outputs(out)  # this rank's own (before DP gathers every rank's)
        if self._dp_sync.size > 1:  # rank 0 streams every rank's outputs
            reports = self._dp_sync.all_gather(
                _StepReport(outputs=tuple(out), busy=self._busy_here(), load=self.pool_load(),
                            spec=self.spec_totals()))
            out = [o for r in reports for o in r.outputs]
            self._group_busy = any(r.busy for r in reports)
            self._group_load = sum((r.load for r in reports[1:]), reports[0].load)
            self._group_spec = sum((r.spec for r in reports[1:]), reports[0].spec)
        return out

    def spec_totals(self) -> SpecTotals:
        """This rank's acceptance counts (the requests its engine verified)."""
        return SpecTotals.of(self.engine.spec_stats)

    def group_spec_totals(self) -> SpecTotals:
        """Summed over the DP ranks as of the last step (this rank's own without DP): each DP
        rank verifies only its own requests."""
        return self._group_spec or self.spec_totals()

    def pool_load(self) -> PoolLoad:
        """This rank's pages, seed slots and running requests."""
        alloc = self.engine.allocator
        return PoolLoad(num_free_pages=alloc.num_free, num_pages=alloc.num_usable,
                        num_free_slots=len(self._free_slots), num_slots=self.cfg.aux_slots,
                        num_running=len(self.engine.scheduler.running))

    def group_load(self) -> PoolLoad:
        """Summed over the DP ranks as of the last step (this rank's own without DP)."""
        return self._group_load or self.pool_load()

    def _agree_on_transfers(self) -> bool:
        """Poll this rank's receiver, all-gather every rank's events, act on the joint view
        (identically on every rank). Returns whether a request was admitted."""
        landed, failed = [], []
        for ev in self.receiver.poll():
            if isinstance(ev, Received):
                trace.mark(ev.room, "decode.landed")
                self.spans.pages(ev.room, len(ev.page_ids))
                landed.append((ev.room, ev.aux_payload))
            elif isinstance(ev, ReceiveFailed):
                failed.append((ev.room, str(ev.error)))
        released, self._released_local = tuple(self._released_local), []
        per_rank = self._tp_sync.all_gather(_RankEvents(tuple(landed), tuple(failed), released))
        touched: list[int] = []
        for rank, evs in enumerate(per_rank):
            for room, payload in evs.landed:
                if (entry := self._rooms.get(room)) is not None:
                    entry.landed.add(rank)
                    entry.payload = payload if rank == 0 else entry.payload
                    touched.append(room)
            for room, err in evs.failed:
                if (entry := self._rooms.get(room)) is not None:
                    entry.error = entry.error or err
                    touched.append(room)
            for room in evs.released:
                if (entry := self._rooms.get(room)) is not None:
                    entry.released.add(rank)
                    touched.append(room)
        admitted = False
        for room in dict.fromkeys(touched):  # in first-touch order, the same on every rank
            admitted |= self._settle(room)
        return admitted

    def _settle(self, room: int) -> bool:
        """Admit `room` once it landed on every rank; fail it as soon as one rank failed (the
        pages and slot return only when every rank's receiver is done with them). Returns
        whether it was admitted."""
        entry = self._rooms[room]
        size = self._tp_sync.size
        if len(entry.landed) == size:  # every rank holds the KV: admit
            self._drop(room, entry, free_pages=entry.state is RoomState.ENDED)
            return entry.state is not RoomState.ENDED and self._admit(room, entry)
        if len(entry.landed | entry.released) < size:
            if entry.error:
                self._report_failure(room, entry)
            return False
        # Every rank is done with the pages and at least one rank did not receive: a failure.
        self._drop(room, entry, free_pages=True)
        self._report_failure(room, entry)
        return False

    def _drop(self, room: int, entry: _Room, *, free_pages: bool) -> None:
        """`room` leaves the table: its seed slot goes back (it was read or never will be),
        and its pages too unless the engine takes them (`free_pages` False: admission)."""
        del self._rooms[room]
        self._free_slots.append(entry.aux_slot)
        if free_pages:
            self.engine.allocator.free(entry.page_ids)

    def _report_failure(self, room: int, entry: _Room) -> None:
        """Once per request: the stream ends with an error (its pages may follow later)."""
        if entry.state is RoomState.ENDED:
            return
        entry.state = RoomState.ENDED  # nothing more goes to the client about this room
        self._outputs.append(DecodeOutput(
            room=room, token_ids=(), text_delta="", finished=True, finish_reason="error",
            error=entry.error or "KV transfer did not complete on every TP rank"))

    def _admit(self, room: int, entry: _Room) -> bool:
        payload = entry.payload  # rank 0's seed: every rank admits from the same bytes
        try:
            seed, gen_state = decode_seed(payload, self.engine.device,
                                          self.engine.kv_pool.dtype)
            first = self.engine.admit_prefilled(
                str(room), entry.prompt_ids, entry.params, seed.last_token, seed, entry.page_ids,
                gen_state, decode_first_logprob(payload))
        except ValueError as exc:  # a seed that does not fit the request: fail it, keep serving
            self.engine.allocator.free(entry.page_ids)
            self._outputs.append(DecodeOutput(room=room, token_ids=(), text_delta="",
                                              finished=True, finish_reason="error",
                                              error=f"seed: {exc}"))
            return False
        trace.mark(room, "decode.admitted")
        self.spans.phase(room, "decode.generate")
        self._outputs.append(output_of(first))  # a failed first token: error "request"
        return True

    def num_free_pages(self) -> int:
        return self.engine.allocator.num_free

    def num_pages(self) -> int:
        return self.engine.allocator.num_usable

    def transfer_metrics(self) -> TransferMetrics:
        """This rank's transfers since it started (what its health answer reports)."""
        return self.receiver.metrics()

    def close(self) -> None:
        self.receiver.close()
