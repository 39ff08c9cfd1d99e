"""`PrefillSender`: the prefill rank's side of the contract (`KVSender`), over any backend.

Owns: its backend instance, the table of rooms being sent (room -> `SendRoom`, send_leg.py: one
`SendLeg` per decode endpoint, the room's first failure and whether its outcome went out; a room
leaves it when its last leg retires), and the memory of recently finished rooms; its
`LegWriter` layer (leg_writer.py) owns the aux staging slots and posts the writes.
Single-threaded; `poll()` progresses.

Per room: `start` sends BEGIN and waits (without blocking) for GO; `push_layers` queues page
batches, posted once GO arrived; `finish` stages the aux seed; the aux write goes out carrying
FINAL(done) as its notification - so decode sees the completion only after all bytes (when the
aux write may go: leg_writer.py). The room is DONE on this side when every write of it
completed. On any failure the room turns terminal at once (the caller
learns), but the decode side is told FINAL only after every posted write finished or was
cancelled (its pages stay leased until then); if writes hang past `drain_timeout_s`, the peer is
fenced (disconnected) instead. Every ABORT from decode is answered with a final word (a leg that
already retired answers from the recent outcomes). A room that ends here before it was begun for
a destination (`decline`) gets FINAL without BEGIN, so decode need not wait for its deadline.

Different TP sizes (reslice.py): one room may go to several decode ranks, one leg (`SendLeg`) per
decode endpoint, each started with its own Destination; `push_layers`/`finish`/`abort`/`state`
act on every leg of the room, and the room's outcome is reported once every leg is terminal (a
failed leg aborts its siblings). A leg carries its head slice; only the decode rank's primary
sender writes the aux slot (FINAL rides on it); another leg sends FINAL(done) as a message once
all of its writes completed - the same ordering the aux write relies on.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Sequence

from tandem.kvtransfer import coalesce
from tandem.kvtransfer.aux_slot import HEADER_BYTES
from tandem.kvtransfer.backend import BackendOptions, PeerEvent, TransferBackend, WriteStatus
from tandem.kvtransfer.compat import CompatInfo, check_compat
from tandem.kvtransfer.contract import (Destination, EndpointInfo, ErrorKind, SendOutcome,
                                        TransferError, TransferState, advance)
from tandem.kvtransfer.endpoint import EndpointConfig
from tandem.kvtransfer.faults import FailureInjection, FaultDice, FaultKind
from tandem.kvtransfer.layout import (KVLayout, layout_mismatches, plan_layers, split_batches,
                                      validate_pages)
from tandem.kvtransfer.leg_writer import LegWriter
from tandem.kvtransfer.reslice import geometry, plan_slice_entries, slice_for_peer
from tandem.kvtransfer.send_leg import DecodePeer, SendLeg, SendRoom
from tandem.kvtransfer.wire import Message, MsgKind, decode_message


class PrefillSender(LegWriter):
    """KVSender for one prefill TP rank. Invariant: a room is FINAL-ed to decode only when none
    of its writes can land any more (completed, cancelled, or peer fenced)."""

    role = "prefill"

    def __init__(self, backend: TransferBackend | str, layout: KVLayout, compat: CompatInfo, *,
                 config: EndpointConfig | None = None, options: BackendOptions | None = None,
                 faults: FailureInjection | None = None,
                 clock: Callable[[], float] = time.monotonic):
        super().__init__(backend, layout, compat, config=config, options=options, clock=clock)
        self._dice = FaultDice(faults)
        self._peers: dict[int, DecodePeer] = {}  # receiver session -> peer
        self._hello: dict[str, Message] = {}  # peer id -> WELCOME/REFUSE awaiting connect()
        self._rooms: dict[int, SendRoom] = {}  # room -> its legs, until the last one retired
        self._recent: OrderedDict[int, tuple[TransferState, TransferError | None]] = OrderedDict()
        self._outcomes: list[SendOutcome] = []

    # -- handshake ----------------------------------------------------------------------------
    def connect(self, receiver: EndpointInfo, *, timeout_s: float | None = None) -> None:
        if receiver.backend != self.backend.name:
            raise TransferError(ErrorKind.HANDSHAKE, f"backend: prefill={self.backend.name!r} "
                                f"decode={receiver.backend!r}")
        check_compat(self.compat, receiver.compat, local_role="prefill", remote_role="decode")
        peer_id = self.backend.connect(receiver.address)
        self._hello.pop(peer_id, None)
        hello = Message(kind=MsgKind.HELLO, body={"info": self.info().to_wire(),
                                                  "layout": self.layout.to_wire()})
        self.backend.send_message(peer_id, hello.encode())
        self._wait_until(lambda: peer_id in self._hello,
                         timeout_s or self.config.handshake_timeout_s, f"handshake with {peer_id}")
        reply = self._hello.pop(peer_id)
        if reply.kind is MsgKind.REFUSE:
            raise TransferError(ErrorKind.HANDSHAKE, f"decode refused: {reply.reason}")
        remote = KVLayout.from_wire(reply.body["layout"])
        mismatches = layout_mismatches(self.layout, remote)
        if mismatches or reply.session != receiver.session:
            mismatches = mismatches or [f"session: info={receiver.session} welcome={reply.session}"]
            raise TransferError(ErrorKind.HANDSHAKE,
                                "incompatible KV layout: " + "; ".join(mismatches))
        try:  # different TP sizes: this rank must hold heads the decode rank takes from it
            slice_for_peer(self.compat, self.layout, receiver.compat, remote)
        except ValueError as e:
            raise TransferError(ErrorKind.HANDSHAKE, str(e)) from e
        self._peers[receiver.session] = DecodePeer(peer_id=peer_id, session=receiver.session,
                                              layout=remote, compat=receiver.compat)
        prepare = getattr(self.backend, "prepare_regions", None)
        if prepare is not None:  # optional: NIXL prepares descriptor lists once per peer
            prepare(peer_id, [(r, remote.region(r.name)) for r in self.layout.regions]
                    + [(self.layout.aux, remote.aux)])

    # -- per-room API ---------------------------------------------------------------------------
    def start(self, dest: Destination, src_page_ids: Sequence[int], *,
              whole_groups: bool = True) -> None:
        peer = self._peers.get(dest.receiver_session)
        if peer is None:
            raise TransferError(ErrorKind.HANDSHAKE, f"not connected to decode session "
                                f"{dest.receiver_session}: connect() first", room=dest.room)
        if not peer.alive:
            raise TransferError(ErrorKind.PEER_DEAD, f"decode {peer.peer_id} is gone or fenced; "
                                "connect() again", room=dest.room)
        entry = self._rooms.get(dest.room)
        if entry is not None and any(leg.dest.receiver_session == dest.receiver_session
                                     or leg.pushed or leg.state.terminal for leg in entry.legs):
            raise TransferError(ErrorKind.INVALID, "room already being sent", room=dest.room)
        validate_pages(self.layout, peer.layout, src_page_ids, dest.page_ids, room=dest.room)
        now = self.clock()
        s = SendLeg(room=dest.room, dest=dest, peer=peer, num_pages=len(src_page_ids),
                  runs=coalesce.page_runs(src_page_ids, dest.page_ids), deadline=now + dest.timeout_s,
                  started_at=now, fault=self._dice.draw(),
                  piece=slice_for_peer(self.compat, self.layout, peer.compat, peer.layout))
        if entry is None:
            entry = self._rooms[dest.room] = SendRoom()
        entry.legs.append(s)
        self._recent.pop(dest.room, None)
        self.backend.send_message(peer.peer_id, Message(
            kind=MsgKind.BEGIN, room=dest.room, session=peer.session,
            num_pages=s.num_pages).encode())
        if whole_groups:
            self._build_ahead(s)  # while BEGIN -> GO makes its round trip
        self._pump()

    def push_layers(self, room: int, group: str, layers: range) -> None:
        for s in self._live(room):
            done = s.pushed.setdefault(group, set())
            if done.intersection(layers):
                twice = sorted(done.intersection(layers))
                raise TransferError(ErrorKind.INVALID, f"{group} layers {twice} pushed twice",
                                    room=room)
            src, dst = self.layout.region(group), s.peer.layout.region(group)
            ready = s.ready.pop(group, None)
            if ready is not None and layers == range(src.num_layers):
                s.queued.extend(ready)  # built at start()
            elif s.piece is None:
                if ready is not None:  # part of a group: its built writes and FINAL's counts
                    self._drop_built(ready)  # no longer fit (other groups' still do)
                    self._drop_built_final(s)
                s.queued.extend(plan_layers(src, dst, s.runs, layers,
                                            max_entries=self.max_batch_entries))
            else:
                if layers.start < 0 or layers.stop > src.num_layers or layers.step != 1:
                    raise TransferError(ErrorKind.INVALID, f"{group}: layers {layers} outside "
                                        f"range(0, {src.num_layers})", room=room)
                entries = plan_slice_entries(geometry(src), geometry(dst), s.runs, layers,
                                             self.compat.page_size, s.piece)
                s.queued.extend(split_batches(entries, src.device, dst.device,
                                              max_entries=self.max_batch_entries)
                                if len(entries) else [])
            done.update(layers)
        self._pump_room(room)

    def finish(self, room: int, aux_payload: bytes) -> None:
        legs = self._live(room)
        if HEADER_BYTES + len(aux_payload) > self.layout.aux.slot_bytes:
            raise TransferError(ErrorKind.INVALID, f"aux payload {len(aux_payload)} B does not fit "
                                f"a {self.layout.aux.slot_bytes} B slot", room=room)
        if any(s.aux_payload is not None for s in legs):
            raise TransferError(ErrorKind.INVALID, "finish() called twice", room=room)
        for s in legs:
            s.aux_payload = bytes(aux_payload)
        self._pump_room(room)

    def send(self, dest: Destination | Sequence[Destination], src_page_ids: Sequence[int],
             aux_payload: bytes) -> None:
        """`dest`: one Destination, or one per decode rank this rank feeds (different TP)."""
        dests = [dest] if isinstance(dest, Destination) else list(dest)
        started = False
        try:
            for d in dests:
                self.start(d, src_page_ids)
                started = True
            for region in self.layout.regions:
                self.push_layers(dests[0].room, region.name, range(region.num_layers))
            self.finish(dests[0].room, aux_payload)
        except TransferError:
            if started:  # legs this call began would otherwise wait for their deadline (and
                self.abort(dests[0].room)  # keep decode's pages until then): end them now
            raise

    def decline(self, dests: Sequence[Destination], reason: str = "aborted by prefill") -> None:
        """The room of `dests` ends here and will never be sent (aborted, or failed, before its
        transfer started). A destination no leg was begun for gets FINAL(aborted) at once:
        decode never granted us (no BEGIN went out), so it releases its claim now instead of
        at its deadline. Legs already begun are aborted (their final word follows once
        nothing of theirs can land)."""
        for dest in dests:
            legs = self._legs(dest.room)
            peer = self._peers.get(dest.receiver_session)
            if (peer is None or not peer.alive or dest.room in self._recent
                    or any(leg.dest.receiver_session == dest.receiver_session for leg in legs)):
                continue  # unreachable, or begun: that leg's own final word covers it
            self._say_final(peer.peer_id, dest.room, TransferState.ABORTED,
                            TransferError(ErrorKind.ABORTED, reason, room=dest.room), peer.session)
        for room in dict.fromkeys(d.room for d in dests):
            self.abort(room)

    def abort(self, room: int) -> None:
        for s in self._legs(room):
            if not s.state.terminal:
                self._terminate(s, TransferError(ErrorKind.ABORTED, "aborted by prefill",
                                                 room=room))
        self._pump()

    def state(self, room: int) -> TransferState:
        if room in self._rooms:
            return self._room_state(room)[0]
        if room in self._recent:
            return self._recent[room][0]
        raise TransferError(ErrorKind.INVALID, "unknown room", room=room)

    def wait(self, room: int, timeout_s: float | None = None) -> None:
        self._wait_until(lambda: self.state(room).terminal, timeout_s, f"wait(room {room})")
        state, error = (self._room_state(room) if room in self._rooms else self._recent[room])
        if state is not TransferState.DONE:
            assert error is not None
            raise error

    def close(self) -> None:
        if self._closed:
            return
        for s in self._live_legs():
            if not s.state.terminal:
                self._terminate(s, TransferError(ErrorKind.ABORTED, "prefill closing", room=s.room))
        end = self.clock() + min(self.config.drain_timeout_s, 2.0)
        while self._rooms and self.clock() < end:  # best effort: let decode release promptly
            self._pump()
            time.sleep(self.config.poll_sleep_s)
        for peer in self._peers.values():
            if peer.alive:
                self.backend.send_message(peer.peer_id, Message(kind=MsgKind.BYE).encode())
        self._closed = True
        self.backend.close()

    # -- progress -------------------------------------------------------------------------------
    def poll(self) -> list[SendOutcome]:
        """Progress every transfer; return the outcomes reached since the last poll()."""
        self._pump()
        out, self._outcomes = self._outcomes, []
        return out

    def _pump(self) -> None:
        for ev in self.backend.poll_events():
            self._on_event(ev)
        for s in self._live_legs():
            self._progress(s)

    def _pump_room(self, room: int) -> None:
        """Post what `room`'s legs have queued (and their final write once it may go): all a
        push or finish needs at once. Completions, deadlines and every other room progress in
        the owner's `poll()` -- polling every write in flight on each push made a busy
        sender's pushes cost O(rooms in flight), and polling this room's own just-posted writes
        only delayed the next post."""
        now = self.clock()
        for s in list(self._legs(room)):
            if (not s.retired and s.state is TransferState.TRANSFERRING
                    and now >= s.post_after and now < s.deadline):
                self._post_queued(s)
                if s.state is TransferState.TRANSFERRING:
                    self._maybe_post_final(s)

    def _live(self, room: int) -> list[SendLeg]:
        legs = self._legs(room)
        if not legs:
            raise TransferError(ErrorKind.INVALID, "unknown room: start() first", room=room)
        for s in legs:
            if s.state.terminal:
                assert s.error is not None or s.state is TransferState.DONE
                raise s.error or TransferError(ErrorKind.INVALID, "room already done", room=room)
        return legs

    def _legs(self, room: int) -> list[SendLeg]:
        """Every leg of `room`, retired ones included (none: not being sent)."""
        entry = self._rooms.get(room)
        return entry.legs if entry is not None else []

    def _live_legs(self) -> list[SendLeg]:
        """The legs not retired yet, of every room (a snapshot: progress may retire them)."""
        return [s for entry in self._rooms.values() for s in entry.legs if not s.retired]

    def _room_state(self, room: int) -> tuple[TransferState, TransferError | None]:
        """A room's state over its legs: failed if any failed, DONE when all are, else the
        least advanced leg's state."""
        entry = self._rooms[room]
        legs = entry.legs
        if entry.error is not None:
            err = entry.error
            return (TransferState.ABORTED if err.kind is ErrorKind.ABORTED
                    else TransferState.FAILED), err
        if all(s.state is TransferState.DONE for s in legs):
            return TransferState.DONE, None
        if any(s.state is TransferState.RESERVED for s in legs):
            return TransferState.RESERVED, None
        return TransferState.TRANSFERRING, None

    def _leg_terminal(self, s: SendLeg) -> None:
        """A leg reached a terminal state: a failure aborts the sibling legs; the room's outcome
        goes out once, when every leg is terminal."""
        entry = self._rooms[s.room]
        if s.error is not None and entry.error is None:
            entry.error = s.error
            for other in entry.legs:
                if not other.state.terminal:
                    self._terminate(other, TransferError(s.error.kind, s.error.message,
                                                         room=s.room))
        if not entry.reported and all(leg.state.terminal for leg in entry.legs):
            entry.reported = True
            state, error = self._room_state(s.room)
            self._outcomes.append(SendOutcome(room=s.room, state=state, error=error))

    def _on_event(self, ev: PeerEvent) -> None:
        if ev.message is None:  # the backend lost this peer
            self._peer_gone(ev.peer_id, ev.error or TransferError(ErrorKind.PEER_DEAD, "peer lost"))
            return
        try:
            msg = decode_message(ev.message)
        except TransferError:
            return  # not ours / garbled: ignore rather than crash the worker
        if msg.kind in (MsgKind.WELCOME, MsgKind.REFUSE):
            self._hello[ev.peer_id] = msg
        elif msg.kind is MsgKind.BYE:
            self._peer_gone(ev.peer_id, TransferError(ErrorKind.PEER_DEAD, "decode closed"))
        elif msg.kind in (MsgKind.GO, MsgKind.DENY, MsgKind.ABORT):
            s = next((leg for leg in self._legs(msg.room)
                      if not leg.retired and leg.peer.peer_id == ev.peer_id), None)
            if s is None:
                if msg.kind is MsgKind.ABORT and msg.room in self._recent:
                    self._say_final(ev.peer_id, msg.room, *self._recent[msg.room])
                return
            if msg.kind is MsgKind.GO and s.state is TransferState.RESERVED:
                s.state = advance(s.state, TransferState.TRANSFERRING, room=s.room)
                if s.fault is FaultKind.DELAY:
                    s.post_after = self.clock() + self._dice.injection.delay_s  # type: ignore[union-attr]
            elif msg.kind is MsgKind.DENY and not s.state.terminal:
                self._terminate(s, TransferError(ErrorKind.REFUSED, msg.reason, room=s.room))
            elif msg.kind is MsgKind.ABORT and not s.state.terminal:
                self._terminate(s, TransferError(ErrorKind.ABORTED, "aborted by decode",
                                                 room=s.room))

    def _peer_gone(self, peer_id: str, error: TransferError) -> None:
        for peer in self._peers.values():
            if peer.peer_id == peer_id:
                peer.alive = False
        for s in self._live_legs():
            if s.peer.peer_id == peer_id and not s.state.terminal:
                self._terminate(s, TransferError(error.kind, error.message, room=s.room))

    def _progress(self, s: SendLeg) -> None:
        now = self.clock()
        if not s.state.terminal and now >= s.deadline:
            self._terminate(s, TransferError(ErrorKind.TIMEOUT, f"not done within "
                                             f"{s.dest.timeout_s:g}s (state {s.state.value})",
                                             room=s.room))
        if s.state is TransferState.TRANSFERRING and now >= s.post_after:
            self._post_queued(s)
        for item in list(s.inflight):
            r = self.backend.poll_write(item[0])
            if r.status is WriteStatus.PENDING:
                continue
            s.inflight.remove(item)
            if r.status is WriteStatus.DONE:
                s.kv_bytes += item[1]
            elif not s.state.terminal:
                assert r.error is not None
                self._terminate(s, TransferError(r.error.kind, r.error.message, room=s.room))
        if s.state is TransferState.TRANSFERRING:
            self._maybe_post_final(s)
        if s.final_handle is not None:
            self._poll_final(s)
        if s.final_landed and not s.inflight and not s.state.terminal:
            self._done(s)
        if s.state.terminal and not s.final_said:
            if not s.inflight and s.final_handle is None:  # nothing of ours can land any more
                if s.peer.alive:
                    self._say_final(s.peer.peer_id, s.room, s.state, s.error, s.peer.session)
                s.final_said = True
            elif now >= s.drain_deadline:  # writes hang (frozen peer): fence, then forget them
                if s.peer.alive:
                    self.backend.disconnect(s.peer.peer_id)
                    self._peer_gone(s.peer.peer_id, TransferError(ErrorKind.PEER_DEAD, "fenced"))
                s.inflight.clear()
                if s.final_handle is not None:
                    s.final_handle = None
                    self._free_staging.append(s.staging_slot)  # type: ignore[arg-type]
                s.final_said = True
        if s.state.terminal and s.final_said:
            self._retire(s)
    def _done(self, s: SendLeg) -> None:
        """Every write of the leg completed (with FINAL(done) on the aux write, or sent as a
        message by a non-primary leg)."""
        s.state = advance(s.state, TransferState.DONE, room=s.room)
        s.final_said = True  # the notification was our final word
        self._metrics.record_done(s.kv_bytes + s.final_bytes, self.clock() - s.started_at)
        self._leg_terminal(s)

    def _terminate(self, s: SendLeg, error: TransferError) -> None:
        target = TransferState.ABORTED if error.kind is ErrorKind.ABORTED else TransferState.FAILED
        s.state = advance(s.state, target, room=s.room)
        s.error = error
        self._drop_ready(s)
        s.queued.clear()
        s.drain_deadline = self.clock() + self.config.drain_timeout_s
        s.inflight = [item for item in s.inflight if not self.backend.cancel_write(item[0])]
        if s.final_handle is not None and self.backend.cancel_write(s.final_handle):
            s.final_handle = None
            self._free_staging.append(s.staging_slot)  # type: ignore[arg-type]
        self._metrics.record_failure(error.kind)
        self._leg_terminal(s)

    def _say_final(self, peer_id: str, room: int, state: TransferState,
                   error: TransferError | None, session: int = 0) -> None:
        """FINAL: nothing of ours lands in `room` any more. `session` (the receiver's, as in
        BEGIN) lets decode act on it for a room it never granted us (`decline`, a denied BEGIN);
        0 for a late answer to ABORT, which only a granted writer gets."""
        if state is TransferState.DONE:
            outcome = "done"
        else:  # the error kind travels, so decode reports the same reason
            outcome = error.kind.value if error else ErrorKind.BACKEND.value
        reason = error.message if error else ""
        self.backend.send_message(peer_id, Message(kind=MsgKind.FINAL, room=room, outcome=outcome,
                                                   session=session, reason=reason[:200]).encode())

    def _retire(self, s: SendLeg) -> None:
        self._drop_ready(s)  # nothing is left on a terminal leg; kept as a guard
        s.retired = True
        if any(not leg.retired for leg in self._rooms[s.room].legs):
            return  # siblings still draining: the room stays until its last leg retires
        self._recent[s.room] = self._room_state(s.room)
        del self._rooms[s.room]
        while len(self._recent) > self.config.recent_outcomes:
            self._recent.popitem(last=False)
