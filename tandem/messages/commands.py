"""Commands: what the router asks of a worker, and what a worker's front (rank 0) applies on every
rank of its worker. Frozen and picklable values, told apart by type where they are applied (the
worker actor's `command`, the worker's `apply`), never by a method name.

Two hops:
  router -> worker actor (one Ray call, `command`):
      `StartPrefill`, `Route`, `Abort` to a prefill worker; `Reserve`, `Abort` to a decode
      worker. Only `Reserve` answers (the KV destination blob); the rest of a request's story
      comes as events (events.py).
  worker actor -> its worker, on every rank between two steps (WorkerLoop / GroupLoop, whose
  broadcast carries them to the other ranks' processes):
      `GetEndpoint`, `Connect`, `SubmitPrompt`, `RoutePrompt`, `Abort` on a prefill worker;
      `GetEndpoint`, `ReserveRoom`, `Abort` on a decode worker. Each rank's result comes back.
A value that differs per rank travels as `PerRank`; rank r's worker reads `values[r]`.
A request's commands carry its W3C `traceparent` when it is traced (tandem/otel.py): the
router's dispatch span on the way to the actor, the actor's span of the request on the way to
its worker, so each process's spans hang under the one that sent the command.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tandem.messages.params import SamplingParams

# ---- router -> worker actor ------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class StartPrefill:
    """Prefill `room` now; its first token and its outcome come on `channel`'s events. Decode's
    destination follows by `Route`."""

    channel: str  # the router's event channel on this worker
    room: int
    prompt_ids: tuple[int, ...]
    params: SamplingParams
    traceparent: str = ""  # W3C trace context of the router's dispatch span ("": untraced)


@dataclass(frozen=True, slots=True, kw_only=True)
class Reserve:
    """Reserve pages and a seed slot for `room` on a decode worker; answers every rank's
    encoded Destination as one blob. Raises ValueError (bad request) or OutOfCapacity."""

    channel: str  # the router's event channel on this worker: the room's outputs go there
    room: int
    prompt_ids: tuple[int, ...]
    params: SamplingParams
    traceparent: str = ""  # W3C trace context of the router's dispatch span ("": untraced)


@dataclass(frozen=True, slots=True, kw_only=True)
class Route:
    """Decode's reserve answer for a prefilling room: where its KV goes."""

    room: int
    destination: bytes  # the decode worker's answer to `Reserve`
    decode_endpoint: bytes  # every decode rank's transfer endpoint, one blob


@dataclass(frozen=True, slots=True, kw_only=True)
class Abort:
    """End `room` wherever it is (also a worker-level command: the same on every rank)."""

    room: int


PrefillCommand = StartPrefill | Route | Abort
DecodeCommand = Reserve | Abort

# ---- worker actor -> every rank of its worker ------------------------------------------------


@dataclass(frozen=True, slots=True)
class PerRank:
    """A command field that differs per rank: rank r receives `values[r]`."""

    values: tuple[Any, ...]

    def __getitem__(self, rank: int) -> Any:
        return self.values[rank]


@dataclass(frozen=True, slots=True, kw_only=True)
class GetEndpoint:
    """This rank's transfer endpoint (an encoded EndpointInfo)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Connect:
    """Prefill: handshake with the decode endpoints this rank pushes to (idempotent)."""

    endpoints: PerRank  # per rank: tuple of encoded EndpointInfo


@dataclass(frozen=True, slots=True, kw_only=True)
class SubmitPrompt:
    """Prefill: start the prompt's forward. `destinations` None: decode's destination is not
    known yet (it comes by `RoutePrompt`)."""

    room: int
    prompt_ids: tuple[int, ...]
    params: SamplingParams
    destinations: PerRank | None  # per rank: tuple of encoded Destination (maybe empty)
    traceparent: str = ""  # the request's span on this worker ("": untraced)


@dataclass(frozen=True, slots=True, kw_only=True)
class RoutePrompt:
    """Prefill: where a room submitted without destinations goes (ignored once it ended)."""

    room: int
    destinations: PerRank  # per rank: tuple of encoded Destination (maybe empty)


@dataclass(frozen=True, slots=True, kw_only=True)
class ReserveRoom:
    """Decode: claim pages and a seed slot; each rank answers its encoded Destination (with DP
    attention: only the rank that took the room; None on the others)."""

    room: int
    prompt_ids: tuple[int, ...]
    params: SamplingParams
    traceparent: str = ""  # the request's span on this worker ("": untraced)


PrefillWorkerCommand = GetEndpoint | Connect | SubmitPrompt | RoutePrompt | Abort
DecodeWorkerCommand = GetEndpoint | ReserveRoom | Abort
