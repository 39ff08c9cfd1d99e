"""The ranks of one worker: how a prefill or decode worker of `tp` ranks (or a decode worker of
`dp` DP-attention ranks) joins torch.distributed, and the control channel its ranks agree through.

A worker of `tp` ranks is SPMD: every rank holds a full copy of the worker's bookkeeping
(scheduler, page allocator, request table) and runs the same deterministic code on the same
inputs, so every rank takes the same decisions and issues the same collectives in the same
order. Two kinds of input could make ranks differ, and both go through `RankSync`:
  - calls from outside (reserve, submit, abort, ...) reach rank 0 only; `GroupLoop` broadcasts
    them so every rank applies them at the same point between two steps;
  - transfer events (a rank's KV landed, a rank's send failed) happen per rank at different
    times; the workers all-gather each step's local events and act on the joint view only.

With DP attention (decode only, `dp` ranks, each a TP group of `tp` ranks; world rank =
DP rank * tp + TP rank) the DP ranks hold *different* requests: the calls still reach every
rank, but a reserve is taken by one DP rank (the least loaded, chosen from an all-gather of
every DP rank's load, see decode_node/worker.py), and each step's outputs are all-gathered so
rank 0 can stream every DP rank's tokens. The TP ranks of a DP rank agree on transfer events
among themselves, as the ranks of a TP worker do (`split_sync`).

Model collectives (TP/EP all-reduce, all-gather) use the model group: gloo on CPU, NCCL on GPU.
The control channel always uses a separate gloo group (Python objects, never on the GPU).
"""

from __future__ import annotations

import json
import logging
import socket
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Protocol, TypeVar

from tandem.engine.parallel import ParallelContext, ParallelGroup

log = logging.getLogger(__name__)
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
    """RankSync over a gloo process group (Python objects are pickled). `tp_sync`: under DP
    attention with tp > 1, the channel among this rank's TP group (None otherwise)."""

    def __init__(self, rank: int, size: int, handle: Any,
                 tp_sync: TorchSync | None = None) -> None:
        self.rank, self.size, self._handle = rank, size, handle
        self.tp_sync = tp_sync

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


class DpLeadSync:
    """The DP ranks' channel under DP x TP: one voice per DP rank over the worker's channel
    (every rank calls it; the list keeps each DP rank's TP lead's object). Sound because the
    TP ranks of one DP rank run the same bookkeeping on the same inputs: they pass equal
    objects. `broadcast` is the worker channel's (rank 0 is DP rank 0's lead)."""

    def __init__(self, world: RankSync, tp: int) -> None:
        self._world, self._tp = world, tp
        self.rank, self.size = world.rank // tp, world.size // tp

    def all_gather(self, obj: T) -> list[T]:
        return self._world.all_gather(obj)[:: self._tp]

    def broadcast(self, obj: T) -> T:
        return self._world.broadcast(obj)


def split_sync(sync: RankSync, par: ParallelContext) -> tuple[RankSync, RankSync]:
    """(tp, dp) channels of a decode rank: `tp` among the ranks that share its requests (they
    agree on transfer events), `dp` among the DP ranks that split the requests (reserve bids,
    step reports), each SOLO where the worker has no such ranks."""
    if par.dp.size == 1:
        return sync, SOLO
    if par.tp.size == 1:
        return SOLO, sync
    if not isinstance(sync, TorchSync) or sync.tp_sync is None:
        raise ValueError("sync: DP x TP needs the worker channel join_group builds (with its "
                         "TP part)")
    return sync.tp_sync, DpLeadSync(sync, par.tp.size)


@dataclass(frozen=True, slots=True, kw_only=True)
class RankInfo:
    """Where one rank sits in its worker: `rank` of `world_size` = tp * dp, DP-major (DP rank
    `rank // tp`, TP rank `rank % tp`); experts split over `ep` (1, or every rank)."""

    rank: int = 0
    tp: int = 1
    ep: int = 1
    dp: int = 1

    def __post_init__(self) -> None:
        if self.tp < 1 or self.dp < 1:
            raise ValueError(f"tp/dp: must be >= 1, got tp={self.tp} dp={self.dp}")
        if self.ep not in (1, self.world_size):
            raise ValueError(f"ep: must be 1 or equal to tp ({self.world_size}), got {self.ep}")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank: {self.rank} outside [0, {self.world_size})")

    @property
    def world_size(self) -> int:
        return self.tp * self.dp


def rendezvous_address() -> tuple[str, int]:
    """This host's address and a free port, for rank 0 to host the process group: the address
    the node's KV endpoints advertise (`serving_host`: 127.0.0.1 for a local Ray instance, else
    the node's IP; a worker's ranks share a node)."""
    from tandem.worker.process import serving_host

    host = serving_host()
    with socket.socket() as s:
        s.bind((host, 0))
        return host, s.getsockname()[1]


def join_group(info: RankInfo, host: str, port: int, device: str,
               timeout_s: float = 120.0) -> tuple[ParallelContext, RankSync]:
    """Join the worker's process group (blocks until every rank joined). Returns the layers'
    ParallelContext and the control channel. `timeout_s` bounds every collective: a rank that
    died makes the others fail after it, never hang forever."""
    import torch
    import torch.distributed as dist

    world = info.world_size
    if world == 1:
        return ParallelContext(), SOLO
    backend = "nccl" if device.startswith("cuda") else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(torch.device(device).index or 0)  # Ray shows each rank one GPU
    from tandem.kvtransfer.bind import listeners_on

    # Rank 0's store (c10d's TCPStore binds the wildcard address) listens on `host` only where
    # the bind() shim is preloaded (Ray workers: kvtransfer/bindshim.py).
    with listeners_on(host):
        dist.init_process_group(backend, init_method=f"tcp://{host}:{port}", rank=info.rank,
                                world_size=world, timeout=timedelta(seconds=timeout_s))
    control = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
    group = ParallelGroup(rank=info.rank, size=world, handle=dist.group.WORLD)
    ep = group if info.ep > 1 else ParallelGroup()
    if info.dp == 1:
        par = ParallelContext(tp=group, ep=ep)
    else:  # DP attention: attention per DP rank (over its TP group), the MLP over every rank
        par = ParallelContext(tp=_tp_subgroup(info, timeout_s), dp=group, ep=ep)
    tp_sync = None
    if info.dp > 1 and info.tp > 1:
        tp_sync = TorchSync(info.rank % info.tp, info.tp,
                            _tp_subgroup(info, timeout_s, backend="gloo").handle)
    return par, TorchSync(info.rank, world, control, tp_sync)


def _tp_subgroup(info: RankInfo, timeout_s: float, backend: str | None = None) -> ParallelGroup:
    """This rank's TP group inside its DP rank (ranks dp_rank*tp .. +tp), on the model's
    backend or `backend`. Every rank creates every DP rank's subgroup, in DP order:
    torch.distributed requires all ranks to call new_group for each group, members or not."""
    if info.tp == 1:
        return ParallelGroup()
    import torch.distributed as dist

    mine = None
    for d in range(info.dp):
        handle = dist.new_group(list(range(d * info.tp, (d + 1) * info.tp)),
                                timeout=timedelta(seconds=timeout_s), backend=backend)
        if d == info.rank // info.tp:
            mine = handle
    return ParallelGroup(rank=info.rank % info.tp, size=info.tp, handle=mine)


def leave_group(timeout_s: float = 10.0) -> bool:
    """Tear down the worker's process groups, waiting at most `timeout_s`. Returns whether the
    teardown finished. It may not: ncclCommDestroy hangs on a communicator whose collectives a
    CUDA graph captured (pytorch#115388; TP decode graphs do), so it runs on a daemon thread
    and a shutdown goes on without it (the process is about to end)."""
    import threading

    import torch.distributed as dist

    if not dist.is_initialized():
        return True
    done = threading.Thread(target=dist.destroy_process_group, name="leave-group", daemon=True)
    done.start()
    done.join(timeout_s)
    if done.is_alive():
        log.warning("leave_group: the process group teardown did not finish in %.0f s "
                    "(NCCL communicators captured in CUDA graphs); going on without it",
                    timeout_s)
        return False
    return True


# ---- per-rank values that cross the router as one opaque blob ------------------------------


def encode_per_rank(parts: list[bytes]) -> bytes:
    """One blob holding each rank's bytes (each an encoded EndpointInfo or Destination, JSON)."""
    return json.dumps([p.decode() for p in parts]).encode()


def decode_per_rank(blob: bytes, size: int, what: str) -> list[bytes]:
    """The `size` per-rank parts of `blob` (ValueError when it holds another number)."""
    parts = [p.encode() for p in json.loads(blob)]
    if len(parts) != size:
        raise ValueError(f"{what}: the blob holds {len(parts)} ranks, expected {size}")
    return parts


def encode_dp_destination(dp_rank: int, parts: list[bytes]) -> bytes:
    """A decode worker with DP attention: the Destination(s) of the one DP rank that took the
    request (its tp ranks' parts), tagged with that rank."""
    return json.dumps({"dp_rank": dp_rank, "ranks": [p.decode() for p in parts]}).encode()


@dataclass(frozen=True, slots=True)
class PrefillRoute:
    """Where one prefill rank pushes a request: (decode endpoint, destination) per decode rank
    it feeds, decode-rank order. Empty: a rank whose KV heads lower ranks already send."""

    endpoints: tuple[bytes, ...]  # encoded EndpointInfo, one per decode rank fed
    destinations: tuple[bytes, ...]  # encoded Destination, same order


def route_to_decode(decode_endpoint: bytes, destination: bytes, tp: int) -> list[PrefillRoute]:
    """What each of the prefill worker's `tp` ranks pushes to (one route per prefill rank).

    The request's decode ranks: every rank of the endpoint blob, or with DP attention the tp
    ranks of the DP rank its destination names (the endpoint blob lists every rank, DP-major).
    Equal TP sizes: prefill rank r feeds decode rank r. Different sizes: the KV heads re-slice
    (kvtransfer/reslice.py), the model's head count read from the decode endpoints' CompatInfo;
    ValueError naming `prefill.tp` / `decode.tp` when they cannot."""
    raw = json.loads(destination)
    endpoints = [p.encode() for p in json.loads(decode_endpoint)]
    if isinstance(raw, dict):  # DP: the slice of endpoints of the DP rank that took it
        dests = [p.encode() for p in raw["ranks"]]
        start = int(raw["dp_rank"]) * len(dests)
        if not 0 <= start < len(endpoints) or start + len(dests) > len(endpoints):
            raise ValueError(f"destination: DP rank {raw['dp_rank']} is not among the decode "
                             f"worker's {len(endpoints)} ranks")
        endpoints = endpoints[start : start + len(dests)]
    else:
        dests = decode_per_rank(destination, len(endpoints), "destination")
    if len(dests) == tp:  # rank r to rank r: every head, whole pages
        return [PrefillRoute(endpoints=(e,), destinations=(d,)) for e, d in zip(endpoints, dests)]
    from tandem.kvtransfer import EndpointInfo
    from tandem.kvtransfer.reslice import reslice_problem, slices_from_prefill

    num_kv_heads = EndpointInfo.decode(endpoints[0]).compat.num_kv_heads
    why = (reslice_problem(num_kv_heads, tp, len(dests)) if num_kv_heads
           else "the decode endpoints do not state num_kv_heads")
    if why:
        raise ValueError(f"{why} (prefill.tp {tp}, decode.tp {len(dests)}: KV heads cannot "
                         "re-slice)")
    return [PrefillRoute(
        endpoints=tuple(endpoints[s.decode_rank] for s in pieces),
        destinations=tuple(dests[s.decode_rank] for s in pieces))
        for pieces in (slices_from_prefill(p, tp, len(dests), num_kv_heads) for p in range(tp))]
