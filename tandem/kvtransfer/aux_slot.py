"""The aux-slot format that carries the EAGLE seed, and its checks.

A slot is `HEADER_BYTES` of header followed by opaque payload bytes (kvtransfer never parses the
seed; `spec/` owns its encoding). Header, little-endian:

    offset  size  field
    0       4     magic  b"TKVA"
    4       2     version (1)
    6       2     reserved (0)
    8       8     room       u64: the request this seed belongs to
    16      4     payload_len u32
    20      4     crc32 over (room, payload_len, payload)

The decode side zeroes a slot's header when it reserves the slot, so a slot that was never written
for this request reads as "no magic" and one written for another request reads as a room mismatch:
both are `TransferError(CORRUPT)`, never a silently wrong seed.
"""

from __future__ import annotations

import struct
import zlib

from tandem.kvtransfer.contract import ErrorKind, TransferError

MAGIC = b"TKVA"
VERSION = 1
_HEADER = struct.Struct("<4sHHQII")
HEADER_BYTES = _HEADER.size  # 24
_U64 = (1 << 64) - 1


def _crc(room: int, payload: bytes) -> int:
    return zlib.crc32(payload, zlib.crc32(struct.pack("<QI", room, len(payload))))


def encode_aux(room: int, payload: bytes) -> bytes:
    """Header + payload, ready to be written into a slot of at least `len(result)` bytes."""
    if not 0 <= room <= _U64:
        raise ValueError(f"room: must fit in u64, got {room}")
    return _HEADER.pack(MAGIC, VERSION, 0, room, len(payload), _crc(room, payload)) + payload


def decode_aux(buf: bytes) -> tuple[int, bytes]:
    """(room, payload) from slot bytes; raises TransferError(CORRUPT) on any inconsistency."""
    if len(buf) < HEADER_BYTES:
        raise TransferError(ErrorKind.CORRUPT, f"aux slot shorter than its header ({len(buf)} B)")
    magic, version, _, room, length, crc = _HEADER.unpack_from(buf)
    if magic != MAGIC:
        raise TransferError(ErrorKind.CORRUPT, f"aux slot has no seed (magic {magic!r})")
    if version != VERSION:
        raise TransferError(ErrorKind.CORRUPT, f"aux slot version {version}, expected {VERSION}")
    if HEADER_BYTES + length > len(buf):
        raise TransferError(ErrorKind.CORRUPT,
                            f"aux payload length {length} exceeds the slot ({len(buf)} B)")
    payload = bytes(buf[HEADER_BYTES : HEADER_BYTES + length])
    if _crc(room, payload) != crc:
        raise TransferError(ErrorKind.CORRUPT, "aux slot checksum mismatch", room=room)
    return room, payload


def check_aux(buf: bytes, expected_room: int) -> bytes:
    """The payload if the slot holds a valid seed for `expected_room`; else
    TransferError(CORRUPT)."""
    room, payload = decode_aux(buf)
    if room != expected_room:
        raise TransferError(ErrorKind.CORRUPT,
                            f"aux slot holds room {room}, expected room {expected_room}",
                            room=expected_room)
    return payload
