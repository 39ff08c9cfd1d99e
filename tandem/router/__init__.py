"""The router: the public gRPC service, validation and tokenization, placement policies, the
request lifecycle (request ids, rooms, streaming, abort, deadlines), and the worker registry.

Public API (other packages import only these names). The gRPC pieces (`RouterServer`,
`RouterServicer`) live in `tandem.router.server` / `tandem.router.servicer` and are not imported
here, so the logic can be used without loading grpc. The router imports no torch: the colocated
dispatcher, which holds engines in the router's process, is the colocated node's
(`tandem.colocated_node`).
"""


from tandem.router.dispatch import (
    CapacityExceeded,
    DeadlineExceeded,
    Dispatcher,
    DispatchError,
    DispatcherStats,
    ModelInfo,
    Placement,
    RequestFailed,
    RequestRejected,
    RoutedRequest,
    SpecAcceptance,
    TokenChunk,
    WorkerInfo,
    WorkerRole,
    WorkerUnavailable,
)
from tandem.router.errors import Code, RouterError
from tandem.router.policy import (
    POLICIES,
    LeastLoad,
    PlacementQuery,
    Policy,
    PowerOfTwo,
    PrefixCacheAware,
    RoundRobin,
    WorkerState,
    make_policy,
)
from tandem.router.registry import WorkerRegistry
from tandem.router.router import (
    GenerateOutput,
    Router,
    RouterConfig,
    RouterStats,
    Usage,
)
from tandem.router.validate import GenerateInput, SamplingInput

__all__ = [
    "POLICIES", "CapacityExceeded", "Code", "DeadlineExceeded", "DispatchError", "Dispatcher",
    "DispatcherStats", "GenerateInput", "GenerateOutput", "LeastLoad", "ModelInfo",
    "Placement", "PlacementQuery", "Policy", "PowerOfTwo", "PrefixCacheAware", "RequestFailed",
    "RequestRejected", "RoundRobin", "RoutedRequest", "Router", "RouterConfig", "RouterError",
    "RouterStats", "SamplingInput", "SpecAcceptance", "TokenChunk", "Usage", "WorkerInfo",
    "WorkerRegistry", "WorkerRole", "WorkerState", "WorkerUnavailable", "make_policy",
]

