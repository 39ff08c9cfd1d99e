"""In-process fake backend, for unit tests only: writes are `ctypes.memmove` between buffers
registered in this process, messages are Python queues. It keeps the contract a real backend
keeps (writes only into registered memory, notification after the data, per-peer message order)
and adds test levers on the shared `FakeFabric`: a write latency, `freeze` (a SIGSTOPped peer:
nothing it sends or receives moves) and `kill` (a dead peer: writes and messages to it fail).
"""

from __future__ import annotations

import ctypes
import itertools
import threading
import time
from collections import deque
from dataclasses import dataclass

from tandem.kvtransfer.backend import BackendOptions, PeerEvent, WritePoll, WriteStatus
from tandem.kvtransfer.contract import ErrorKind, TransferError
from tandem.kvtransfer.layout import CopyBatch


class FakeFabric:
    """The shared in-process 'network'. Owns the endpoint table and link states; one lock guards
    everything because endpoints may be driven from several threads in a test."""

    def __init__(self, write_latency_s: float = 0.0):
        self.lock = threading.RLock()
        self.write_latency_s = write_latency_s  # a write lands this long after post_write
        self._endpoints: dict[str, FakeBackend] = {}
        self._frozen: set[str] = set()
        self._dead: set[str] = set()
        self._fenced: set[tuple[str, str]] = set()  # (writer, target) pairs cut by disconnect
        self._ids = itertools.count()

    def add(self, ep: FakeBackend) -> str:
        with self.lock:
            local_id = f"fake-{next(self._ids)}"
            self._endpoints[local_id] = ep
            return local_id

    def endpoint(self, local_id: str) -> FakeBackend | None:
        return self._endpoints.get(local_id)

    def freeze(self, local_id: str) -> None:
        with self.lock:
            self._frozen.add(local_id)

    def thaw(self, local_id: str) -> None:
        with self.lock:
            self._frozen.discard(local_id)

    def kill(self, local_id: str) -> None:
        with self.lock:
            self._dead.add(local_id)

    def is_frozen(self, local_id: str) -> bool:
        return local_id in self._frozen

    def is_dead(self, local_id: str) -> bool:
        return local_id in self._dead or local_id not in self._endpoints

    def fence(self, a: str, b: str) -> None:
        with self.lock:
            self._fenced.update({(a, b), (b, a)})

    def unfence(self, a: str, b: str) -> None:
        with self.lock:
            self._fenced.difference_update({(a, b), (b, a)})

    def is_fenced(self, writer: str, target: str) -> bool:
        return (writer, target) in self._fenced


_DEFAULT_FABRIC: FakeFabric | None = None


def default_fabric() -> FakeFabric:
    global _DEFAULT_FABRIC
    if _DEFAULT_FABRIC is None:
        _DEFAULT_FABRIC = FakeFabric()
    return _DEFAULT_FABRIC


@dataclass(slots=True)
class _FakeWrite:
    peer_id: str
    batch: CopyBatch
    notify: str | None
    due: float  # monotonic time at which the bytes land
    cancelled: bool = False
    finished: bool = False


@dataclass(slots=True)
class _FakePrepared:
    peer_id: str
    batch: CopyBatch
    notify: str | None
    used: bool = False  # posted or dropped


class FakeBackend:
    name = "fake"
    notify_per_write = True  # a notification rides on the write itself
    max_batch_entries = None  # memmoves: no limit

    def __init__(self, options: BackendOptions):
        self.fabric: FakeFabric = options.fabric or default_fabric()  # type: ignore[assignment]
        self._regs: list[tuple[int, int]] = []  # (ptr, nbytes) registered here
        self._inbox: deque[PeerEvent] = deque()
        self._outbox: deque[tuple[str, str]] = deque()  # held while a side is frozen
        self.local_id = self.fabric.add(self)
        self.num_prepared = self.num_prepared_posts = self.num_prepared_dropped = 0  # tests

    # -- memory -----------------------------------------------------------------------------
    def address(self) -> str:
        return self.local_id

    def register(self, ptr: int, nbytes: int, device: str) -> None:
        if device != "cpu":
            raise TransferError(ErrorKind.BACKEND, f"fake backend: only host memory, got {device}")
        self._regs.append((ptr, nbytes))

    def _covers(self, ptr: int, nbytes: int) -> bool:
        return any(p <= ptr and ptr + nbytes <= p + n for p, n in self._regs)

    # -- peers ------------------------------------------------------------------------------
    def connect(self, address: str) -> str:
        if self.fabric.is_dead(address):
            raise TransferError(ErrorKind.PEER_DEAD, f"fake peer {address} is not reachable")
        self.fabric.unfence(self.local_id, address)
        return address

    def disconnect(self, peer_id: str) -> None:
        with self.fabric.lock:
            self.fabric.fence(self.local_id, peer_id)

    # -- writes -----------------------------------------------------------------------------
    def post_write(self, peer_id: str, batch: CopyBatch, notify: str | None) -> object:
        for a, n in zip(batch.src_addrs, batch.lengths):
            if not self._covers(a, n):
                raise TransferError(ErrorKind.BACKEND, f"fake: local [{a:#x}, +{n}) not registered")
        due = time.monotonic() + self.fabric.write_latency_s
        return _FakeWrite(peer_id=peer_id, batch=batch, notify=notify, due=due)

    def prepare_write(self, peer_id: str, batch: CopyBatch, notify: str | None) -> object:
        """A write built now and posted later by `post_prepared` (nothing to build here: the
        record is kept, so the sender's ahead-of-GO path runs on this backend too)."""
        self.num_prepared += 1
        return _FakePrepared(peer_id=peer_id, batch=batch, notify=notify)

    def post_prepared(self, prepared: object) -> object:
        p: _FakePrepared = prepared  # type: ignore[assignment]
        assert not p.used, "a prepared write is posted once"
        p.used = True
        self.num_prepared_posts += 1
        return self.post_write(p.peer_id, p.batch, p.notify)

    def drop_prepared(self, prepared: object) -> None:
        p: _FakePrepared = prepared  # type: ignore[assignment]
        assert not p.used, "a posted write is not dropped: poll or cancel it"
        p.used = True
        self.num_prepared_dropped += 1

    def poll_write(self, handle: object) -> WritePoll:
        w: _FakeWrite = handle  # type: ignore[assignment]
        assert not w.finished, "poll_write on a finished handle"
        with self.fabric.lock:
            fab = self.fabric
            if fab.is_dead(w.peer_id) or fab.is_fenced(self.local_id, w.peer_id):
                w.finished = True
                return WritePoll(WriteStatus.FAILED, TransferError(
                    ErrorKind.PEER_DEAD, f"fake peer {w.peer_id} is dead or fenced"))
            if fab.is_frozen(w.peer_id) or fab.is_frozen(self.local_id) or time.monotonic() < w.due:
                return WritePoll(WriteStatus.PENDING)
            peer = fab.endpoint(w.peer_id)
            assert peer is not None
            for s, d, n in zip(w.batch.src_addrs, w.batch.dst_addrs, w.batch.lengths):
                if not peer._covers(d, n):
                    w.finished = True
                    return WritePoll(WriteStatus.FAILED, TransferError(
                        ErrorKind.BACKEND, f"fake: remote [{d:#x}, +{n}) not registered"))
            for s, d, n in zip(w.batch.src_addrs, w.batch.dst_addrs, w.batch.lengths):
                ctypes.memmove(d, s, n)
            if w.notify is not None:  # after the bytes, like a real notification
                peer._inbox.append(PeerEvent(self.local_id, w.notify))
            w.finished = True
            return WritePoll(WriteStatus.DONE)

    def cancel_write(self, handle: object) -> bool:
        w: _FakeWrite = handle  # type: ignore[assignment]
        w.cancelled = w.finished = True  # nothing landed yet: the memmove happens in poll_write
        return True

    # -- messages ---------------------------------------------------------------------------
    def send_message(self, peer_id: str, message: str) -> None:
        with self.fabric.lock:
            self._outbox.append((peer_id, message))
            self._flush()

    def _flush(self) -> None:
        fab = self.fabric
        while self._outbox and not fab.is_frozen(self.local_id):
            peer_id, message = self._outbox[0]
            if fab.is_dead(peer_id) or fab.is_fenced(self.local_id, peer_id):
                self._outbox.popleft()
                self._inbox.append(PeerEvent(peer_id, None, TransferError(
                    ErrorKind.PEER_DEAD, f"fake peer {peer_id} is dead or fenced")))
                continue
            if fab.is_frozen(peer_id):
                return  # a frozen peer's socket buffer: kept, in order, until thaw
            peer = fab.endpoint(peer_id)
            assert peer is not None
            peer._inbox.append(PeerEvent(self.local_id, message))
            self._outbox.popleft()

    def poll_events(self) -> list[PeerEvent]:
        with self.fabric.lock:
            self._flush()
            if self.fabric.is_frozen(self.local_id):
                return []
            out = list(self._inbox)
            self._inbox.clear()
            return out

    def close(self) -> None:
        with self.fabric.lock:
            self.fabric.kill(self.local_id)
