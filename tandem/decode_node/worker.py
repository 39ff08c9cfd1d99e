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

With TP, every rank runs this worker (see deploy/group_loop.py) and has its own receiver: rank
r's KV lands in rank r's pool at its own time. The ranks agree on transfer events each step
(`sync.all_gather`): a request is admitted only when it landed on every rank, and its pages and
slot go back (on every rank, in the same step) only once every rank's receiver is done with
them. So the allocator and slot list stay identical on every rank, and so do the schedules.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from tandem.deploy.ranks import SOLO, RankSync
from tandem.deploy.worker_config import WorkerConfig, aux_buffer, build_engine, compat_info, kv_layout
from tandem.engine.llm import validate_prompt
from tandem.engine.parallel import ParallelContext
from tandem.engine.sampling import SamplingParams
from tandem.kvtransfer import DecodeReceiver, Received, ReceiveFailed, Release, TransferState
from tandem.spec.handoff import decode_seed

log = logging.getLogger(__name__)


class OutOfCapacity(RuntimeError):
    """Not enough free pages or aux slots to reserve for this request now."""


@dataclass(frozen=True, slots=True, kw_only=True)
class DecodeOutput:
    """New tokens of one request (or its failure)."""

    room: int
    token_ids: tuple[int, ...]
    text_delta: str
    finished: bool
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    error: str = ""


@dataclass(slots=True)
class _Pending:
    """A reserved request whose KV has not landed on every rank yet (same on every rank)."""

    prompt_ids: list[int]
    params: SamplingParams
    page_ids: tuple[int, ...]
    aux_slot: int
    landed: set[int] = field(default_factory=set)  # ranks whose KV + seed arrived
    released: set[int] = field(default_factory=set)  # ranks whose receiver gave the pages up
    payload: bytes = b""  # rank 0's seed (every rank admits from the same bytes)
    error: str = ""  # the first rank's failure; "" while none failed
    aborted: bool = False


@dataclass(frozen=True, slots=True)
class _RankEvents:
    """One rank's transfer events of one step (what the ranks all-gather)."""

    landed: tuple[tuple[int, bytes], ...]  # (room, seed bytes)
    failed: tuple[tuple[int, str], ...]  # (room, error)
    released: tuple[int, ...]  # rooms whose pages this rank's receiver gave back (not DONE)


class DecodeWorker:
    def __init__(self, cfg: WorkerConfig, parallel: ParallelContext | None = None,
                 sync: RankSync = SOLO) -> None:
        self.cfg, self.sync = cfg, sync
        self.engine = build_engine(cfg, parallel)
        self._aux = aux_buffer(self.engine, cfg.aux_slots)  # the receiver's landing slots
        self._free_slots = list(range(cfg.aux_slots))
        self.receiver = DecodeReceiver(
            cfg.transfer_backend, kv_layout(self.engine, self._aux),
            compat_info(self.engine, cfg), release=self._on_release, config=cfg.endpoint)
        self._pending: dict[int, _Pending] = {}  # room -> reserved, KV not landed everywhere
        self._released_local: list[int] = []  # rooms released (not DONE) since the last step
        self._outputs: list[DecodeOutput] = []

    def endpoint(self) -> bytes:
        return self.receiver.info().encode()

    def pages_for(self, prompt_len: int, max_new_tokens: int) -> int:
        total = min(prompt_len + max_new_tokens, self.engine.max_model_len)
        return self.engine.scheduler.pages_needed(total + self.engine.spec.slots_per_round)

    def reserve(self, room: int, prompt_ids: list[int], params: SamplingParams) -> bytes:
        """Claim pages and a seed slot for `room`; returns the encoded Destination for the
        prefill worker. Raises ValueError (bad request) or OutOfCapacity (try later)."""
        validate_prompt(prompt_ids, self.engine.model_cfg.vocab_size, self.engine.max_model_len)
        if room in self._pending or str(room) in self.engine.scheduler.requests:
            raise ValueError(f"room: {room} is already on this worker")
        need = self.pages_for(len(prompt_ids), params.max_new_tokens)
        if need > self.engine.allocator.num_usable:
            raise ValueError(f"max_new_tokens: the request needs {need} KV pages; this decode "
                             f"worker has {self.engine.allocator.num_usable}")
        if not self.engine.allocator.can_alloc(need) or not self._free_slots:
            raise OutOfCapacity(f"need {need} pages and a seed slot; "
                                f"{self.engine.allocator.num_free} pages, "
                                f"{len(self._free_slots)} slots free")
        pages = tuple(self.engine.allocator.alloc(need))
        slot = self._free_slots.pop()
        dest = self.receiver.expect(room, pages, slot, timeout_s=self.cfg.transfer_timeout_s)
        self._pending[room] = _Pending(prompt_ids=list(prompt_ids), params=params, page_ids=pages,
                                       aux_slot=slot)
        return dest.encode()

    def abort(self, room: int) -> None:
        pend = self._pending.get(room)
        if pend is not None:
            # The receiver releases the pages when no writer can touch them any more (a no-op
            # on a rank where the KV already landed: those pages are freed with the others').
            pend.aborted = True
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
        return self.engine.has_unfinished() or bool(self._pending)

    def step(self) -> list[DecodeOutput]:
        self._agree_on_transfers()
        if self.engine.has_unfinished():
            for o in self.engine.step():
                self._outputs.append(DecodeOutput(
                    room=int(o.req_id), token_ids=o.new_token_ids, text_delta=o.text_delta,
                    finished=o.finished,
                    finish_reason=o.finish_reason.value if o.finish_reason else None))
        out, self._outputs = self._outputs, []
        return out

    def _agree_on_transfers(self) -> None:
        """Poll this rank's receiver, all-gather every rank's events, act on the joint view
        (identically on every rank)."""
        landed, failed = [], []
        for ev in self.receiver.poll():
            if isinstance(ev, Received):
                landed.append((ev.room, ev.aux_payload))
            elif isinstance(ev, ReceiveFailed):
                failed.append((ev.room, str(ev.error)))
        released, self._released_local = tuple(self._released_local), []
        per_rank = self.sync.all_gather(_RankEvents(tuple(landed), tuple(failed), released))
        touched: list[int] = []
        for rank, evs in enumerate(per_rank):
            for room, payload in evs.landed:
                if (pend := self._pending.get(room)) is not None:
                    pend.landed.add(rank)
                    pend.payload = payload if rank == 0 else pend.payload
                    touched.append(room)
            for room, err in evs.failed:
                if (pend := self._pending.get(room)) is not None:
                    pend.error = pend.error or err
                    touched.append(room)
            for room in evs.released:
                if (pend := self._pending.get(room)) is not None:
                    pend.released.add(rank)
                    touched.append(room)
        for room in dict.fromkeys(touched):  # in first-touch order, the same on every rank
            self._settle(room)

    def _settle(self, room: int) -> None:
        """Admit `room` once it landed on every rank; fail it as soon as one rank failed (the
        pages and slot return only when every rank's receiver is done with them)."""
        pend = self._pending[room]
        size = self.sync.size
        if len(pend.landed) == size:  # every rank holds the KV: admit
            del self._pending[room]
            self._free_slots.append(pend.aux_slot)
            if pend.aborted:
                self.engine.allocator.free(pend.page_ids)
                return
            self._admit(room, pend, pend.payload)
            return
        if len(pend.landed | pend.released) < size:
            if pend.error and not pend.aborted:
                self._report_failure(room, pend)
            return
        # Every rank is done with the pages and at least one rank did not receive: a failure.
        del self._pending[room]
        self._free_slots.append(pend.aux_slot)
        self.engine.allocator.free(pend.page_ids)
        if not pend.aborted:
            self._report_failure(room, pend)

    def _report_failure(self, room: int, pend: _Pending) -> None:
        """Once per request: the stream ends with an error (its pages may follow later)."""
        if pend.aborted:
            return
        pend.aborted = True  # nothing more goes to the client about this room
        self._outputs.append(DecodeOutput(
            room=room, token_ids=(), text_delta="", finished=True, finish_reason="error",
            error=pend.error or "KV transfer did not complete on every TP rank"))

    def _admit(self, room: int, pend: _Pending, payload: bytes) -> None:
        try:
            seed, gen_state = decode_seed(payload, self.engine.device,
                                          self.engine.kv_pool.dtype)
            first = self.engine.admit_prefilled(
                str(room), pend.prompt_ids, pend.params, seed.last_token, seed, pend.page_ids,
                gen_state)
        except ValueError as exc:  # a seed that does not fit the request: fail it, keep serving
            self.engine.allocator.free(pend.page_ids)
            self._outputs.append(DecodeOutput(room=room, token_ids=(), text_delta="",
                                              finished=True, finish_reason="error",
                                              error=f"seed: {exc}"))
            return
        self._outputs.append(DecodeOutput(
            room=room, token_ids=first.new_token_ids, text_delta=first.text_delta,
            finished=first.finished,
            finish_reason=first.finish_reason.value if first.finish_reason else None))

    def num_free_pages(self) -> int:
        return self.engine.allocator.num_free

    def num_pages(self) -> int:
        return self.engine.allocator.num_usable

    def close(self) -> None:
        self.receiver.close()
