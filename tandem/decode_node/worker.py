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
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from tandem.deploy.worker_config import WorkerConfig, aux_buffer, build_engine, compat_info, kv_layout
from tandem.engine.llm import validate_prompt
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
    prompt_ids: list[int]
    params: SamplingParams
    page_ids: tuple[int, ...]


class DecodeWorker:
    def __init__(self, cfg: WorkerConfig) -> None:
        self.cfg = cfg
        self.engine = build_engine(cfg)
        self._aux = aux_buffer(self.engine, cfg.aux_slots)  # the receiver's landing slots
        self._free_slots = list(range(cfg.aux_slots))
        self.receiver = DecodeReceiver(
            cfg.transfer_backend, kv_layout(self.engine, self._aux),
            compat_info(self.engine, cfg), release=self._on_release, config=cfg.endpoint)
        self._pending: dict[int, _Pending] = {}  # room -> reserved, KV not landed yet
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
        self._pending[room] = _Pending(prompt_ids=list(prompt_ids), params=params, page_ids=pages)
        return dest.encode()

    def abort(self, room: int) -> None:
        if room in self._pending:
            # The receiver releases the pages when no writer can touch them any more.
            self.receiver.abort(room)
            return
        if self.engine.abort(str(room)):
            self._outputs.append(DecodeOutput(room=room, token_ids=(), text_delta="",
                                              finished=True, finish_reason="abort"))

    def _on_release(self, rel: Release) -> None:
        self._free_slots.append(rel.aux_slot)
        if rel.outcome != TransferState.DONE:
            self.engine.allocator.free(rel.page_ids)
        # DONE: the pages now belong to the admitted request (see step()).

    def busy(self) -> bool:
        return self.engine.has_unfinished() or bool(self._pending)

    def step(self) -> list[DecodeOutput]:
        for ev in self.receiver.poll():
            pend = self._pending.pop(ev.room, None)
            if pend is None:
                continue
            if isinstance(ev, ReceiveFailed):
                self._outputs.append(DecodeOutput(
                    room=ev.room, token_ids=(), text_delta="", finished=True,
                    finish_reason="error", error=str(ev.error)))
            elif isinstance(ev, Received):
                self._admit(ev.room, pend, ev.aux_payload)
        if self.engine.has_unfinished():
            for o in self.engine.step():
                self._outputs.append(DecodeOutput(
                    room=int(o.req_id), token_ids=o.new_token_ids, text_delta=o.text_delta,
                    finished=o.finished,
                    finish_reason=o.finish_reason.value if o.finish_reason else None))
        out, self._outputs = self._outputs, []
        return out

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
