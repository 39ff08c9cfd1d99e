"""`ReceiveTable`: the decode side's claims on KV pages and aux slots while a transfer may write
into them, and the one place that gives them back.

Invariant (docs/architecture.md, "No leaks", and step 9 of "One request's path"): for every
reserved room, `release(Release)` is called exactly once, and only when no transfer can still
write into its pages or slot, i.e. when
  (a) no writer was ever granted (the room never left RESERVED: nobody was told GO), or
  (b) every granted writer gave its final word (FINAL, or the completion notification): a sender
      sends it only after every write it posted has finished or was cancelled, or
  (c) the lease deadline passed AND the writer was fenced (`fence`: the endpoint tore the
      connection down, so the sender cannot write any more; with Mooncake, whose API cannot cut a
      connection, (c) rests on the sender's own deadline + MC_TRANSFER_TIMEOUT being shorter than
      the lease: keep `lease_margin_s` above them).
A terminal state alone (FAILED/ABORTED, e.g. decode's own deadline) never releases: that is what
keeps an abort mid-transfer from handing the pages to another request early.

Pages and slots are also checked for double booking: a page or slot held by one room cannot be
reserved for another until released. The table is pure bookkeeping (no I/O) with an injectable
clock, so the invariant is unit-tested without a backend.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from tandem.kvtransfer.contract import ErrorKind, TransferError, TransferState, advance


@dataclass(frozen=True, slots=True, kw_only=True)
class Release:
    """Handed to the owner's callback: these pages + slot are no longer touched by any transfer.
    For DONE the pages hold the request's KV (keep them for decoding); otherwise free them."""

    room: int
    page_ids: tuple[int, ...]  # every page reserved for the room
    aux_slot: int
    outcome: TransferState  # DONE | FAILED | ABORTED
    reason: str  # "done" | "never_granted" | "writer_final" | "lease_fenced" | "closed"


@dataclass(slots=True)
class _Claim:
    room: int
    page_ids: tuple[int, ...]
    aux_slot: int
    state: TransferState
    deadline: float  # monotonic: the transfer must be DONE by then
    lease_deadline: float  # monotonic: after this the writer is fenced
    # peer id granted GO -> it gave its final word (quiesced). Several with different TP sizes
    # (each prefill rank holding some of this decode rank's heads), one otherwise.
    writers: dict[str, bool] = field(default_factory=dict)
    num_pages: int = 0  # pages the writers announced in BEGIN (all the same)
    granted_at: float = 0.0
    error: TransferError | None = None
    timeout_s: float | None = None  # set: the deadline restarts at the first grant
    lease_margin_s: float = 0.0

    @property
    def writer(self) -> str | None:
        """The first writer granted (None: nobody was told GO)."""
        return next(iter(self.writers), None)

    @property
    def writer_quiesced(self) -> bool:
        return all(self.writers.values())

    def live_writers(self) -> list[str]:
        """Granted writers that may still write."""
        return [w for w, quiet in self.writers.items() if not quiet]


class ReceiveTable:
    """Owner of page/slot claims of in-flight receives on one decode rank. Sole caller of
    `release`. Driven by `DecodeReceiver` (transitions) and its clock (deadlines)."""

    def __init__(self, release: Callable[[Release], None], *,
                 clock: Callable[[], float] = time.monotonic):
        self._release_cb = release
        self._clock = clock
        self._claims: dict[int, _Claim] = {}
        self._held_pages: dict[int, int] = {}  # page id -> room
        self._held_slots: dict[int, int] = {}  # aux slot -> room

    # -- queries ------------------------------------------------------------------------------
    def __contains__(self, room: int) -> bool:
        return room in self._claims

    def __len__(self) -> int:
        return len(self._claims)

    def state(self, room: int) -> TransferState | None:
        c = self._claims.get(room)
        return c.state if c else None

    def claim(self, room: int) -> _Claim:
        return self._claims[room]

    def held_pages(self) -> frozenset[int]:
        return frozenset(self._held_pages)

    def rooms_of(self, writer: str) -> list[int]:
        return [r for r, c in self._claims.items() if writer in c.writers]

    # -- transitions --------------------------------------------------------------------------
    def reserve(self, room: int, page_ids: Sequence[int], aux_slot: int, *, timeout_s: float,
                lease_margin_s: float, reserve_wait_s: float | None = None) -> None:
        """Claim `page_ids` + `aux_slot` for `room`. The transfer must be DONE within
        `timeout_s` of this call, or -- with `reserve_wait_s` -- within `timeout_s` of its first
        grant, a writer having to begin within `reserve_wait_s` (time a request spends queued
        for prefill is not transfer time)."""
        if room in self._claims:
            raise ValueError(f"room {room}: already reserved")
        pages = tuple(page_ids)
        busy = [p for p in pages if p in self._held_pages]
        if busy or aux_slot in self._held_slots:
            raise ValueError(f"room {room}: pages {busy[:8]} / aux slot {aux_slot} still held by "
                             "another transfer (released only when no writer can touch them)")
        now = self._clock()
        wait = timeout_s if reserve_wait_s is None else max(timeout_s, reserve_wait_s)
        self._claims[room] = _Claim(room=room, page_ids=pages, aux_slot=aux_slot,
                                    state=TransferState.RESERVED, deadline=now + wait,
                                    lease_deadline=now + wait + lease_margin_s,
                                    timeout_s=timeout_s if reserve_wait_s is not None else None,
                                    lease_margin_s=lease_margin_s)
        self._held_pages.update((p, room) for p in pages)
        self._held_slots[aux_slot] = room

    def grant(self, room: int, writer: str, num_pages: int) -> None:
        """RESERVED -> TRANSFERRING: `writer` may now write the first `num_pages` pages. A
        further writer of a TRANSFERRING room joins it (different TP sizes: several senders)."""
        c = self._claims[room]
        if c.state is TransferState.TRANSFERRING and writer not in c.writers:
            if num_pages != c.num_pages:
                raise ValueError(f"room {room}: writer {writer} announces {num_pages} pages, "
                                 f"another {c.num_pages}")
            c.writers[writer] = False
            return
        c.state = advance(c.state, TransferState.TRANSFERRING, room=room)
        c.writers[writer] = False
        c.num_pages, c.granted_at = num_pages, self._clock()
        if c.timeout_s is not None:  # the transfer's own deadline counts from its first grant
            c.deadline = c.granted_at + c.timeout_s
            c.lease_deadline = c.deadline + c.lease_margin_s

    def complete(self, room: int) -> _Claim:
        """TRANSFERRING -> DONE on a verified completion notification (the writer's final word)."""
        c = self._claims[room]
        c.state = advance(c.state, TransferState.DONE, room=room)
        c.writers = dict.fromkeys(c.writers, True)
        self._maybe_release(c, "done")
        return c

    def fail(self, room: int, error: TransferError) -> str | None:
        """-> FAILED (or ABORTED for kind ABORTED). Returns the writer to tell, if one was granted
        and has not quiesced. Releases now only if no writer was ever granted."""
        c = self._claims[room]
        target = TransferState.ABORTED if error.kind is ErrorKind.ABORTED else TransferState.FAILED
        c.state = advance(c.state, target, room=room)
        c.error = error
        self._maybe_release(c, "never_granted")
        live = c.live_writers()
        return live[0] if live else None

    def writer_final(self, room: int, writer: str, error: TransferError | None) -> bool:
        """The granted writer's final word for a room (FINAL failed/aborted, or a late
        completion after decode gave up). Returns True if this made the room terminal now."""
        c = self._claims.get(room)
        if c is None or writer not in c.writers:
            return False  # stale or foreign: never let another peer release our pages
        became_terminal = False
        if not c.state.terminal:
            self.fail(room, error or TransferError(ErrorKind.BACKEND, "sender failed", room=room))
            became_terminal = True
        c.writers[writer] = True
        self._maybe_release(c, "writer_final")
        return became_terminal

    def expired(self) -> tuple[list[int], list[_Claim]]:
        """(rooms past their transfer deadline and not terminal, claims past their lease whose
        writer has not quiesced). The caller fails the first and fences the writers of the
        second."""
        now = self._clock()
        timed_out = [c.room for c in self._claims.values()
                     if not c.state.terminal and now >= c.deadline]
        lease_over = [c for c in self._claims.values()
                      if c.state.terminal and now >= c.lease_deadline]
        return timed_out, lease_over

    def fence(self, writer: str) -> list[int]:
        """`writer` can no longer write (its connection was torn down). Non-terminal rooms of it
        fail PEER_DEAD; every room of it is released. Returns rooms that just became terminal."""
        newly_failed = []
        for room in self.rooms_of(writer):
            c = self._claims[room]
            if not c.state.terminal:
                self.fail(room, TransferError(ErrorKind.PEER_DEAD,
                                              f"writer {writer} fenced", room=room))
                newly_failed.append(room)
            c.writers[writer] = True
            self._maybe_release(c, "lease_fenced")
        return newly_failed

    def close(self) -> None:
        """Endpoint shutdown: the memory goes away with it; hand everything back."""
        for c in list(self._claims.values()):
            if not c.state.terminal:
                c.state = TransferState.ABORTED
            c.writers = dict.fromkeys(c.writers, True)
            self._maybe_release(c, "closed")

    # -- the only way out ---------------------------------------------------------------------
    def _maybe_release(self, c: _Claim, reason: str) -> None:
        if not c.state.terminal:
            return
        if not c.writer_quiesced:
            return  # a granted writer may still be writing: hold (lease)
        del self._claims[c.room]
        for p in c.page_ids:
            del self._held_pages[p]
        del self._held_slots[c.aux_slot]
        self._release_cb(Release(room=c.room, page_ids=c.page_ids, aux_slot=c.aux_slot,
                                 outcome=c.state, reason=reason))
