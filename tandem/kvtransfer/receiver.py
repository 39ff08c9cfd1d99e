"""`DecodeReceiver`: the decode rank's side of the contract (`KVReceiver`), over any backend.

Owns: its backend instance, the `ReceiveTable` (page/slot claims and the release callback), what
it learned of each claimed room's writes until the room's release (`_incoming`: room ->
`_Incoming`), and the set of connected writers (prefill ranks that passed the handshake). Single-threaded; `poll()`
answers handshakes and grants, verifies completions, enforces deadlines and leases.

A room is `Received` only if: the granted writer's FINAL(done) arrived (after all its writes) and
so did the DATA notification of each page write it counts (a backend with cheap notifications
posts the aux write without waiting for the page writes, so FINAL may come first), it wrote
exactly the pages it announced, its byte count equals pages x (every layer of every group) and
the DATA bytes add up to it, and the aux slot decodes (magic, checksum) to the same room
(docs/architecture.md, "Transfer completeness").

With different TP sizes (reslice.py) a room has one writer per prefill rank holding some of this
rank's KV heads: each is granted on its BEGIN, each FINAL(done) is checked against the bytes of
its own head slice, only the primary writer's completion carries the aux slot, and the room is
`Received` when every expected writer completed. Any writer's failure fails the room.

Aborts (decode's own, or the prefill's) end a room promptly without ever releasing early: a
decode abort tells every granted writer (ABORT), which answers with its final word once nothing
of it can land; a FINAL(done) that rides on the aux write counts as that final word only once
its page writes' DATA all arrived, even after an abort (the pages may still be written until
then); and a prefill that will never begin a room it has a destination for says so (FINAL with
this endpoint's session, no BEGIN), which releases the claim at once (nobody was granted).
"""

from __future__ import annotations

import ctypes
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from tandem.kvtransfer.aux_slot import HEADER_BYTES, check_aux
from tandem.kvtransfer.backend import BackendOptions, PeerEvent, TransferBackend
from tandem.kvtransfer.compat import CompatInfo, check_compat
from tandem.kvtransfer.contract import (Destination, EndpointInfo, ErrorKind, ReceiveEvent,
                                        Received, ReceiveFailed, TransferError, TransferState)
from tandem.kvtransfer.endpoint import EndpointBase, EndpointConfig
from tandem.kvtransfer.layout import KVLayout, layout_mismatches
from tandem.kvtransfer.leases import ReceiveTable, Release
from tandem.kvtransfer.reslice import (HeadSlice, geometry, slice_bytes_per_page, slice_for_peer,
                                       slices_to_decode)
from tandem.kvtransfer.wire import Message, MsgKind, decode_message


@dataclass(slots=True)
class _Writer:
    peer_id: str
    session: int  # the prefill endpoint's session
    piece: HeadSlice | None  # heads it sends this rank (different TP); None: every head
    prefill_tp: int  # its worker's TP size
    fenced: bool = False  # disconnected after a lease expiry: must connect() again


@dataclass(slots=True)
class _Incoming:
    """What the writes of one claimed room told so far (its claim is the `ReceiveTable`'s). Kept
    until the room's release: after an abort the DATA counts still tell when a FINAL(done)'s page
    writes have all landed."""

    # writer -> (DATA notifications, their bytes) so far
    data: dict[str, tuple[int, int]] = field(default_factory=dict)
    # writer -> its FINAL(done), come before all of its DATA (waits for the rest)
    finals: dict[str, Message] = field(default_factory=dict)
    # Re-sliced (several writers): prefill ranks whose FINAL(done) arrived, the primary's seed
    done_ranks: set[int] = field(default_factory=set)
    seed: bytes | None = None


class DecodeReceiver(EndpointBase):
    """KVReceiver for one decode TP rank. `release` is called exactly once per expected room
    (see leases.ReceiveTable for when)."""

    role = "decode"

    def __init__(self, backend: TransferBackend | str, layout: KVLayout, compat: CompatInfo, *,
                 release: Callable[[Release], None], config: EndpointConfig | None = None,
                 options: BackendOptions | None = None,
                 clock: Callable[[], float] = time.monotonic):
        super().__init__(backend, layout, compat, config=config, options=options, clock=clock)
        self._release = release
        self.table = ReceiveTable(self._on_release, clock=clock)
        self._writers: dict[str, _Writer] = {}
        self._events: list[ReceiveEvent] = []
        self._incoming: dict[int, _Incoming] = {}  # room -> its writes so far, until released

    # -- per-room API ---------------------------------------------------------------------------
    def expect(self, room: int, page_ids: Sequence[int], aux_slot: int, *,
               timeout_s: float | None = None) -> Destination:
        pages = tuple(int(p) for p in page_ids)
        bad = [p for p in pages if not 0 <= p < self.layout.num_pages]
        if bad or not 0 <= aux_slot < self.layout.aux.num_slots or not pages:
            raise TransferError(ErrorKind.INVALID, f"expect: pages {bad[:8]} / aux slot "
                                f"{aux_slot} out of range, or no pages", room=room)
        timeout = self.config.timeout_s if timeout_s is None else timeout_s
        try:
            self.table.reserve(room, pages, aux_slot, timeout_s=timeout,
                               lease_margin_s=self.config.lease_margin_s,
                               reserve_wait_s=self.config.reserve_wait_s)
        except ValueError as e:
            raise TransferError(ErrorKind.INVALID, str(e), room=room) from e
        # A slot never written for this room must not decode as a seed (stale-slot guard).
        ctypes.memset(self.layout.aux.slot_addr(aux_slot), 0, HEADER_BYTES)
        return Destination(receiver_session=self.session, room=room, page_ids=pages,
                           aux_slot=aux_slot, timeout_s=timeout)

    def abort(self, room: int) -> None:
        """Decode gives up on `room` (client cancel, deadline). Its pages come back through the
        release callback once the writer confirmed it stopped, or at the lease."""
        if room in self.table and not self.table.state(room).terminal:  # type: ignore[union-attr]
            self.table.fail(room, TransferError(ErrorKind.ABORTED, "aborted by decode", room=room))
            self._metrics.record_failure(ErrorKind.ABORTED)
            for writer in self.table.claim(room).live_writers() if room in self.table else ():
                self._send(writer, Message(kind=MsgKind.ABORT, room=room))
        self._pump()

    def state(self, room: int) -> TransferState | None:
        return self.table.state(room)

    def close(self) -> None:
        if self._closed:
            return
        for w in self._writers.values():
            if not w.fenced:
                self._send(w.peer_id, Message(kind=MsgKind.BYE))
        self.table.close()
        self._closed = True
        self.backend.close()

    # -- progress -------------------------------------------------------------------------------
    def poll(self) -> list[ReceiveEvent]:
        """Progress; return the events since the last poll() (release callbacks run inside)."""
        self._pump()
        out, self._events = self._events, []
        return out

    def _pump(self) -> None:
        for ev in self.backend.poll_events():
            self._on_event(ev)
        self._enforce_deadlines()

    def _send(self, peer_id: str, msg: Message) -> None:
        self.backend.send_message(peer_id, msg.encode())

    def _on_release(self, rel: Release) -> None:
        """The table gave the room up (no writer can touch it): drop what we kept about it."""
        self._incoming.pop(rel.room, None)
        self._release(rel)

    def _failed(self, room: int, error: TransferError) -> None:
        incoming = self._incoming.get(room)
        if incoming is not None:  # no completion counts any more (the DATA counts still do)
            incoming.done_ranks, incoming.seed = set(), None
        # Other senders of a re-sliced room still writing: stop them (one failure fails all).
        for writer in self.table.claim(room).live_writers() if room in self.table else ():
            self._send(writer, Message(kind=MsgKind.ABORT, room=room))
        self._metrics.record_failure(error.kind)
        self._events.append(ReceiveFailed(room=room, error=error))

    def _on_event(self, ev: PeerEvent) -> None:
        if ev.message is None:  # cannot reach this writer: stop waiting, keep the lease
            self._writer_gone(ev.peer_id, ev.error or TransferError(ErrorKind.PEER_DEAD, "lost"))
            return
        try:
            msg = decode_message(ev.message)
        except TransferError:
            return
        if msg.kind is MsgKind.HELLO:
            self._on_hello(ev.peer_id, msg)
            return
        writer = self._writers.get(ev.peer_id)
        if writer is None or writer.fenced:
            if msg.kind is MsgKind.BEGIN:  # answer, or the sender would wait for its deadline
                self._send(ev.peer_id, Message(kind=MsgKind.DENY, room=msg.room,
                                               reason="not connected (or fenced): connect() again"))
            return
        if msg.kind is MsgKind.BEGIN:
            self._on_begin(writer, msg)
        elif msg.kind is MsgKind.DATA:
            self._on_data(writer, msg)
        elif msg.kind is MsgKind.FINAL:
            self._on_final(writer, msg)
        elif msg.kind is MsgKind.BYE:
            self._writer_gone(writer.peer_id, TransferError(ErrorKind.PEER_DEAD, "prefill closed"))

    def _on_hello(self, peer_id: str, msg: Message) -> None:
        try:
            info = EndpointInfo.from_wire(msg.body["info"])
            remote_layout = KVLayout.from_wire(msg.body["layout"])
            reply_to = self.backend.connect(info.address)
        except (KeyError, TypeError, ValueError, TransferError):
            return  # cannot even answer: the sender's connect() times out
        reason = ""
        try:
            if info.backend != self.backend.name:
                raise TransferError(ErrorKind.HANDSHAKE, f"backend: decode={self.backend.name!r} "
                                    f"prefill={info.backend!r}")
            check_compat(self.compat, info.compat, local_role="decode", remote_role="prefill")
            try:
                piece = slice_for_peer(self.compat, self.layout, info.compat, remote_layout,
                                       local_is_prefill=False)
            except ValueError as e:
                raise TransferError(ErrorKind.HANDSHAKE, str(e)) from e
            mismatches = layout_mismatches(remote_layout, self.layout)
            if mismatches:
                raise TransferError(ErrorKind.HANDSHAKE,
                                    "incompatible KV layout: " + "; ".join(mismatches))
            if reply_to != peer_id:
                raise TransferError(ErrorKind.HANDSHAKE,
                                    f"address names {reply_to}, sent by {peer_id}")
        except (TransferError, NotImplementedError) as e:
            reason = e.message if isinstance(e, TransferError) else str(e)
        if reason:
            self._send(reply_to, Message(kind=MsgKind.REFUSE, reason=reason))
            return
        self._writers[peer_id] = _Writer(peer_id=peer_id, session=info.session, piece=piece,
                                         prefill_tp=info.compat.tp_size)
        self._send(peer_id, Message(kind=MsgKind.WELCOME, session=self.session,
                                    body={"layout": self.layout.to_wire()}))

    def _on_begin(self, writer: _Writer, msg: Message) -> None:
        room, state = msg.room, self.table.state(msg.room)
        reason = ""
        if msg.session != self.session:
            reason = f"stale decode session {msg.session} (now {self.session})"
        elif state is None:
            reason = "unknown room (never reserved, expired or aborted)"
        elif state is TransferState.TRANSFERRING and writer.piece is not None:
            claim = self.table.claim(room)  # a further sender of a re-sliced room
            if writer.peer_id in claim.writers:
                reason = "this writer already began the room"
            elif msg.num_pages != claim.num_pages:
                reason = f"{msg.num_pages} pages, another sender announced {claim.num_pages}"
        elif state is not TransferState.RESERVED:
            reason = f"room is {state.value}"
        elif msg.num_pages > len(self.table.claim(room).page_ids):
            reason = f"{msg.num_pages} pages > {len(self.table.claim(room).page_ids)} reserved"
        if reason:
            self._send(writer.peer_id, Message(kind=MsgKind.DENY, room=room, reason=reason))
            return
        self.table.grant(room, writer.peer_id, msg.num_pages)
        self._send(writer.peer_id, Message(kind=MsgKind.GO, room=room))

    def _on_data(self, writer: _Writer, msg: Message) -> None:
        """A page write's bytes landed. Completes the room if its FINAL(done) was waiting."""
        room = msg.room
        if room not in self.table or self.table.claim(room).writers.get(writer.peer_id, True):
            return  # stale (released), not this writer's room, or it already gave its final word
        incoming = self._incoming.setdefault(room, _Incoming())
        n, nbytes = incoming.data.get(writer.peer_id, (0, 0))
        incoming.data[writer.peer_id] = (n + 1, nbytes + msg.nbytes)
        final = incoming.finals.get(writer.peer_id)
        if final is not None and n + 1 >= final.count:
            del incoming.finals[writer.peer_id]
            self._on_final(writer, final)

    def _on_final(self, writer: _Writer, msg: Message) -> None:
        room = msg.room
        if room not in self.table:
            return  # stale (already released)
        claim = self.table.claim(room)
        if writer.peer_id not in claim.writers:
            self._on_decline(writer, msg)
            return
        incoming = self._incoming.setdefault(room, _Incoming())
        if msg.outcome == "done":
            n, data_bytes = incoming.data.get(writer.peer_id, (0, 0))
            if n < msg.count:  # page writes whose bytes have not been confirmed yet: they may
                incoming.finals[writer.peer_id] = msg  # still land, aborted room or not (a
                return  # FINAL(done) on the aux write does not wait for them)
        if msg.outcome == "done" and not claim.state.terminal:
            incoming.data.pop(writer.peer_id, None)
            if msg.count and data_bytes != msg.nbytes:
                error = TransferError(ErrorKind.CORRUPT, f"completion says {msg.nbytes} B, the "
                                      f"page writes' notifications {data_bytes} B", room=room)
                self.table.writer_final(room, writer.peer_id, error)
                self._failed(room, error)
                return
        if msg.outcome != "done":
            try:
                kind = ErrorKind(msg.outcome)
            except ValueError:
                kind = ErrorKind.BACKEND
            error = TransferError(kind, f"prefill: {msg.reason}", room=room)
            if self.table.writer_final(room, writer.peer_id, error):
                self._failed(room, error)
            return
        if claim.state.terminal:  # decode gave up earlier (deadline/abort): just the final word
            self.table.writer_final(room, writer.peer_id, None)
            return
        try:
            payload = self._verify_done(room, msg, claim.num_pages, writer.piece)
        except TransferError as e:
            self.table.writer_final(room, writer.peer_id, e)
            self._failed(room, e)
            return
        if writer.piece is not None:
            incoming.done_ranks.add(writer.piece.prefill_rank)
            if writer.piece.primary:
                incoming.seed = payload
            expected = {p.prefill_rank for p in slices_to_decode(
                self.compat.tp_rank, self.compat.tp_size, writer.prefill_tp, self.compat.num_kv_heads)}
            claim.writers[writer.peer_id] = True  # its final word: it writes no more
            if incoming.done_ranks != expected:
                return  # other senders' heads still to come
            assert incoming.seed is not None
            payload = incoming.seed
        latency = self.clock() - claim.granted_at
        del self._incoming[room]  # its end here: nothing more to count
        self.table.complete(room)  # releases with outcome DONE: the pages now hold the request
        self._metrics.record_done(msg.nbytes + HEADER_BYTES + len(payload), latency)
        self._events.append(Received(room=room, page_ids=claim.page_ids[: claim.num_pages],
                                     aux_payload=payload))

    def _on_decline(self, writer: _Writer, msg: Message) -> None:
        """FINAL from a connected writer never granted this room: it will never begin it (its
        room ended on the prefill side first, or decode denied its BEGIN). Fail the room now
        rather than at its deadline; released at once if nobody was granted (the table holds
        it for any other granted writer). Only for this session's rooms (BEGIN's rule)."""
        room = msg.room
        if (msg.session != self.session or msg.outcome == "done"
                or self.table.claim(room).state.terminal):
            return  # stale or foreign
        try:
            kind = ErrorKind(msg.outcome)
        except ValueError:
            kind = ErrorKind.BACKEND
        error = TransferError(kind, f"prefill: {msg.reason}", room=room)
        self.table.fail(room, error)
        self._failed(room, error)

    def _verify_done(self, room: int, msg: Message, granted_pages: int,
                     piece: HeadSlice | None) -> bytes | None:
        """The seed (None from a re-sliced non-primary writer, which writes no slot) once the
        writer's page and byte counts match what it had to send."""
        if piece is None:
            expected = granted_pages * self.layout.bytes_per_page
        else:
            expected = granted_pages * sum(r.num_layers * slice_bytes_per_page(geometry(r), piece)
                                           for r in self.layout.regions)
        if msg.num_pages != granted_pages or msg.nbytes != expected:
            raise TransferError(ErrorKind.CORRUPT, f"completion says {msg.num_pages} pages / "
                                f"{msg.nbytes} B, expected {granted_pages} pages / {expected} B "
                                "(every layer of every group)", room=room)
        if piece is not None and not piece.primary:
            return None
        slot = self.layout.aux.slot_addr(self.table.claim(room).aux_slot)
        return check_aux(ctypes.string_at(slot, self.layout.aux.slot_bytes), room)

    def _writer_gone(self, peer_id: str, error: TransferError) -> None:
        for room in self.table.rooms_of(peer_id):
            if not self.table.state(room).terminal:  # type: ignore[union-attr]
                err = TransferError(error.kind, error.message, room=room)
                self.table.fail(room, err)
                self._failed(room, err)

    def _enforce_deadlines(self) -> None:
        timed_out, lease_over = self.table.expired()
        for room in timed_out:
            err = TransferError(ErrorKind.TIMEOUT, "KV + seed not received before the deadline "
                                f"({self.table.claim(room).state.value})", room=room)
            self.table.fail(room, err)
            self._failed(room, err)  # tells the writers (ABORT)
        fenced: set[str] = set()
        for claim in lease_over:
            for peer in claim.live_writers():
                if peer in fenced or claim.room not in self.table:
                    continue
                # Lease over and the writer never confirmed it stopped: cut it off, release.
                fenced.add(peer)
                self.backend.disconnect(peer)
                w = self._writers.get(peer)
                if w is not None:
                    w.fenced = True
                for room in self.table.fence(peer):
                    self._failed(room, TransferError(ErrorKind.PEER_DEAD, f"writer {peer} "
                                                     "fenced at lease expiry", room=room))
