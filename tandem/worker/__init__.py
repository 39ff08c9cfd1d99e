"""The worker kit: what every serving node (prefill_node, decode_node) stands on, and what the
Ray actors of deploy/ drive them with.

- `WorkerConfig` and the pieces every node builds alike (engine, seed buffer, KV layout,
  CompatInfo): config.py;
- the loop that owns a worker's thread (`WorkerLoop`, one rank) and its SPMD counterpart for the
  ranks of a TP/DP worker (`GroupLoop`): loop.py, group_loop.py;
- how the ranks of one worker join and agree (`RankInfo`, `RankSync`, `join_group`), and the
  per-rank values that cross the router as one blob (`encode_per_rank`, `route_to_decode`):
  ranks.py;
- the worker side of the router-worker event stream (`EventChannels`): channels.py;
- the process a worker runs in (`tune_process`, `node_ip`): process.py;
- what a worker's Ray actor is made of, without Ray (`WorkerFront`: the worker, its loop, the
  event channels): front.py;
- the OpenTelemetry spans of a worker's traced requests, phase by phase (`RoomSpans`):
  spans.py.

The kit imports no node and no deploy module: nodes depend on it, never the other way round.
"""

from tandem.worker.channels import EventChannels
from tandem.worker.config import (
    TRANSFER_BACKENDS,
    WorkerConfig,
    aux_buffer,
    build_engine,
    compat_info,
    kv_layout,
)
from tandem.worker.front import WorkerFront
from tandem.worker.group_loop import CommandedWorker, GroupLoop
from tandem.worker.loop import SteppedWorker, WorkerLoop
from tandem.worker.process import QUIET_ENV, in_ray_actor, node_id, node_ip, tune_process
from tandem.worker.ranks import (
    SOLO,
    PrefillRoute,
    RankInfo,
    RankSync,
    SoloSync,
    TorchSync,
    decode_per_rank,
    encode_dp_destination,
    encode_per_rank,
    join_group,
    leave_group,
    rendezvous_address,
    route_to_decode,
    split_sync,
)
from tandem.worker.spans import RoomSpans

__all__ = [
    "QUIET_ENV", "SOLO", "TRANSFER_BACKENDS", "CommandedWorker", "EventChannels", "GroupLoop",
    "PrefillRoute", "RankInfo", "RankSync", "RoomSpans", "SoloSync", "SteppedWorker", "TorchSync",
    "WorkerConfig", "WorkerFront", "WorkerLoop", "aux_buffer", "build_engine", "compat_info",
    "decode_per_rank", "encode_dp_destination", "encode_per_rank", "in_ray_actor",
    "join_group", "kv_layout", "leave_group", "node_id", "node_ip", "rendezvous_address",
    "route_to_decode", "split_sync", "tune_process",
]
