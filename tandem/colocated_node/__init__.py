"""The colocated node: prefill and decode in one engine per worker, no KV transfer.

- `ColocatedDispatcher` (dispatcher.py): the router's `Dispatcher` over engines run by
  `EngineLoop`s in the router's own process;
- `build_colocated_router`, `ColocatedServer` (server.py): one engine behind its router and
  gRPC server (`tandem serve` without a deployment config; `tandem bench`'s colocated runs).

It stands on the router (the `Dispatcher` protocol and its request values), the engine and the
speculative engine; the router never imports it (the router loads no torch).
"""

from tandem.colocated_node.dispatcher import ColocatedDispatcher, ColocatedWorker, model_info_of
from tandem.colocated_node.server import (
    ColocatedServer,
    ColocatedServerConfig,
    build_colocated_router,
)

__all__ = [
    "ColocatedDispatcher", "ColocatedServer", "ColocatedServerConfig", "ColocatedWorker",
    "build_colocated_router", "model_info_of",
]
