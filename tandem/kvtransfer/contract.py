"""The transfer contract both workers use: error type (defined in errors.py), per-transfer state
machine, the values that cross worker boundaries (`EndpointInfo`, `Destination`, receive events)
and the two Protocols (`KVSender` on prefill, `KVReceiver` on decode). Compatibility checking
lives in `compat.py`.

State machine of one transfer (one `room`), the same on both sides:

    RESERVED ──► TRANSFERRING ──► DONE
        │              │
        ├──► FAILED ◄──┤
        └──► ABORTED ◄─┘

- RESERVED: decode reserved pages + an aux slot (`expect`); prefill called `start` and sent BEGIN.
  No byte may be written yet.
- TRANSFERRING: decode granted the writer (GO); prefill may post writes. The receiver now knows
  exactly which peer can write into the pages.
- DONE: all groups' pages and the aux slot landed, the completion notification arrived after them,
  and the slot's room matched (docs/architecture.md, "Transfer completeness").
- FAILED / ABORTED: terminal. A terminal state says nothing about whether the writer has stopped:
  pages are returned only when the writer quiesced or was fenced (see `leases.ReceiveTable`).

Terminal states have no outgoing edges; `advance` enforces that and raises `IllegalTransition` on
anything not drawn above (a programming error, never a network condition).
"""

from __future__ import annotations

import enum
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from tandem.kvtransfer.compat import CompatInfo
from tandem.kvtransfer.errors import ErrorKind, TransferError

__all__ = [
    "Destination", "EndpointInfo", "ErrorKind", "IllegalTransition", "KVReceiver", "KVSender",
    "ReceiveEvent", "ReceiveFailed", "Received", "SendOutcome", "TransferError", "TransferState",
    "advance",
]

# ---------------------------------------------------------------------------------------------
# State machine


class TransferState(enum.Enum):
    RESERVED = "reserved"
    TRANSFERRING = "transferring"
    DONE = "done"
    FAILED = "failed"
    ABORTED = "aborted"

    @property
    def terminal(self) -> bool:
        return self in _TERMINAL


_TERMINAL = frozenset({TransferState.DONE, TransferState.FAILED, TransferState.ABORTED})
_LEGAL: dict[TransferState, frozenset[TransferState]] = {
    TransferState.RESERVED: frozenset(
        {TransferState.TRANSFERRING, TransferState.FAILED, TransferState.ABORTED}
    ),
    TransferState.TRANSFERRING: frozenset(
        {TransferState.DONE, TransferState.FAILED, TransferState.ABORTED}
    ),
    TransferState.DONE: frozenset(),
    TransferState.FAILED: frozenset(),
    TransferState.ABORTED: frozenset(),
}


class IllegalTransition(RuntimeError):
    """A state change the machine above does not allow: a bug in the caller, not a network event."""


def advance(current: TransferState, new: TransferState, *, room: int) -> TransferState:
    if new not in _LEGAL[current]:
        raise IllegalTransition(f"room {room}: {current.value} -> {new.value} is not allowed")
    return new


# ---------------------------------------------------------------------------------------------
# Values that cross worker boundaries (router, Ray, gRPC): only str/int/float/bytes inside.


@dataclass(frozen=True, slots=True, kw_only=True)
class EndpointInfo:
    """How to reach one endpoint (one TP rank of one worker) and what it serves.

    Carried out of band (router/Ray) to the peer, which passes it to `KVSender.connect`."""

    backend: str  # "mooncake" | "nixl" | "fake": both sides must use the same one
    address: str  # backend-specific ASCII: Mooncake "host:port#mailbox", NIXL base64 metadata
    session: int  # random 63-bit id of this endpoint instance (a restart gets a new one)
    role: str  # "prefill" | "decode"
    compat: CompatInfo

    def to_wire(self) -> dict:
        return {
            "backend": self.backend,
            "address": self.address,
            "session": self.session,
            "role": self.role,
            "compat": self.compat.to_wire(),
        }

    @classmethod
    def from_wire(cls, d: dict) -> EndpointInfo:
        return cls(
            backend=str(d["backend"]),
            address=str(d["address"]),
            session=int(d["session"]),
            role=str(d["role"]),
            compat=CompatInfo.from_wire(d["compat"]),
        )

    def encode(self) -> bytes:
        return json.dumps(self.to_wire(), separators=(",", ":")).encode()

    @classmethod
    def decode(cls, data: bytes) -> EndpointInfo:
        return cls.from_wire(json.loads(data))


@dataclass(frozen=True, slots=True, kw_only=True)
class Destination:
    """Where one request's KV goes on one decode rank. Made by `KVReceiver.expect`, carried by the
    router to the matching prefill rank, consumed by `KVSender.start`.

    The sender writes its i-th source page into `page_ids[i]` for every layer of every group, and
    the EAGLE seed into `aux_slot`. `len(page_ids)` is what decode reserved (prompt + budget); the
    sender may fill a prefix of it."""

    receiver_session: int  # EndpointInfo.session of the decode endpoint
    room: int  # 64-bit request id from the router
    page_ids: tuple[int, ...]  # [num_reserved] decode page ids, same ids in every layer group
    aux_slot: int  # index into the decode AuxRegion
    timeout_s: float  # the transfer deadline, measured by each side from its own start

    def encode(self) -> bytes:
        return json.dumps(
            [self.receiver_session, self.room, list(self.page_ids), self.aux_slot, self.timeout_s],
            separators=(",", ":"),
        ).encode()

    @classmethod
    def decode(cls, data: bytes) -> Destination:
        session, room, page_ids, aux_slot, timeout_s = json.loads(data)
        return cls(
            receiver_session=int(session),
            room=int(room),
            page_ids=tuple(int(p) for p in page_ids),
            aux_slot=int(aux_slot),
            timeout_s=float(timeout_s),
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class Received:
    """Decode event: the request's KV and seed are in place; the pages now belong to the request."""

    room: int
    page_ids: tuple[int, ...]  # [num_pages] the destination pages actually written
    aux_payload: bytes  # the EAGLE seed bytes, copied out of the slot (the slot is already free)


@dataclass(frozen=True, slots=True, kw_only=True)
class ReceiveFailed:
    """Decode event: the request will not receive its KV. Its pages are NOT free yet: they come
    back through the release callback once no writer can touch them."""

    room: int
    error: TransferError


ReceiveEvent = Received | ReceiveFailed


@dataclass(frozen=True, slots=True, kw_only=True)
class SendOutcome:
    """Prefill event: a transfer reached a terminal state (as seen by the sender)."""

    room: int
    state: TransferState
    error: TransferError | None  # None iff state is DONE


# ---------------------------------------------------------------------------------------------
# Protocols


class KVSender(Protocol):
    """Prefill side, one per TP rank. Single-threaded: its owner calls `poll()` to make progress
    (every other method also polls once)."""

    def info(self) -> EndpointInfo: ...

    def connect(self, receiver: EndpointInfo, *, timeout_s: float | None = None) -> None:
        """Handshake: check CompatInfo both ways, learn the receiver's layout. Raises
        TransferError(HANDSHAKE) naming every differing field."""

    def start(self, dest: Destination, src_page_ids: Sequence[int], *,
              whole_groups: bool = True) -> None:
        """Begin a transfer: asks decode for the grant (BEGIN→GO). Writes wait for the grant.
        `whole_groups`: the caller will push each layer group in one call (False: layer by
        layer), so the sender may build the writes while it waits for GO."""

    def push_layers(self, room: int, group: str, layers: range) -> None:
        """Queue layers `layers` of group `group` (layer-wise push; each layer exactly once)."""

    def finish(self, room: int, aux_payload: bytes) -> None:
        """Write the aux slot and the completion notification once every layer landed."""

    def send(self, dest: Destination, src_page_ids: Sequence[int], aux_payload: bytes) -> None:
        """start + push every layer of every group + finish (push-after-compute)."""

    def abort(self, room: int) -> None:
        """End the room's legs; decode gets their final word once nothing of theirs can land."""

    def decline(self, dests: Sequence[Destination], reason: str = "aborted by prefill") -> None:
        """The room of `dests` ends before it was sent: decode releases its claim at once
        (no leg begun) or on the aborted legs' final word."""

    def state(self, room: int) -> TransferState: ...

    def wait(self, room: int, timeout_s: float | None = None) -> None:
        """Block (polling) until the transfer is terminal; raise its TransferError unless DONE."""

    def poll(self) -> list[SendOutcome]: ...

    def close(self) -> None: ...


class KVReceiver(Protocol):
    """Decode side, one per TP rank. Single-threaded, progressed by `poll()`."""

    def info(self) -> EndpointInfo: ...

    def expect(
        self, room: int, page_ids: Sequence[int], aux_slot: int, *, timeout_s: float | None = None
    ) -> Destination:
        """Claim pages + slot for `room` until the release callback returns them."""

    def abort(self, room: int) -> None: ...

    def state(self, room: int) -> TransferState | None: ...

    def poll(self) -> list[ReceiveEvent]: ...

    def close(self) -> None: ...
