"""NIXL backend (UCX plugin): one `nixl_agent` per endpoint.

How the library is used, and why:
- The agent's metadata (which embeds every registration) is this endpoint's address, base64 so
  it stays ASCII. Register all memory before publishing it: later registrations are invisible to
  peers until the metadata is re-sent.
- Data: `initialize_xfer("WRITE", local, remote, peer, notif)` + `transfer`, polled with
  `check_xfer_state`. The notif reaches the peer after the data of that transfer.
- Control messages: `send_notif` (delivered even from an agent the target has not loaded).
- NIXL has no transfer timeout (a frozen peer over TCP stays "PROC" forever): deadlines live above.
  `release()` of a running handle asks UCX to cancel it; if that fails the handle is kept.
- A dead peer raises `nixlRemoteDisconnectError` (PEER_DEAD); other NIXL exceptions are BACKEND.
  Exceptions are matched by class name because the wheel's module is `nixl_cu12` or `nixl_cu13`.
- `disconnect` = `remove_remote_agent`, which tears the UCX connection down (a real fence).
"""

from __future__ import annotations

import base64
import os
import uuid
from dataclasses import dataclass

import numpy as np
from nixl._api import nixl_agent, nixl_agent_config

from tandem.kvtransfer.backend import BackendOptions, PeerEvent, WritePoll, WriteStatus
from tandem.kvtransfer.contract import ErrorKind, TransferError
from tandem.kvtransfer.layout import CopyBatch, parse_device


def _error(e: Exception, what: str) -> TransferError:
    dead = type(e).__name__ == "nixlRemoteDisconnectError"
    kind = ErrorKind.PEER_DEAD if dead else ErrorKind.BACKEND
    return TransferError(kind, f"nixl {what}: {type(e).__name__}: {e}")


@dataclass(slots=True)
class _NixlWrite:
    handle: object | None  # nixl_xfer_handle; None once released
    failed: TransferError | None = None
    finished: bool = False


class NixlBackend:
    name = "nixl"

    def __init__(self, options: BackendOptions):
        self.local_id = f"{options.name_hint}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        config = nixl_agent_config(enable_prog_thread=True, backends=list(options.nixl_backends))
        try:
            self.agent = nixl_agent(self.local_id, config)
        except Exception as e:  # e.g. bad UCX_TLS: the UCX plugin fails to come up
            raise _error(e, "agent creation") from e
        self._regs: list[object] = []  # nixlRegDList per registration, for deregister at close
        self._peers: set[str] = set()
        self._lost: list[PeerEvent] = []

    def address(self) -> str:
        return base64.b64encode(self.agent.get_agent_metadata()).decode("ascii")

    def register(self, ptr: int, nbytes: int, device: str) -> None:
        mem, dev = parse_device(device)
        try:
            self._regs.append(self.agent.register_memory([(ptr, nbytes, dev, "")], mem))
        except Exception as e:
            raise _error(e, f"register_memory({ptr:#x}, {nbytes}, {mem})") from e

    def connect(self, address: str) -> str:
        try:
            name = self.agent.add_remote_agent(base64.b64decode(address))
        except Exception as e:
            raise TransferError(ErrorKind.HANDSHAKE, f"nixl add_remote_agent: {e}") from e
        peer_id = name.decode() if isinstance(name, bytes) else str(name)
        self._peers.add(peer_id)
        return peer_id

    def disconnect(self, peer_id: str) -> None:
        if peer_id in self._peers:
            self._peers.discard(peer_id)
            try:
                self.agent.remove_remote_agent(peer_id)
            except Exception:  # already gone: the fence holds either way
                pass

    # -- writes -----------------------------------------------------------------------------
    def post_write(self, peer_id: str, batch: CopyBatch, notify: str | None) -> object:
        if peer_id not in self._peers:
            raise TransferError(ErrorKind.PEER_DEAD, f"nixl peer {peer_id} not connected")
        src_mem, src_dev = parse_device(batch.src_device)
        dst_mem, dst_dev = parse_device(batch.dst_device)
        n = len(batch.lengths)
        local = np.empty((n, 3), dtype=np.uint64)  # rows: (addr, len, device id)
        local[:, 0], local[:, 1], local[:, 2] = batch.src_addrs, batch.lengths, src_dev
        remote = np.empty((n, 3), dtype=np.uint64)
        remote[:, 0], remote[:, 1], remote[:, 2] = batch.dst_addrs, batch.lengths, dst_dev
        w = _NixlWrite(handle=None)
        try:
            w.handle = self.agent.initialize_xfer(
                "WRITE", self.agent.get_xfer_descs(local, src_mem),
                self.agent.get_xfer_descs(remote, dst_mem), peer_id,
                notify.encode("ascii") if notify is not None else b"")
            if self.agent.transfer(w.handle) == "ERR":
                w.failed = TransferError(ErrorKind.BACKEND, f"nixl transfer to {peer_id}: ERR")
        except Exception as e:
            w.failed = _error(e, f"write to {peer_id}")
        return w

    def poll_write(self, handle: object) -> WritePoll:
        w: _NixlWrite = handle  # type: ignore[assignment]
        assert not w.finished, "poll_write on a finished handle"
        if w.failed is None and w.handle is not None:
            try:
                state = self.agent.check_xfer_state(w.handle)
            except Exception as e:
                w.failed = _error(e, "check_xfer_state")
            else:
                if state == "PROC":
                    return WritePoll(WriteStatus.PENDING)
                if state == "ERR":
                    w.failed = TransferError(ErrorKind.BACKEND, "nixl transfer state ERR")
        if not self._release(w):
            return WritePoll(WriteStatus.PENDING)  # cannot free it yet: still owned by UCX
        w.finished = True
        if w.failed is not None:
            return WritePoll(WriteStatus.FAILED, w.failed)
        return WritePoll(WriteStatus.DONE)

    def _release(self, w: _NixlWrite) -> bool:
        if w.handle is None:
            return True
        try:
            w.handle.release()  # type: ignore[attr-defined]
        except Exception:
            return False
        w.handle = None
        return True

    def cancel_write(self, handle: object) -> bool:
        w: _NixlWrite = handle  # type: ignore[assignment]
        if self._release(w):  # release() of a running transfer cancels it
            w.finished = True
            return True
        return False

    # -- messages ---------------------------------------------------------------------------
    def send_message(self, peer_id: str, message: str) -> None:
        try:
            self.agent.send_notif(peer_id, message.encode("ascii"))
        except Exception as e:
            self._lost.append(PeerEvent(peer_id, None, _error(e, f"send_notif to {peer_id}")))

    def poll_events(self) -> list[PeerEvent]:
        out, self._lost = self._lost, []
        for peer, msgs in self.agent.get_new_notifs().items():
            peer_id = peer.decode() if isinstance(peer, bytes) else str(peer)
            out.extend(PeerEvent(peer_id, m.decode("ascii", errors="replace")) for m in msgs)
        return out

    def close(self) -> None:
        for peer_id in list(self._peers):
            self.disconnect(peer_id)
        for reg in self._regs:
            try:
                self.agent.deregister_memory(reg)
            except Exception:
                pass
        self._regs.clear()
