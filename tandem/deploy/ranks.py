"""The ranks of one worker: how a prefill or decode worker of `tp` ranks joins torch.distributed,
and the control channel its ranks agree through.

A worker of `tp` ranks is SPMD: every rank holds a full copy of the worker's bookkeeping
(scheduler, page allocator, request table) and runs the same deterministic code on the same
inputs, so every rank takes the same decisions and issues the same collectives in the same
order. Two kinds of input could make ranks differ, and both go through `RankSync`:
  - calls from outside (reserve, submit, abort, ...) reach rank 0 only; `GroupLoop` broadcasts
    them so every rank applies them at the same point between two steps;
  - transfer events (a rank's KV landed, a rank's send failed) happen per rank at different
    times; the workers all-gather each step's local events and act on the joint view only.

Model collectives (TP/EP all-reduce, all-gather) use the model group: gloo on CPU, NCCL on GPU.
The control channel always uses a separate gloo group (Python objects, never on the GPU).
"""

from __future__ import annotations

import json
import socket
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Protocol, TypeVar

from tandem.engine.parallel import ParallelContext, ParallelGroup

T = TypeVar("T")


class RankSync(Protocol):
    """Collectives over Python objects among the ranks of one worker."""

    rank: int
    size: int

    def all_gather(self, obj: T) -> list[T]:
        """Every rank's `obj`, in rank order (every rank gets the same list)."""

    def broadcast(self, obj: T) -> T:
        """Rank 0's `obj` on every rank (others pass anything)."""


class SoloSync:
    """The trivial channel of a single-rank worker: no communication at all."""

    rank, size = 0, 1

    def all_gather(self, obj: T) -> list[T]:
        return [obj]

    def broadcast(self, obj: T) -> T:
        return obj


SOLO = SoloSync()


class TorchSync:
    """RankSync over a gloo process group (Python objects are pickled)."""

    def __init__(self, rank: int, size: int, handle: Any) -> None:
        self.rank, self.size, self._handle = rank, size, handle

    def all_gather(self, obj: T) -> list[T]:
        import torch.distributed as dist

        out: list[Any] = [None] * self.size
        dist.all_gather_object(out, obj, group=self._handle)
        return out

    def broadcast(self, obj: T) -> T:
        import torch.distributed as dist

        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self._handle)
        return box[0]


@dataclass(frozen=True, slots=True, kw_only=True)
class RankInfo:
    """Where one rank sits in its worker: `rank` of `tp`; experts split over `ep` (1 or tp)."""

    rank: int = 0
    tp: int = 1
    ep: int = 1

    def __post_init__(self) -> None:
        if self.tp < 1:
            raise ValueError(f"tp: must be >= 1, got {self.tp}")
        if self.ep not in (1, self.tp):
            raise ValueError(f"ep: must be 1 or equal to tp ({self.tp}), got {self.ep}")
        if not 0 <= self.rank < self.tp:
            raise ValueError(f"rank: {self.rank} outside [0, {self.tp})")


def rendezvous_address() -> tuple[str, int]:
    """This host's address and a free port, for rank 0 to host the process group."""
    try:
        import ray

        host = ray.util.get_node_ip_address() if ray.is_initialized() else "127.0.0.1"
    except ImportError:
        host = "127.0.0.1"
    with socket.socket() as s:
        s.bind(("", 0))
        return host, s.getsockname()[1]


def join_group(info: RankInfo, host: str, port: int, device: str,
               timeout_s: float = 120.0) -> tuple[ParallelContext, RankSync]:
    """Join the worker's process group (blocks until every rank joined). Returns the layers'
    ParallelContext and the control channel. `timeout_s` bounds every collective: a rank that
    died makes the others fail after it, never hang forever."""
    import torch
    import torch.distributed as dist

    if info.tp == 1:
        return ParallelContext(), SOLO
    backend = "nccl" if device.startswith("cuda") else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(torch.device(device).index or 0)  # Ray shows each rank one GPU
    dist.init_process_group(backend, init_method=f"tcp://{host}:{port}", rank=info.rank,
                            world_size=info.tp, timeout=timedelta(seconds=timeout_s))
    control = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
    tp = ParallelGroup(rank=info.rank, size=info.tp, handle=dist.group.WORLD)
    par = ParallelContext(tp=tp, ep=tp if info.ep > 1 else ParallelGroup())
    return par, TorchSync(info.rank, info.tp, control)


def leave_group() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


# ---- per-rank values that cross the router as one opaque blob ------------------------------


def encode_per_rank(parts: list[bytes]) -> bytes:
    """One blob holding each rank's bytes (each an encoded EndpointInfo or Destination, JSON)."""
    return json.dumps([p.decode() for p in parts]).encode()


def decode_per_rank(blob: bytes, size: int, what: str) -> list[bytes]:
    parts = [p.encode() for p in json.loads(blob)]
    if len(parts) != size:
        raise ValueError(f"{what}: the peer worker has {len(parts)} TP ranks, this one has "
                         f"{size}: KV transfer needs equal TP sizes on prefill and decode "
                         "(head re-slicing is not implemented)")
    return parts


@dataclass(frozen=True, slots=True)
class PerRank:
    """A call argument that differs per rank: rank r receives `values[r]`."""

    values: tuple[Any, ...]
