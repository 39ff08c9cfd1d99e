"""Mooncake Transfer Engine backend (P2PHANDSHAKE mode: no metadata server; `tcp` on CPU,
`rdma`/`tcp` on GPU nodes).

How the library is used, and why:
- Data: one `transfer_submit_write` per entry, polled with the non-blocking `transfer_check_status`.
  The batch APIs only offer blocking waits (`batch_transfer_sync_*`, `get_batch_transfer_status`
  spin a core until done), and `transfer_check_status` on a batch id looks at its first task only.
  A status other than 0 frees the id inside Mooncake, so each id is checked until it is non-zero
  and never again.
- The TCP transport queues at most MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER (1024) transfers per peer
  and rejects the rest ("queue-full", status -1) - a limit on entries IN FLIGHT per peer, across
  batches, not only per batch. Entries past `_MAX_INFLIGHT_PER_PEER` wait inside the handle and
  are submitted as earlier ones complete.
- Notifications only ride on the blocking `transfer_sync(..., notify)`; an empty batch is refused.
  So every control message is a 1-byte write into the peer's registered 64-byte mailbox with a
  `TransferNotify(our id, text)`, issued by one sender thread per peer (keeps per-peer order, and a
  frozen peer - whose call blocks for MC_TRANSFER_TIMEOUT - delays only its own queue). A
  "notify" attached to a data write is queued there once every entry of that write completed, so
  it reaches the peer after the bytes.
- Mooncake binds its handshake and data listeners to the wildcard address whatever host it is
  given: in a worker the preloaded bind() shim binds them to the advertised host instead, and
  any still on the wildcard is filtered to it right after `initialize` (bind.py).
- Failures are ints (nothing raises). A failed write is classified with `send_probe`: an
  unreachable peer is PEER_DEAD, anything else BACKEND.
- Limits: async writes to a frozen peer stay pending forever (no per-task timeout on this path)
  and cannot be cancelled; `disconnect` cannot cut an established Mooncake connection. The
  receiver's lease (leases.py) is what bounds page reuse in that case.
"""

from __future__ import annotations

import ctypes
import queue
import threading
from collections import defaultdict, deque
from dataclasses import dataclass, field

from mooncake.engine import TransferEngine, TransferNotify, TransferOpcode

from tandem.kvtransfer import bind
from tandem.kvtransfer.backend import BackendOptions, PeerEvent, WritePoll, WriteStatus
from tandem.kvtransfer.contract import ErrorKind, TransferError
from tandem.kvtransfer.layout import MAX_BATCH_ENTRIES, CopyBatch, parse_device

_MAILBOX_BYTES = 64
_MAX_INFLIGHT_PER_PEER = 1000  # < 1024 queued per peer, leaving room for control messages


@dataclass(slots=True)
class _McWrite:
    peer_id: str
    todo: deque[tuple[int, int, int]]  # (src, dst, len) not yet submitted (per-peer cap)
    pending: list[int]  # submitted Mooncake batch ids not yet seen non-zero
    notify: str | None
    notify_done: threading.Event | None = None
    notify_error: list[TransferError] = field(default_factory=list)
    failed: TransferError | None = None
    finished: bool = False


class _PeerSender(threading.Thread):
    """Sends one peer's control messages in order (blocking Mooncake calls, GIL released)."""

    def __init__(self, owner: MooncakeBackend, peer_id: str, mailbox: int):
        super().__init__(daemon=True, name=f"mooncake-notify-{peer_id}")
        self.owner, self.peer_id, self.mailbox = owner, peer_id, mailbox
        self.q: queue.Queue[tuple[str, threading.Event | None, list] | None] = queue.Queue()

    def run(self) -> None:
        while (item := self.q.get()) is not None:
            text, done, errors = item
            rc = self.owner.engine.transfer_sync(
                self.peer_id, self.owner.mailbox_ptr, self.mailbox, 1, TransferOpcode.Write,
                TransferNotify(self.owner.local_id, text))
            if rc != 0:
                err = self.owner.classify(self.peer_id, f"notification rc={rc}")
                errors.append(err)
                self.owner.lost(self.peer_id, err)
            if done is not None:
                done.set()


class MooncakeBackend:
    name = "mooncake"
    max_batch_entries = MAX_BATCH_ENTRIES  # entries per batch over TCP (see the module doc)

    def __init__(self, options: BackendOptions):
        self.engine = TransferEngine()
        before = bind.tcp_listeners()
        with bind.listeners_on(options.host):
            rc = self.engine.initialize(options.host, "P2PHANDSHAKE", options.protocol,
                                        options.device_name)
        if rc != 0:
            raise TransferError(ErrorKind.BACKEND, f"mooncake initialize({options.host!r}, "
                                f"P2PHANDSHAKE, {options.protocol!r}) rc={rc}")
        self.local_id = f"{options.host}:{self.engine.get_rpc_port()}"
        # Mooncake listens on the wildcard address whatever `host` says unless the bind() shim
        # is preloaded (bind.py): listeners still on the wildcard are filtered to `host` now,
        # before this endpoint's address is published (not closed: the moment between listen()
        # and here, docs/reliability.md).
        self.confined: list[bind.Listener] = []
        if not bind.listen_any():
            try:
                self.confined = bind.confine_new_listeners(before, options.host,
                                                           self.engine.get_rpc_port())
            except (OSError, RuntimeError, ValueError) as e:
                raise TransferError(ErrorKind.BACKEND, f"mooncake listeners could not be held "
                                    f"to {options.host} ({e}); {bind.LISTEN_ANY_ENV}=1 runs "
                                    "them open") from e
        self._mailbox = ctypes.create_string_buffer(_MAILBOX_BYTES)  # 1-byte carrier of messages
        self.mailbox_ptr = ctypes.addressof(self._mailbox)
        self.register(self.mailbox_ptr, _MAILBOX_BYTES, "cpu")
        self._senders: dict[str, _PeerSender] = {}
        self._inflight: defaultdict[str, int] = defaultdict(int)  # submitted entries per peer
        self._lost: queue.SimpleQueue[PeerEvent] = queue.SimpleQueue()

    def address(self) -> str:
        return f"{self.local_id}#{self.mailbox_ptr}"

    def register(self, ptr: int, nbytes: int, device: str) -> None:
        kind, index = parse_device(device)
        location = "cpu:0" if kind == "DRAM" else f"cuda:{index}"
        rc = self.engine.register_memory(ptr, nbytes, location)
        if rc != 0:
            raise TransferError(ErrorKind.BACKEND, f"mooncake register_memory({ptr:#x}, {nbytes}, "
                                f"{location}) rc={rc}")

    def connect(self, address: str) -> str:
        peer_id, _, mailbox = address.partition("#")
        if not mailbox.isdigit():
            raise TransferError(ErrorKind.HANDSHAKE, f"mooncake address {address!r} malformed")
        if peer_id not in self._senders:  # P2P handshake happens on the first write
            sender = _PeerSender(self, peer_id, int(mailbox))
            sender.start()
            self._senders[peer_id] = sender
        return peer_id

    def disconnect(self, peer_id: str) -> None:
        # Mooncake's Python API cannot close an established segment: stop messaging it only.
        sender = self._senders.pop(peer_id, None)
        if sender is not None:
            sender.q.put(None)

    def classify(self, peer_id: str, what: str) -> TransferError:
        if self.engine.send_probe(peer_id) != 0:
            return TransferError(ErrorKind.PEER_DEAD,
                                 f"mooncake peer {peer_id} unreachable ({what})")
        return TransferError(ErrorKind.BACKEND, f"mooncake write to {peer_id} failed ({what})")

    def lost(self, peer_id: str, error: TransferError) -> None:
        self._lost.put(PeerEvent(peer_id, None, error))

    # -- writes -----------------------------------------------------------------------------
    def post_write(self, peer_id: str, batch: CopyBatch, notify: str | None) -> object:
        if peer_id not in self._senders:
            raise TransferError(ErrorKind.PEER_DEAD, f"mooncake peer {peer_id} not connected")
        w = _McWrite(peer_id=peer_id, pending=[], notify=notify,
                     todo=deque(zip(batch.src_addrs, batch.dst_addrs, batch.lengths)))
        self._submit(w)
        return w

    def _submit(self, w: _McWrite) -> None:
        while w.todo and w.failed is None and self._inflight[w.peer_id] < _MAX_INFLIGHT_PER_PEER:
            s, d, n = w.todo.popleft()
            bid = self.engine.transfer_submit_write(w.peer_id, s, d, n)
            if bid <= 0:  # -1: could not open the peer's segment (dead peer at first contact)
                w.failed = self.classify(w.peer_id, f"submit rc={bid}")
                w.todo.clear()
                return
            w.pending.append(bid)
            self._inflight[w.peer_id] += 1

    def poll_write(self, handle: object) -> WritePoll:
        w: _McWrite = handle  # type: ignore[assignment]
        assert not w.finished, "poll_write on a finished handle"
        still = []
        for bid in w.pending:
            st = self.engine.transfer_check_status(bid)  # 1 done, 0 running, -1 failed, -2 timeout
            if st == 0:
                still.append(bid)
                continue
            self._inflight[w.peer_id] -= 1
            if st < 0 and w.failed is None:
                w.failed = self.classify(w.peer_id, "timeout" if st == -2 else f"status {st}")
                w.todo.clear()
        w.pending = still
        self._submit(w)
        if w.pending or w.todo:
            return WritePoll(WriteStatus.PENDING)
        if w.failed is not None:
            w.finished = True
            return WritePoll(WriteStatus.FAILED, w.failed)
        if w.notify is not None:
            if w.notify_done is None:  # every entry landed: now the notification
                w.notify_done = threading.Event()
                self._enqueue(w.peer_id, w.notify, w.notify_done, w.notify_error)
            if not w.notify_done.is_set():
                return WritePoll(WriteStatus.PENDING)
            if w.notify_error:
                w.finished = True
                return WritePoll(WriteStatus.FAILED, w.notify_error[0])
        w.finished = True
        return WritePoll(WriteStatus.DONE)

    def cancel_write(self, handle: object) -> bool:
        w: _McWrite = handle  # type: ignore[assignment]
        w.todo.clear()  # entries not yet submitted are simply dropped
        return not w.pending and w.notify_done is None  # submitted ones cannot be cancelled

    # -- messages ---------------------------------------------------------------------------
    def _enqueue(self, peer_id: str, text: str, done: threading.Event | None, errors: list) -> None:
        sender = self._senders.get(peer_id)
        if sender is None:
            errors.append(TransferError(ErrorKind.PEER_DEAD,
                                        f"mooncake peer {peer_id} disconnected"))
            if done is not None:
                done.set()
            return
        sender.q.put((text, done, errors))

    def send_message(self, peer_id: str, message: str) -> None:
        errors: list[TransferError] = []
        self._enqueue(peer_id, message, None, errors)
        for e in errors:
            self.lost(peer_id, e)

    def poll_events(self) -> list[PeerEvent]:
        out = [PeerEvent(n.name, n.msg) for n in self.engine.get_notifies()]
        while not self._lost.empty():
            out.append(self._lost.get())
        return out

    def close(self) -> None:
        senders = list(self._senders.values())
        for peer_id in list(self._senders):
            self.disconnect(peer_id)
        for sender in senders:  # flush queued messages (BYE); a thread still inside Mooncake at
            sender.join(timeout=1.0)  # interpreter exit can abort the process ("terminate called")
