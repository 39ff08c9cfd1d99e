"""Control messages between a sender and a receiver, and their ASCII encoding.

Messages travel as backend notifications (NIXL notif bytes, Mooncake TransferNotify strings, which
must be valid UTF-8, hence ASCII JSON). Per peer pair they are delivered in order.

    sender (prefill)                         receiver (decode)
    HELLO(info, layout)            ───►      check compat + layout
                                   ◄───      WELCOME(session, layout) | REFUSE(reason)
    BEGIN(room, num_pages)         ───►      room reserved & fits?  -> state TRANSFERRING
                                   ◄───      GO(room) | DENY(room, reason)
    ...page writes...              ───►      (each may carry DATA(room, bytes) as its
                                                notification, which arrives after its bytes)
    aux write + FINAL(done, n, bytes, count) as the write's notification (arrives after the
                                   aux bytes; the room is complete once `count` DATA arrived)
    FINAL(failed|aborted)          ───►      sent only after every posted write finished
                                   ◄───      ABORT(room)   (decode abort or decode deadline)
    FINAL(aborted, session)        ───►      (no BEGIN: the room ended on prefill before it
                                                was begun) decode releases the claim at once
    BYE                            ◄──►      endpoint closing

FINAL is the sender's "final word": after it, the sender never writes that room again. Every
ABORT is answered by one (a FINAL(done) riding on the aux write is the final word only once the
DATA of every page write it counts arrived).
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass, field

from tandem.kvtransfer.contract import ErrorKind, TransferError

WIRE_VERSION = 2


class MsgKind(enum.Enum):
    HELLO = "hello"
    WELCOME = "welcome"
    REFUSE = "refuse"
    BEGIN = "begin"
    GO = "go"
    DENY = "deny"
    ABORT = "abort"
    FINAL = "final"
    DATA = "data"
    BYE = "bye"


@dataclass(frozen=True, slots=True, kw_only=True)
class Message:
    kind: MsgKind
    room: int = 0
    session: int = 0  # BEGIN / FINAL: the receiver session it targets; WELCOME: the receiver's
    num_pages: int = 0  # BEGIN / FINAL(done): pages written
    nbytes: int = 0  # FINAL(done): KV bytes written (all groups, all layers); DATA: the write's
    count: int = 0  # FINAL(done): page writes that carried DATA (the receiver waits for them all)
    outcome: str = ""  # FINAL: "done" | "failed" | "aborted"
    reason: str = ""  # REFUSE / DENY / FINAL(failed)
    body: dict = field(default_factory=dict)  # HELLO: {"info", "layout"}; WELCOME: {"layout"}

    def encode(self) -> str:
        d: dict = {"v": WIRE_VERSION, "t": self.kind.value}
        for name in ("room", "session", "num_pages", "nbytes", "count"):
            if getattr(self, name):
                d[name] = getattr(self, name)
        for name in ("outcome", "reason"):
            if getattr(self, name):
                d[name] = getattr(self, name)
        if self.body:
            d["body"] = self.body
        return json.dumps(d, separators=(",", ":"))


def decode_message(text: str | bytes) -> Message:
    try:
        d = json.loads(text)
        if d.get("v") != WIRE_VERSION:
            raise ValueError(f"wire version {d.get('v')!r}, expected {WIRE_VERSION}")
        return Message(
            kind=MsgKind(d["t"]),
            room=int(d.get("room", 0)),
            session=int(d.get("session", 0)),
            num_pages=int(d.get("num_pages", 0)),
            nbytes=int(d.get("nbytes", 0)),
            count=int(d.get("count", 0)),
            outcome=str(d.get("outcome", "")),
            reason=str(d.get("reason", "")),
            body=dict(d.get("body", {})),
        )
    except (ValueError, KeyError, TypeError) as e:
        preview = text[:80] if isinstance(text, str) else text[:80].decode(errors="replace")
        raise TransferError(ErrorKind.HANDSHAKE, f"malformed control message {preview!r}: {e}")
