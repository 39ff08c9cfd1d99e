"""NIXL backend (UCX plugin): one `nixl_agent` per endpoint.

How the library is used, and why:
- The agent's metadata (which embeds every registration) is this endpoint's address, base64 so
  it stays ASCII. Register all memory before publishing it: later registrations are invisible to
  peers until the metadata is re-sent.
- Data: one NIXL transfer per `post_write`, polled with `check_xfer_state`. The notif reaches the
  peer after the data of that transfer. Page writes between regions announced by
  `prepare_regions` use descriptor lists prepared once per peer (one descriptor per (layer,
  page) block, `prep_xfer_dlist`) and `make_prepped_xfer` with block indices, which NIXL merges
  back into one descriptor per contiguous run; anything else (the aux slot, unprepared memory)
  goes through `initialize_xfer` with numpy [n, 3] descriptor arrays. `prepare_write` builds
  such a transfer without posting it; `post_prepared` posts it with one `transfer()` call.
- Progress thread per role (BackendOptions.nixl_progress_thread, resolved by the endpoint): on
  for the receiver, whose UCX must progress for a host-memory write into it to complete at the
  sender even while its owner runs a forward pass; off for the sender, whose `check_xfer_state`
  / `get_new_notifs` polls progress UCX themselves. Used bare (None), the backend has no thread.
- Control messages: `send_notif` (delivered even from an agent the target has not loaded).
- NIXL has no transfer timeout (a frozen peer over TCP stays "PROC" forever): deadlines live above.
  `release()` of a running handle asks UCX to cancel it; if that fails the handle is kept.
- A dead peer raises `nixlRemoteDisconnectError` (PEER_DEAD); other NIXL exceptions are BACKEND.
  Exceptions are matched by class name because the wheel's module is `nixl_cu12` or `nixl_cu13`.
- `disconnect` = `remove_remote_agent`, which tears the UCX connection down (a real fence).
- Listeners: UCX's tcp transport listens on each network device it uses, so the agent is
  created with UCX_NET_DEVICES = the advertised host's interface (bind.py); NIXL's metadata
  listener thread stays off.
"""

from __future__ import annotations

import base64
import os
import uuid
from dataclasses import dataclass

import numpy as np
from nixl._api import nixl_agent, nixl_agent_config

from tandem.kvtransfer import bind, coalesce
from tandem.kvtransfer.backend import BackendOptions, PeerEvent, WritePoll, WriteStatus
from tandem.kvtransfer.contract import ErrorKind, TransferError
from tandem.kvtransfer.layout import CopyBatch, parse_device


def _error(e: Exception, what: str) -> TransferError:
    dead = type(e).__name__ == "nixlRemoteDisconnectError"
    kind = ErrorKind.PEER_DEAD if dead else ErrorKind.BACKEND
    return TransferError(kind, f"nixl {what}: {type(e).__name__}: {e}")


_MAX_PREPARED_BLOCKS = 1 << 22  # per region: larger pools post unprepared (memory of the lists)


@dataclass(slots=True)
class _Prepared:
    """Prepared one-descriptor-per-block lists of a (local region, remote region) pair."""

    src_base: int
    dst_base: int
    block_bytes: int
    src_blocks: int  # descriptors in `local` (= num_layers * num_pages of the local region)
    dst_blocks: int
    local: object  # nixl_prepped_dlist_handle (shared by every peer: keyed by the region)
    remote: object  # nixl_prepped_dlist_handle of this peer's region


@dataclass(slots=True)
class _NixlWrite:
    handle: object | None  # nixl_xfer_handle; None once released
    peer_id: str = ""
    failed: TransferError | None = None
    finished: bool = False


def _descs(addrs: np.ndarray, lengths: np.ndarray, dev: int) -> np.ndarray:
    """[n, 3] uint64 rows (addr, len, device id): NIXL's numpy descriptor form."""
    out = np.empty((addrs.shape[0], 3), dtype=np.uint64)
    out[:, 0], out[:, 1], out[:, 2] = addrs, lengths, dev
    return out


def _block_descs(base: int, block_bytes: int, num_blocks: int, device: str) -> np.ndarray:
    """[num_blocks, 3]: one descriptor per block of a region, block b at base + b * block_bytes."""
    addrs = np.uint64(base) + np.arange(num_blocks, dtype=np.uint64) * np.uint64(block_bytes)
    return _descs(addrs, np.full(num_blocks, block_bytes, dtype=np.uint64),
                  parse_device(device)[1])


class NixlBackend:
    name = "nixl"
    notify_per_write = True  # a notification rides on the write itself
    max_batch_entries = None  # one transfer per push, however many descriptors

    def __init__(self, options: BackendOptions):
        self.local_id = f"{options.name_hint}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        config = nixl_agent_config(enable_prog_thread=bool(options.nixl_progress_thread),
                                   backends=list(options.nixl_backends))
        try:
            # UCX's tcp transport listens on every device it uses: only `host`'s (bind.py).
            with bind.ucx_devices_for(options.host):
                self.agent = nixl_agent(self.local_id, config)
        except Exception as e:  # e.g. bad UCX_TLS: the UCX plugin fails to come up
            raise _error(e, "agent creation") from e
        self._regs: list[object] = []  # nixlRegDList per registration, for deregister at close
        self._peers: set[str] = set()
        self._lost: list[PeerEvent] = []
        self._local_lists: dict[tuple[int, int, int], object] = {}  # (base, block, n) -> dlist
        self._prepared: dict[str, list[_Prepared]] = {}  # peer id -> its prepared region pairs
        self.num_prepped_writes = 0  # writes posted through prepared lists (tests, bench)

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

    def prepare_regions(self, peer_id: str, pairs) -> None:
        """Prepare block descriptor lists for writes from each local region (KVRegion: a
        (layer, page) block; AuxRegion: a slot) to its remote twin at `peer_id` (after connect;
        the remote lists die with the connection). Best effort: a pair that cannot be prepared
        is posted unprepared."""
        self._release_prepared(peer_id)
        out = []
        for src, dst in pairs:
            n_src, n_dst, bb = src.num_blocks, dst.num_blocks, src.block_bytes
            if bb != dst.block_bytes or max(n_src, n_dst) > _MAX_PREPARED_BLOCKS:
                continue
            try:
                key = (src.base_ptr, bb, n_src)
                if key not in self._local_lists:
                    self._local_lists[key] = self.agent.prep_xfer_dlist(
                        "NIXL_INIT_AGENT", _block_descs(src.base_ptr, bb, n_src, src.device),
                        parse_device(src.device)[0])
                remote = self.agent.prep_xfer_dlist(
                    peer_id, _block_descs(dst.base_ptr, bb, n_dst, dst.device),
                    parse_device(dst.device)[0])
            except Exception:  # noqa: BLE001 - e.g. an older peer: unprepared writes still work
                continue
            out.append(_Prepared(src_base=src.base_ptr, dst_base=dst.base_ptr,
                                 block_bytes=bb, src_blocks=n_src, dst_blocks=n_dst,
                                 local=self._local_lists[key], remote=remote))
        self._prepared[peer_id] = out

    def _release_prepared(self, peer_id: str) -> None:
        for p in self._prepared.pop(peer_id, []):
            try:
                p.remote.release()  # type: ignore[attr-defined]
            except Exception:  # noqa: BLE001 - the peer is gone already
                pass

    def disconnect(self, peer_id: str) -> None:
        self._release_prepared(peer_id)
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
        w = self._build(peer_id, batch, notify)
        return self._post(w) if w.failed is None else w

    def prepare_write(self, peer_id: str, batch: CopyBatch, notify: str | None) -> object | None:
        """The NIXL transfer of `batch` built now (descriptor indices, `make_prepped_xfer`) and
        posted later by `post_prepared` with one `transfer()`: the sender builds a room's writes
        while it waits for GO, so that little is left between GO and the bytes moving. None
        where it cannot be built (the caller posts the batch plainly later)."""
        w = self._build(peer_id, batch, notify)
        if w.failed is not None:
            return None
        return w

    def post_prepared(self, prepared: object) -> object:
        w: _NixlWrite = prepared  # type: ignore[assignment]
        if w.peer_id not in self._peers:  # disconnected since: its remote lists are gone
            self._release(w)
            w.failed = TransferError(ErrorKind.PEER_DEAD, f"nixl peer {w.peer_id} not connected")
            return w
        return self._post(w)

    def drop_prepared(self, prepared: object) -> None:
        w: _NixlWrite = prepared  # type: ignore[assignment]
        self._release(w)  # never posted: release() only frees it
        w.finished = True

    def _build(self, peer_id: str, batch: CopyBatch, notify: str | None) -> _NixlWrite:
        w = _NixlWrite(handle=None, peer_id=peer_id)
        if peer_id not in self._peers:
            w.failed = TransferError(ErrorKind.PEER_DEAD, f"nixl peer {peer_id} not connected")
            return w
        notif = notify.encode("ascii") if notify is not None else b""
        try:
            w.handle = self._prepped_xfer(peer_id, batch, notif)
            if w.handle is None:
                src = np.asarray(batch.src_addrs, dtype=np.uint64)  # [n]
                dst = np.asarray(batch.dst_addrs, dtype=np.uint64)
                lengths = np.asarray(batch.lengths, dtype=np.uint64)
                src_mem, src_dev = parse_device(batch.src_device)
                dst_mem, dst_dev = parse_device(batch.dst_device)
                w.handle = self.agent.initialize_xfer(
                    "WRITE", self.agent.get_xfer_descs(_descs(src, lengths, src_dev), src_mem),
                    self.agent.get_xfer_descs(_descs(dst, lengths, dst_dev), dst_mem), peer_id,
                    notif)
        except Exception as e:
            w.failed = _error(e, f"write to {peer_id}")
        return w

    def _post(self, w: _NixlWrite) -> _NixlWrite:
        try:
            if self.agent.transfer(w.handle) == "ERR":
                w.failed = TransferError(ErrorKind.BACKEND, f"nixl transfer to {w.peer_id}: ERR")
        except Exception as e:
            w.failed = _error(e, f"write to {w.peer_id}")
        return w

    def _prepped_xfer(self, peer_id: str, batch: CopyBatch, notif: bytes) -> object | None:
        """A transfer from prepared lists if every entry is whole blocks of one prepared region
        pair; else None."""
        first = batch.src_addrs[0] if batch.src_addrs else None
        for p in self._prepared.get(peer_id, ()):
            if first is None or not p.src_base <= first < p.src_base + p.src_blocks * p.block_bytes:
                continue  # not this pair's memory (e.g. the aux slot vs the KV blocks)
            src_idx = coalesce.block_indices(batch.src_addrs, batch.lengths, p.src_base,
                                             p.block_bytes, p.src_blocks)
            if src_idx is None:
                continue
            dst_idx = coalesce.block_indices(batch.dst_addrs, batch.lengths, p.dst_base,
                                             p.block_bytes, p.dst_blocks)
            if dst_idx is None:
                continue
            handle = self.agent.make_prepped_xfer("WRITE", p.local, src_idx, p.remote, dst_idx,
                                                  notif)
            self.num_prepped_writes += 1
            return handle
        return None

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
        for dlist in self._local_lists.values():
            try:
                dlist.release()  # type: ignore[attr-defined]
            except Exception:  # noqa: BLE001
                pass
        self._local_lists.clear()
        for reg in self._regs:
            try:
                self.agent.deregister_memory(reg)
            except Exception:
                pass
        self._regs.clear()
