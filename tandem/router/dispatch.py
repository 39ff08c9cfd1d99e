"""The seam between the router and whatever runs the model: the `Dispatcher` protocol, the
values that cross it, and the errors it may raise.

Owns no state. Two implementations are meant to sit behind it:
- `ColocatedDispatcher` (colocated_node/dispatcher.py): prefill and decode in one engine per worker.
- `DisaggregatedDispatcher` (router/disagg.py): decode reserves pages for the request and answers with
  its KV destination; prefill gets the request plus that destination and pushes target KV,
  draft KV and the EAGLE seed over Mooncake/NIXL; workers are Ray actors. It receives the same
  `RoutedRequest` (the `room` is the transfer's bootstrap room, `placement` names both
  workers) and must keep the same contract.

Contract of `Dispatcher.submit(request)`:
1. It returns an async generator; the request starts on its first `__anext__`.
2. Chunks come in generation order; the last one has `finish_reason` set, then it ends.
3. Failures raise a `DispatchError` subclass: `WorkerUnavailable` (a worker died or is
   unreachable -- raised fast, never a hang), `DeadlineExceeded` (the request passed
   `request.deadline`; it was stopped on every worker), `CapacityExceeded`, `RequestRejected`,
   `RequestFailed` (this request's own work failed on a worker -- e.g. its sampling raised --
   and the worker serves on: a colocated engine's FinishReason.ERROR, a decode worker's
   `DecodeOutput` with error_kind "request", a prefill worker's `PrefillResult` with
   error_kind "request").
4. Closing the generator before its last chunk (`aclose()`, or the consumer task cancelled)
   aborts the request on every worker; its pages return to the pools once no transfer can
   still write into them.
5. `abort(request_id)` ends the request's stream with `FinishReason.ABORT`; it is valid from the
   stream's first `__anext__` on (a dispatcher still placing the request must remember it).
6. Worker state reported by `workers()` is how the router learns of deaths between requests:
   a worker that died is reported `healthy=False` (or left out), promptly.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Protocol, runtime_checkable

from tandem.messages import FinishReason, SamplingParams, TokenLogprob, TransferTotals


class WorkerRole(str, Enum):
    PREFILL = "prefill"
    DECODE = "decode"
    COLOCATED = "colocated"  # prefill and decode in one engine

    @property
    def can_prefill(self) -> bool:
        return self is not WorkerRole.DECODE

    @property
    def can_decode(self) -> bool:
        return self is not WorkerRole.PREFILL


@dataclass(frozen=True, slots=True, kw_only=True)
class WorkerInfo:
    """A worker as its dispatcher last saw it."""

    name: str
    role: WorkerRole
    model: str
    healthy: bool = True
    error: str = ""  # why it is unhealthy
    address: str = ""  # where it runs (Ray actor id, host:port); "" in-process
    num_running: int = 0
    num_waiting: int = 0
    num_free_pages: int = 0
    num_pages: int = 0
    speculative: bool = False
    health_p50_ms: float = 0.0  # round trips of its recent health answers (0: unknown)
    health_p99_ms: float = 0.0

    @property
    def kv_load(self) -> float:
        """Fraction of KV pages in use (1.0 when the worker reports no pool)."""
        return 1.0 - self.num_free_pages / self.num_pages if self.num_pages else 1.0


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelInfo:
    """What the router needs to validate a request for one served model."""

    name: str
    vocab_size: int  # token ids must be in [0, vocab_size)
    max_model_len: int  # prompt + new tokens, at most
    max_request_tokens: int  # KV slots one request may hold on the smallest decode pool


@dataclass(frozen=True, slots=True, kw_only=True)
class Placement:
    prefill_worker: str
    decode_worker: str  # == prefill_worker on a colocated worker


@dataclass(frozen=True, slots=True, kw_only=True)
class RoutedRequest:
    """A validated, tokenized, placed request: everything a dispatcher needs."""

    request_id: str
    room: int  # 64-bit, unique among in-flight requests (the KV transfer's bootstrap room)
    model: str
    prompt_ids: tuple[int, ...]
    params: SamplingParams  # validated; max_new_tokens fits the context and the KV pool
    placement: Placement
    deadline: float | None  # time.time() seconds (wall clock: workers may be other hosts)
    # The request's span (its W3C traceparent, tandem/otel.py) that the dispatcher's spans go
    # under; "" when the request is not traced
    traceparent: str = ""


@dataclass(frozen=True, slots=True, kw_only=True)
class SpecAcceptance:
    mean_acceptance_length: float  # tokens committed per round (accepted drafts + 1)
    per_position: tuple[float, ...]  # [j] = P(draft j+1 accepted)
    num_rounds: int


@dataclass(frozen=True, slots=True, kw_only=True)
class TokenChunk:
    request_id: str
    token_ids: tuple[int, ...]
    text_delta: str
    finish_reason: FinishReason | None = None  # set on the last chunk only
    # [len(token_ids)] when the request asks (params.logprobs), else ()
    logprobs: tuple[TokenLogprob, ...] = ()
    spec: SpecAcceptance | None = None  # last chunk only, when the decode worker speculates
    # Last chunk only: seconds the request waited for its turn (a running slot, decode pages;
    # colocated: the engine's queue); None when not known
    queue_s: float | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True, slots=True, kw_only=True)
class SpecCounts:
    """Speculative rounds of one worker (cumulative). A round commits accepted drafts + 1."""

    num_rounds: int = 0  # request-rounds verified
    num_tokens: int = 0  # tokens those rounds committed
    accepted_at: tuple[int, ...] = ()  # [j] rounds that accepted draft j+1 (and every before)

    def __add__(self, other: SpecCounts) -> SpecCounts:
        width = max(len(self.accepted_at), len(other.accepted_at))
        mine = self.accepted_at + (0,) * (width - len(self.accepted_at))
        theirs = other.accepted_at + (0,) * (width - len(other.accepted_at))
        return SpecCounts(num_rounds=self.num_rounds + other.num_rounds,
                          num_tokens=self.num_tokens + other.num_tokens,
                          accepted_at=tuple(a + b for a, b in zip(mine, theirs)))

    @staticmethod
    def from_means(mean_acceptance_length: float, per_position: tuple[float, ...],
                   num_rounds: int) -> SpecCounts:
        """The counts behind the means a worker reports (`WorkerHealth`, the engine loop's
        acceptance snapshot): tokens = mean * rounds, accepted_at[j] = P(draft j+1) * rounds.
        Exact: each mean is an integer count divided by `num_rounds` in float64, whose relative
        error (2^-53) times a count below 2^51 stays under 0.5, so rounding gives the count."""
        return SpecCounts(num_rounds=num_rounds,
                          num_tokens=round(mean_acceptance_length * num_rounds),
                          accepted_at=tuple(round(p * num_rounds) for p in per_position))


@dataclass(frozen=True, slots=True, kw_only=True)
class WorkerCounts:
    """The cumulative counters of one worker process, or of several added up."""

    spec: SpecCounts = SpecCounts()
    transfer: TransferTotals | None = None  # None: no transfer endpoint (colocated)

    def __add__(self, other: WorkerCounts) -> WorkerCounts:
        transfer = (other.transfer if self.transfer is None
                    else self.transfer if other.transfer is None
                    else self.transfer + other.transfer)
        return WorkerCounts(spec=self.spec + other.spec, transfer=transfer)


@dataclass(frozen=True, slots=True, kw_only=True)
class WorkerTotals:
    """One worker as the metrics show it: its state now, and counters that never go back."""

    name: str
    role: WorkerRole
    healthy: bool
    num_free_pages: int
    num_pages: int
    num_restarts: int  # restarts the router noticed (new incarnations)
    counts: WorkerCounts


@dataclass(frozen=True, slots=True, kw_only=True)
class DispatcherStats:
    spec: SpecAcceptance | None  # over all requests of all speculative workers
    num_running: int = 0  # requests being served now (disaggregated: holding a running slot)
    num_waiting: int = 0  # requests waiting for their turn (a slot, or decode pages)
    workers: tuple[WorkerTotals, ...] = ()  # every worker, for the metrics


def acceptance_from_rounds(rounds: Sequence[int], num_steps: int) -> SpecAcceptance:
    """A request's acceptance stats from its speculative rounds (tokens each committed:
    accepted drafts + 1)."""
    n = len(rounds)
    return SpecAcceptance(
        mean_acceptance_length=sum(rounds) / n if n else 0.0,
        per_position=tuple(sum(r - 1 >= j + 1 for r in rounds) / n if n else 0.0
                           for j in range(num_steps)),
        num_rounds=n)


class DispatchError(Exception):
    """Base of the errors a dispatcher raises; the message is shown to the client."""


class WorkerUnavailable(DispatchError):
    def __init__(self, worker: str, message: str) -> None:
        super().__init__(message)
        self.worker = worker


class TransferFailed(DispatchError):
    """This request's KV transfer failed or timed out (the message names the side that failed).
    It fails this request only: the workers are judged by their own health, not by it."""

    def __init__(self, side: str, message: str) -> None:
        super().__init__(message)
        self.side = side  # the worker whose side failed


class RequestRejected(DispatchError):
    """The worker refused the request's content; the message names the field."""


class CapacityExceeded(DispatchError):
    """The request can never fit (e.g. its KV cache exceeds the pool)."""


class DeadlineExceeded(DispatchError):
    pass


class RequestFailed(DispatchError):
    """This request's own work failed on a worker (its sampling, stop checks or detokenizer
    raised); the worker ended it, returned its pages and serves the others on. `cause` is the
    worker's error; with `request_id` the message names the request too (pass it)."""

    def __init__(self, cause: str, request_id: str = "") -> None:
        super().__init__(f"request '{request_id}' failed on the worker: {cause}" if request_id
                         else cause)
        self.request_id, self.cause = request_id, cause


@runtime_checkable
class Dispatcher(Protocol):
    def models(self) -> Sequence[ModelInfo]:
        """The models served (fixed for the dispatcher's lifetime)."""
        ...

    def workers(self) -> Sequence[WorkerInfo]:
        """A fresh snapshot of every worker, healthy or not. Cheap: called per placement."""
        ...

    def submit(self, request: RoutedRequest) -> AsyncGenerator[TokenChunk, None]:
        """Run the request on `request.placement`; see the module docstring for the contract."""
        ...

    async def abort(self, request_id: str) -> bool:
        """Stop an in-flight request; False if the dispatcher does not know it."""
        ...

    def stats(self) -> DispatcherStats: ...

    async def close(self) -> None:
        """Stop every worker; in-flight requests end with WorkerUnavailable."""
        ...
