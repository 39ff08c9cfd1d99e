"""The seam between the load generator (driver.py) and the APIs it speaks: `DriverConfig`, what
every client is given, and `Client`, what every client does. The clients (grpc_client.py,
http_client.py) and the driver import this module, never each other's."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, TypeVar

from tandem.bench.metrics import RequestRecord
from tandem.bench.target import Target
from tandem.bench.workload import BenchRequest

READY_TIMEOUT_S = 60.0  # how long a client waits for the server to answer at all


@dataclass(frozen=True, slots=True, kw_only=True)
class DriverConfig:
    target: Target
    auth_token: str | None = None  # sent as `authorization: Bearer <token>`
    model: str = ""  # empty: the served model
    temperature: float = 0.0
    request_timeout_s: float = 600.0  # each request's deadline
    seed: int = 0  # Poisson arrivals
    progress: bool = True  # a tqdm bar per level


Wire = TypeVar("Wire")  # a request as one client sends it (a proto, a JSON body)


class Client(Protocol[Wire]):
    """One API's way of sending a request. `prepare` runs before the level starts, so that
    building messages stays out of the measured time; `send` returns the request's record and
    never raises for a failed request (the failure is the record's `error`, which starts with
    the gRPC status name the report counts it under, e.g. "UNAVAILABLE: ...")."""

    def prepare(self, req: BenchRequest) -> Wire: ...

    async def send(self, wire: Wire, t_level: float) -> RequestRecord: ...
