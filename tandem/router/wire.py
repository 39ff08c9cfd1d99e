"""Request deserialization that explains itself.

gRPC's default deserializer turns any unparsable request into INTERNAL "Exception deserializing
request!". Here an unparsable request becomes an `Undecodable` value whose message names the
field: protobuf refuses invalid UTF-8 in `string` fields without saying which one, so the raw
wire format is walked to find it (`messages[1].content: invalid UTF-8`). The servicer answers an
`Undecodable` with INVALID_ARGUMENT. Pure functions, no state.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import DecodeError, Message

M = TypeVar("M", bound=Message)


@dataclass(frozen=True, slots=True)
class Undecodable:
    message: str  # starts with the field at fault when it is known


def safe_deserializer(cls: type[M]) -> Callable[[bytes], M | Undecodable]:
    def deserialize(data: bytes) -> M | Undecodable:
        try:
            return cls.FromString(data)
        except DecodeError:
            path = find_invalid_utf8(cls.DESCRIPTOR, data)
            if path is not None:
                return Undecodable(f"{path}: invalid UTF-8 (string fields must be UTF-8 text)")
            return Undecodable(f"request: not a valid {cls.DESCRIPTOR.full_name} message")

    return deserialize


def find_invalid_utf8(descriptor: Descriptor, data: bytes, prefix: str = "") -> str | None:
    """Path of the first string field (e.g. `messages[0].content`) holding invalid UTF-8, or
    None (also when the bytes are not well-formed protobuf)."""
    seen: dict[int, int] = {}  # field number -> occurrences so far (the repeated index)
    pos = 0
    try:
        while pos < len(data):
            key, pos = _varint(data, pos)
            number, wire_type = key >> 3, key & 7
            if wire_type == 0:
                _, pos = _varint(data, pos)
            elif wire_type == 1:
                pos += 8
            elif wire_type == 5:
                pos += 4
            elif wire_type == 2:
                size, pos = _varint(data, pos)
                chunk, pos = data[pos : pos + size], pos + size
                field = descriptor.fields_by_number.get(number)
                if field is None:
                    continue
                index = seen.get(number, 0)
                seen[number] = index + 1
                name = prefix + field.name + (f"[{index}]" if _repeated(field) else "")
                if field.type == FieldDescriptor.TYPE_STRING:
                    try:
                        chunk.decode("utf-8")
                    except UnicodeDecodeError:
                        return name
                elif field.type == FieldDescriptor.TYPE_MESSAGE:
                    found = find_invalid_utf8(field.message_type, chunk, name + ".")
                    if found is not None:
                        return found
            else:  # groups (3, 4) are not used by this API
                return None
    except IndexError:
        return None
    return None


def _repeated(field: FieldDescriptor) -> bool:
    # `is_repeated` on protobuf >= 5.27; `label` on older runtimes.
    flag = getattr(field, "is_repeated", None)
    return bool(flag) if flag is not None else field.label == FieldDescriptor.LABEL_REPEATED


def _varint(data: bytes, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        byte = data[pos]  # IndexError on truncation
        pos += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result, pos
        shift += 7
        if shift > 63:
            raise IndexError("varint too long")
