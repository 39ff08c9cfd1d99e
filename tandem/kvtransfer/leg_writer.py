"""`LegWriter`: the write side of `PrefillSender` - building, posting and completing the writes
of one leg (send_leg.py). A layer of the sender: `PrefillSender` subclasses it and owns the leg
state machine (`_terminate`, `_done`), which the writes call into.

Owns: the aux staging slots (its own `layout.aux`, host memory: a leg's seed waits there for its
aux write) and the writes built ahead and not yet posted.

Ordering: the aux write goes out carrying FINAL(done) as its notification - so decode sees the
completion only after all bytes. Where the backend's notifications are cheap
(`notify_per_write`: NIXL, fake) every page write carries DATA(bytes) and the aux write is posted
as soon as every layer of every group is posted: FINAL counts the DATA writes and decode
completes the room once all of them arrived (no completion round trip between the last page
write and the aux write). Otherwise (Mooncake) the aux write waits until every page write
completed. A leg that is not its decode rank's aux writer (different TP sizes) sends FINAL(done)
as a message once all of its writes completed - the same ordering the aux write relies on.
"""

from __future__ import annotations

import ctypes
from collections import deque
from collections.abc import Callable

from tandem.kvtransfer.aux_slot import HEADER_BYTES, encode_aux
from tandem.kvtransfer.backend import BackendOptions, TransferBackend, WriteStatus
from tandem.kvtransfer.compat import CompatInfo
from tandem.kvtransfer.contract import ErrorKind, TransferError
from tandem.kvtransfer.endpoint import EndpointBase, EndpointConfig
from tandem.kvtransfer.faults import FaultKind
from tandem.kvtransfer.layout import CopyBatch, KVLayout, plan_layers, split_batches
from tandem.kvtransfer.send_leg import BuiltWrite, SendLeg
from tandem.kvtransfer.wire import Message, MsgKind


class LegWriter(EndpointBase):
    """Posts each leg's page writes and its final (aux) write, in the order above. Invariant:
    every staging slot is free (`_free_staging`) or holds the seed of one leg's aux write, built
    ahead (`ready_final`) or in flight (`final_handle`)."""

    def __init__(self, backend: TransferBackend | str, layout: KVLayout, compat: CompatInfo, *,
                 config: EndpointConfig | None, options: BackendOptions | None,
                 clock: Callable[[], float]):
        super().__init__(backend, layout, compat, config=config, options=options, clock=clock)
        self._free_staging = list(range(layout.aux.num_slots))
        # Cheap notifications: page writes carry DATA and the aux write need not wait for them.
        self._notify_per_write = bool(getattr(self.backend, "notify_per_write", False))
        # Writes built while a room waits for GO (_build_ahead): only where they need no wait.
        self._can_prepare = self._notify_per_write and hasattr(self.backend, "prepare_write")

    # -- the leg state machine (PrefillSender's) ----------------------------------------------
    def _terminate(self, s: SendLeg, error: TransferError) -> None:
        """End the leg with `error`: terminal at once, FINAL once nothing of it can land."""
        raise NotImplementedError

    def _done(self, s: SendLeg) -> None:
        """Every write of the leg completed."""
        raise NotImplementedError

    # -- writes built ahead of GO -------------------------------------------------------------
    def _build_ahead(self, s: SendLeg) -> None:
        """Build the room's writes before GO, on backends with `prepare_write` (NIXL, fake):
        each group's page writes for a push of all its layers (what `send` and the prefill
        worker's push-after-prefill do; `start(whole_groups=False)` skips it for layer-wise
        pushes) and the aux write that carries FINAL, so that from GO on only the posts are
        left (descriptor planning and the library's transfer set-up cost as much as the 64 MiB
        write itself on a GPU host). A push of part of a group drops that group's built writes
        and the built aux write (FINAL's counts change) and plans as before; writes already
        queued, and other groups' built writes, still go. Not for head slices or injected
        faults, and the aux write only while two staging slots or more are free: the plain path
        keeps one, so a room without a built aux write never waits on rooms that hold theirs."""
        if not self._can_prepare or s.piece is not None or s.fault is not None:
            return
        nbytes = count = 0
        for region in self.layout.regions:
            items = s.ready.setdefault(region.name, [])
            for batch in plan_layers(region, s.peer.layout.region(region.name), s.runs,
                                     range(region.num_layers), max_entries=self.max_batch_entries):
                data = Message(kind=MsgKind.DATA, room=s.room, nbytes=batch.nbytes).encode()
                prepared = self.backend.prepare_write(s.peer.peer_id, batch, data)  # type: ignore[attr-defined]
                if prepared is None:
                    self._drop_ready(s)
                    return
                items.append(BuiltWrite(prepared, batch.nbytes))
                nbytes += batch.nbytes
                count += 1
        if len(self._free_staging) < 2:
            return
        slot = self._free_staging.pop()
        final = self._final_done(s, nbytes, count)
        prepared = self.backend.prepare_write(s.peer.peer_id, self._aux_batch(s, slot), final)  # type: ignore[attr-defined]
        if prepared is None:
            self._free_staging.append(slot)
            return
        s.ready_final = (BuiltWrite(prepared, self.layout.aux.slot_bytes), slot, final)

    def _drop_ready(self, s: SendLeg) -> None:
        """Release every write built ahead and not posted, queued or not (the leg ended)."""
        queued = [b for b in s.queued if isinstance(b, BuiltWrite)]
        if queued:
            s.queued = deque(b for b in s.queued if not isinstance(b, BuiltWrite))
        self._drop_built(queued + [r for items in s.ready.values() for r in items])
        s.ready.clear()
        self._drop_built_final(s)

    def _drop_built(self, items: list[BuiltWrite]) -> None:
        for r in items:
            self.backend.drop_prepared(r.prepared)  # type: ignore[attr-defined]

    def _drop_built_final(self, s: SendLeg) -> None:
        """Release the built aux write and give its staging slot back."""
        if s.ready_final is not None:
            self._drop_built([s.ready_final[0]])
            self._free_staging.append(s.ready_final[1])
            s.ready_final = None

    @staticmethod
    def _final_done(s: SendLeg, nbytes: int, count: int) -> str:
        """FINAL(done) for `s`: `count` page writes of `nbytes` in all were posted."""
        return Message(kind=MsgKind.FINAL, room=s.room, outcome="done", num_pages=s.num_pages,
                       nbytes=nbytes, count=count).encode()

    def _aux_batch(self, s: SendLeg, slot: int) -> CopyBatch:
        """The write of a whole staging slot into the room's aux slot at decode (the bytes after
        the seed are stale and never read): one whole block, which a backend may have
        prepared (prepare_regions)."""
        return split_batches([(self.layout.aux.slot_addr(slot),
                               s.peer.layout.aux.slot_addr(s.dest.aux_slot),
                               self.layout.aux.slot_bytes)], "cpu", "cpu")[0]

    # -- posting ------------------------------------------------------------------------------
    def _post_queued(self, s: SendLeg) -> None:
        while s.queued and not s.state.terminal:
            batch = s.queued.popleft()
            if isinstance(batch, BuiltWrite):  # built ahead: one post (no fault was drawn for it)
                try:
                    h = self.backend.post_prepared(batch.prepared)  # type: ignore[attr-defined]
                except TransferError as e:
                    self._terminate(s, TransferError(e.kind, e.message, room=s.room))
                    return
                s.inflight.append((h, batch.nbytes))
                s.posted_bytes += batch.nbytes
                s.num_data += 1
                continue
            if s.fault is FaultKind.FAIL_TRANSFER:
                self._terminate(s, TransferError(ErrorKind.BACKEND, "injected failure",
                                                 room=s.room))
                return
            data = (Message(kind=MsgKind.DATA, room=s.room, nbytes=batch.nbytes).encode()
                    if self._notify_per_write else None)
            try:
                h = self.backend.post_write(s.peer.peer_id, batch, data)
            except TransferError as e:
                self._terminate(s, TransferError(e.kind, e.message, room=s.room))
                return
            s.inflight.append((h, batch.nbytes))
            s.posted_bytes += batch.nbytes
            s.num_data += data is not None

    def _maybe_post_final(self, s: SendLeg) -> None:
        if s.aux_payload is None or s.queued or s.final_handle is not None or s.final_landed:
            return
        if s.inflight and (not self._notify_per_write or (s.piece is not None
                                                          and not s.piece.primary)):
            return  # FINAL must follow the page writes' bytes: wait for their completion
        layers_missing = any(len(s.pushed.get(r.name, ())) < r.num_layers
                             for r in self.layout.regions)
        if layers_missing or self.clock() < s.post_after:
            return  # layers still to come: the final word waits for every one of them
        if s.piece is not None and not s.piece.primary:
            # Not this decode rank's aux writer: every write of ours completed, so FINAL(done)
            # as a message arrives after our data, as the aux write's notification would.
            self.backend.send_message(s.peer.peer_id,
                                      self._final_done(s, s.posted_bytes, s.num_data))
            self._done(s)  # final_bytes is 0: no aux write
            return
        final = self._final_done(s, s.posted_bytes, s.num_data)
        if s.ready_final is not None and s.ready_final[2] != final:  # pushed otherwise than
            self._drop_built_final(s)                                  # planned at start()
        built, s.ready_final = s.ready_final, None
        if built is None and not self._free_staging:
            return  # every staging slot is busy with another final write: try next poll
        s.staging_slot = built[1] if built is not None else self._free_staging.pop()
        room_in_slot = s.room ^ 1 if s.fault is FaultKind.WRONG_ROOM else s.room
        blob = bytearray(encode_aux(room_in_slot, s.aux_payload))
        if s.fault is FaultKind.CORRUPT_AUX:
            blob[-1 if s.aux_payload else HEADER_BYTES - 1] ^= 0xFF
        ctypes.memmove(self.layout.aux.slot_addr(s.staging_slot), bytes(blob), len(blob))
        notify = None if s.fault is FaultKind.DROP_NOTIFICATION else final
        try:
            if built is not None:  # the seed is in its slot now: post the write built ahead
                s.final_handle = self.backend.post_prepared(built[0].prepared)  # type: ignore[attr-defined]
            else:
                s.final_handle = self.backend.post_write(
                    s.peer.peer_id, self._aux_batch(s, s.staging_slot), notify)
        except TransferError as e:
            self._free_staging.append(s.staging_slot)
            s.staging_slot = None
            self._terminate(s, TransferError(e.kind, e.message, room=s.room))
            return
        s.final_bytes = len(blob)  # the seed, as decode counts it (not the slot's stale tail)

    def _poll_final(self, s: SendLeg) -> None:
        r = self.backend.poll_write(s.final_handle)
        if r.status is WriteStatus.PENDING:
            return
        s.final_handle = None
        self._free_staging.append(s.staging_slot)  # type: ignore[arg-type]
        s.staging_slot = None
        if r.status is WriteStatus.DONE and not s.state.terminal:
            s.final_landed = True  # DONE once every page write completed too (_progress)
        elif r.status is WriteStatus.FAILED and not s.state.terminal:
            assert r.error is not None
            self._terminate(s, TransferError(r.error.kind, r.error.message, room=s.room))
