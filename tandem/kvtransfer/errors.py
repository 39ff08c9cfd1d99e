"""The one error type of kvtransfer: `TransferError`, carrying an `ErrorKind`. Part of the
transfer contract (contract.py names it among its values); its own module so that the contract's
values and the compatibility check (compat.py), which both raise it, need not import each other.
"""

from __future__ import annotations

import enum


class ErrorKind(enum.Enum):
    """Why a transfer (or a connection) failed. One `TransferError` type carries one of these."""

    HANDSHAKE = "handshake"  # incompatible peers, or connect() protocol failure
    TIMEOUT = "timeout"  # a deadline passed (frozen peer, slow link, lost notification)
    PEER_DEAD = "peer_dead"  # the peer process/connection is gone, or it was fenced
    ABORTED = "aborted"  # either side aborted the request
    REFUSED = "refused"  # decode refused the writer (unknown/expired room, too many pages)
    BACKEND = "backend"  # the library reported failure (Mooncake rc < 0, NIXL "ERR")
    CORRUPT = "corrupt"  # aux slot magic/checksum/room/byte count did not match
    INVALID = "invalid"  # caller error: page id out of range, unknown group, double push


class TransferError(Exception):
    """The only exception kvtransfer raises for backend/peer/transfer failures."""

    def __init__(self, kind: ErrorKind, message: str, *, room: int | None = None):
        super().__init__(message)
        self.kind = kind
        self.message = message
        self.room = room

    def __str__(self) -> str:
        where = f" (room {self.room})" if self.room is not None else ""
        return f"[{self.kind.value}]{where} {self.message}"

    def __reduce__(self):  # survive pickling through Ray / multiprocessing
        return (_rebuild_error, (self.kind.value, self.message, self.room))


def _rebuild_error(kind: str, message: str, room: int | None) -> TransferError:
    return TransferError(ErrorKind(kind), message, room=room)
