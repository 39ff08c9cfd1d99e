"""`PrefillWorker`: computes prompts (target and draft prefill) and pushes their KV and EAGLE
seed to the decode worker each request names.

Plain Python, single-threaded: the owner (a Ray actor's loop thread, or a test) calls `step()`
repeatedly and every other method between steps. For each request it:
  1. prefills it (chunked, batched with others) in a prefill-only SpecEngine,
  2. hands its pages + seed to the KV sender (`send`, bounded batches, completion notification),
  3. frees the pages once the sender reports a terminal state (never earlier: the backend may
     still be reading them), and reports a `PrefillResult`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from tandem.deploy.worker_config import WorkerConfig, aux_buffer, build_engine, compat_info, kv_layout
from tandem.engine.sampling import SamplingParams
from tandem.kvtransfer import Destination, EndpointInfo, PrefillSender, TransferError, TransferState

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True, kw_only=True)
class PrefillResult:
    """The end of a request's life on the prefill worker."""

    room: int
    ok: bool  # False: prefill or transfer failed (see error)
    first_token: int | None = None
    first_text: str = ""
    finished: bool = False  # the first token ended the request; nothing was transferred
    finish_reason: str | None = None
    error: str = ""
    error_kind: str = ""  # TransferError kind, "aborted", or "invalid"


class PrefillWorker:
    def __init__(self, cfg: WorkerConfig) -> None:
        self.cfg = cfg
        self.engine = build_engine(cfg)
        self._aux = aux_buffer(self.engine, cfg.aux_slots)  # seed staging (the sender owns it)
        self.sender = PrefillSender(
            cfg.transfer_backend, kv_layout(self.engine, self._aux),
            compat_info(self.engine, cfg), config=cfg.endpoint, faults=cfg.faults)
        self._dest: dict[int, Destination] = {}  # room -> where its KV goes (still prefilling)
        self._sending: dict[int, tuple[tuple[int, ...], int, str]] = {}  # room -> pages, token, text
        self._results: list[PrefillResult] = []
        self._sessions: set[int] = set()

    def endpoint(self) -> bytes:
        return self.sender.info().encode()

    def connect(self, decode_endpoint: bytes) -> None:
        """Handshake with a decode endpoint (once per decode endpoint; idempotent)."""
        info = EndpointInfo.decode(decode_endpoint)
        if info.session not in self._sessions:
            self.sender.connect(info)
            self._sessions.add(info.session)

    def submit(self, room: int, prompt_ids: list[int], params: SamplingParams,
               destination: bytes) -> None:
        dest = Destination.decode(destination)
        if dest.room != room:
            raise ValueError(f"destination: for room {dest.room}, not {room}")
        if dest.receiver_session not in self._sessions:
            raise ValueError("destination: its decode endpoint was never connected")
        self.engine.add_prefill_request(prompt_ids, params, str(room))
        self._dest[room] = dest

    def abort(self, room: int) -> None:
        if room in self._dest:
            del self._dest[room]
            self.engine.abort(str(room))
            self._results.append(PrefillResult(room=room, ok=False, error="aborted",
                                               error_kind="aborted"))
        elif room in self._sending:
            self.sender.abort(room)  # the outcome (and the page release) comes through poll()

    def busy(self) -> bool:
        return self.engine.has_unfinished() or bool(self._sending)

    def step(self) -> list[PrefillResult]:
        if self.engine.has_unfinished():
            self.engine.step()
        for h in self.engine.take_handoffs():
            room = int(h.req_id)
            dest = self._dest.pop(room, None)
            if dest is None:  # aborted while its last chunk ran
                if h.page_ids:
                    self.engine.free_pages(h.page_ids)
                continue
            if h.finished:
                self._results.append(PrefillResult(
                    room=room, ok=True, first_token=h.first_token, first_text=h.first_text,
                    finished=True, finish_reason=h.finish_reason))
                continue
            try:
                self.sender.send(dest, h.page_ids, h.seed_bytes())
            except TransferError as exc:
                self.engine.free_pages(h.page_ids)
                self._results.append(PrefillResult(room=room, ok=False, error=str(exc),
                                                   error_kind=exc.kind.value))
                continue
            self._sending[room] = (h.page_ids, h.first_token, h.first_text)
        for outcome in self.sender.poll():
            entry = self._sending.pop(outcome.room, None)
            if entry is None:
                continue
            pages, token, text = entry
            self.engine.free_pages(pages)  # terminal as seen by the sender: no read in flight
            if outcome.state == TransferState.DONE:
                self._results.append(PrefillResult(room=outcome.room, ok=True, first_token=token,
                                                   first_text=text))
            else:
                err = outcome.error
                self._results.append(PrefillResult(
                    room=outcome.room, ok=False, error=str(err) if err else outcome.state.value,
                    error_kind=err.kind.value if err else outcome.state.value))
        out, self._results = self._results, []
        return out

    def num_free_pages(self) -> int:
        return self.engine.allocator.num_free

    def num_pages(self) -> int:
        return self.engine.allocator.num_usable

    def close(self) -> None:
        self.sender.close()
