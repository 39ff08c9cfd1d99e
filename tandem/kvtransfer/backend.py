"""The `TransferBackend` Protocol every library adapter implements, and the registry that creates
one by name with a lazy import (CPU code paths never import mooncake/nixl at module import time).

A backend only moves bytes and strings: one-sided writes of `CopyBatch`es into a connected peer's
registered memory, and ordered ASCII control messages. Everything about rooms, states, deadlines,
leases and checks lives above it (sender.py / receiver.py) and is shared by all backends, so the
contract tests exercise the same logic over each library.
"""

from __future__ import annotations

import enum
import importlib
from dataclasses import dataclass, field
from typing import Protocol

from tandem.kvtransfer.bind import default_host
from tandem.kvtransfer.contract import ErrorKind, TransferError
from tandem.kvtransfer.layout import CopyBatch


class WriteStatus(enum.Enum):
    PENDING = "pending"
    DONE = "done"
    FAILED = "failed"


@dataclass(frozen=True, slots=True)
class WritePoll:
    status: WriteStatus
    error: TransferError | None = None  # set iff FAILED


@dataclass(frozen=True, slots=True)
class PeerEvent:
    """An inbound control message, or (message None) the news that `peer_id` is unreachable."""

    peer_id: str
    message: str | None
    error: TransferError | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class BackendOptions:
    # Address peers reach this endpoint at, and the only one its listeners accept (bind.py):
    # $TANDEM_KV_HOST, else the Ray node IP inside an actor, else 127.0.0.1.
    host: str = field(default_factory=default_host)
    protocol: str = "tcp"  # Mooncake: "tcp" | "rdma"
    device_name: str = ""  # Mooncake: RDMA NIC filter ("" = auto)
    nixl_backends: tuple[str, ...] = ("UCX",)
    name_hint: str = "tandem"  # prefix of NIXL agent names (they must be unique)
    # NIXL's UCX progress thread. None = by role (endpoint.options_for_role): on for the decode
    # receiver, off for the prefill sender. Without it an agent's UCX moves only inside its own
    # NIXL calls: fine for the sender, which polls its writes while they fly, but a write into
    # host memory (the aux slot; anything over TCP/shared memory) completes at the sender only
    # when the TARGET progresses - measured on CPU: DONE 50 ms late while the target was busy
    # 50 ms, 0.2-0.3 ms with the target's thread on. Writes VRAM->VRAM over cuda_ipc/RDMA are
    # one-sided either way.
    nixl_progress_thread: bool | None = None
    fabric: object | None = None  # fake only: the in-process FakeFabric (None = default)


class TransferBackend(Protocol):
    """Optional extras a backend may have (the endpoints look them up with getattr):
    `max_batch_entries: int | None` (entries one post_write accepts; absent = 1024, None = no
    limit), `notify_per_write: bool` (a notification on every page write is cheap, so the
    sender posts the final write without waiting for the page writes; absent = False) and
    `prepare_regions(peer_id, [(local region, remote region), ...])` (KVRegions and the
    AuxRegions: `base_ptr`, `block_bytes`, `num_blocks`, `device`), called once per connected
    peer so that writes of whole blocks between those regions can be prepared ahead."""

    name: str  # registry name
    local_id: str  # how peers identify us in PeerEvent.peer_id

    def address(self) -> str:
        """ASCII connection info for peers. Call after every `register` (NIXL embeds them)."""

    def register(self, ptr: int, nbytes: int, device: str) -> None:
        """Expose [ptr, ptr + nbytes) on `device` ("cpu" | "cuda:N") for reads/writes."""

    def connect(self, address: str) -> str:
        """Make `address` writable/messageable; return its peer id."""

    def disconnect(self, peer_id: str) -> None:
        """Fence: tear down the connection so that (where the library allows) no write between
        us and the peer can still land. Idempotent."""

    def post_write(self, peer_id: str, batch: CopyBatch, notify: str | None) -> object:
        """Start one-sided writes; `notify` (if any) reaches the peer after all bytes landed.
        Never blocks on the network. Returns an opaque handle for poll_write / cancel_write."""

    def poll_write(self, handle: object) -> WritePoll:
        """Non-blocking. After DONE/FAILED is returned the handle is dead: never poll it again."""

    def cancel_write(self, handle: object) -> bool:
        """Try to stop a PENDING write; True iff no byte of it can land afterwards."""

    def send_message(self, peer_id: str, message: str) -> None:
        """Queue a control message (ordered per peer). Failures surface as PeerEvents."""

    def poll_events(self) -> list[PeerEvent]: ...

    def close(self) -> None: ...


_REGISTRY: dict[str, str] = {
    "fake": "tandem.kvtransfer.backends.fake:FakeBackend",
    "mooncake": "tandem.kvtransfer.backends.mooncake:MooncakeBackend",
    "nixl": "tandem.kvtransfer.backends.nixl:NixlBackend",
}


def register_backend(name: str, target: str) -> None:
    """Add a backend as "package.module:Class"; the class takes (options: BackendOptions)."""
    _REGISTRY[name] = target


def backend_names() -> tuple[str, ...]:
    return tuple(sorted(_REGISTRY))


def create_backend(name: str, options: BackendOptions | None = None) -> TransferBackend:
    if name not in _REGISTRY:
        raise ValueError(f"backend: unknown {name!r}; registered: {backend_names()}")
    module_name, _, cls_name = _REGISTRY[name].partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:  # the library is not installed on this machine
        raise TransferError(ErrorKind.BACKEND, f"backend {name!r} unavailable: {e}") from e
    return getattr(module, cls_name)(options or BackendOptions())
