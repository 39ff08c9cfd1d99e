"""`Router`: the request lifecycle behind the gRPC API, as plain async Python.

generate = validate + tokenize (once) -> request id and 64-bit room -> placement -> dispatch ->
stream -> account. Owns the table of requests in flight (request id -> room, placement), the
rooms in use and the counters; the `WorkerRegistry` owns worker health. The servicer only
converts protos to these values and back.

Ending a request early always reaches the workers: the router closes the dispatcher's stream
on every path out (client cancel, deadline, error), and the dispatcher's contract is that closing
an unfinished stream aborts the request on every worker and frees its pages.
"""

from __future__ import annotations

import asyncio
import logging
import math
import secrets
import time
import uuid
from collections.abc import AsyncIterator, Mapping
from contextlib import aclosing
from dataclasses import dataclass

from tandem.engine.request import FinishReason
from tandem.engine.tokenizer import Tokenizer
from tandem.router.dispatch import (
    DeadlineExceeded,
    Dispatcher,
    DispatchError,
    RoutedRequest,
    SpecAcceptance,
    TokenChunk,
    WorkerUnavailable,
)
from tandem.router.errors import Code, RouterError, from_dispatch_error
from tandem.router.placement import place
from tandem.router.policy import PlacementQuery, Policy, WorkerState, make_policy
from tandem.router.registry import WorkerRegistry
from tandem.router.validate import (
    GenerateInput,
    check_request_id,
    resolve_model,
    validate,
)

log = logging.getLogger(__name__)

OFFLOAD_CHARS = 32_768  # prompts longer than this are tokenized on a worker thread


@dataclass(frozen=True, slots=True, kw_only=True)
class RouterConfig:
    default_max_tokens: int = 128  # when the request sets none (capped by context and pool)
    max_request_s: float | None = None  # deadline for requests whose client sets none
    refresh_s: float = 0.5  # worker reports older than this are refreshed before placing
    quarantine_s: float = 5.0  # a worker seen failing gets no requests for this long
    prefill_policy: str = "least-load"
    decode_policy: str = "power-of-two"

    def __post_init__(self) -> None:
        if self.default_max_tokens <= 0:
            raise ValueError(f"default_max_tokens: must be > 0, got {self.default_max_tokens}")
        if self.max_request_s is not None and not self.max_request_s > 0:
            raise ValueError(f"max_request_s: must be > 0, got {self.max_request_s}")
        for name in ("refresh_s", "quarantine_s"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name}: must be >= 0, got {getattr(self, name)}")
        make_policy(self.prefill_policy, "prefill_policy")
        make_policy(self.decode_policy, "decode_policy")


@dataclass(frozen=True, slots=True, kw_only=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int


@dataclass(frozen=True, slots=True, kw_only=True)
class GenerateOutput:
    """One streamed message; the last has finish_reason and the final-only fields set."""

    request_id: str
    token_ids: tuple[int, ...]
    text_delta: str
    finish_reason: FinishReason | None = None
    usage: Usage | None = None
    ttft_s: float | None = None  # router receipt -> first token
    latency_s: float | None = None  # router receipt -> last token
    spec: SpecAcceptance | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class RouterStats:
    num_requests: int
    num_rejected: int
    num_in_flight: int
    num_finished: int
    num_aborted: int
    num_failed: int
    num_prompt_tokens: int
    num_completion_tokens: int
    workers: tuple[WorkerState, ...]
    spec: SpecAcceptance | None


@dataclass(slots=True)
class _Counters:
    requests: int = 0
    rejected: int = 0
    finished: int = 0
    aborted: int = 0
    failed: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0


class Router:
    def __init__(self, dispatcher: Dispatcher, tokenizers: Mapping[str, Tokenizer | None],
                 cfg: RouterConfig = RouterConfig(), *, prefill_policy: Policy | None = None,
                 decode_policy: Policy | None = None) -> None:
        self.dispatcher, self.cfg = dispatcher, cfg
        self._tokenizers = dict(tokenizers)
        self._models = tuple(dispatcher.models())
        self.registry = WorkerRegistry(dispatcher.workers, cfg.refresh_s, cfg.quarantine_s)
        self._prefill_policy = prefill_policy or make_policy(cfg.prefill_policy)
        self._decode_policy = decode_policy or make_policy(cfg.decode_policy)
        self._in_flight: dict[str, RoutedRequest] = {}
        self._rooms: set[int] = set()
        self._counters = _Counters()

    # ---- requests ---------------------------------------------------------------------------

    async def prepare(self, inp: GenerateInput, timeout_s: float | None = None) -> RoutedRequest:
        """Validate, tokenize and place; raises RouterError. Does not register the request."""
        check_request_id(inp.request_id)
        model = resolve_model(inp.model, self._models)
        args = (inp, model, self._tokenizers.get(model.name), self.cfg.default_max_tokens)
        if _num_chars(inp) > OFFLOAD_CHARS:  # keep the event loop streaming meanwhile
            valid = await asyncio.to_thread(validate, *args)
        else:
            valid = validate(*args)
        # From here to registration nothing awaits, so the id check cannot race.
        if inp.request_id and inp.request_id in self._in_flight:
            raise RouterError(Code.ALREADY_EXISTS,
                              f"request_id: '{inp.request_id}' is already in flight")
        self.registry.maybe_refresh()
        query = PlacementQuery(model=model.name, prompt_ids=valid.prompt_ids,
                               num_tokens=len(valid.prompt_ids) + valid.params.max_new_tokens)
        placement = place(self.registry, query, self._prefill_policy, self._decode_policy,
                          inp.prefill_worker, inp.decode_worker)
        budget = self._budget(timeout_s)
        return RoutedRequest(
            request_id=inp.request_id or uuid.uuid4().hex, room=self._new_room(),
            model=model.name, prompt_ids=valid.prompt_ids, params=valid.params,
            placement=placement, deadline=None if budget is None else time.time() + budget)

    async def generate(self, inp: GenerateInput, timeout_s: float | None = None
                       ) -> AsyncIterator[GenerateOutput]:
        """Stream a request's outputs. `timeout_s`: the client's remaining deadline. Raises
        RouterError (validation, placement, worker failure, DEADLINE_EXCEEDED); a cancelled
        consumer or `aclose()` stops the request on its workers."""
        t0 = time.perf_counter()
        try:
            req = await self.prepare(inp, timeout_s)
        except RouterError:
            self._counters.rejected += 1
            raise
        self._register(req)
        ttft_s: float | None = None
        num_tokens = 0
        outcome = "aborted"  # what ends the request if we leave early (cancel, close)
        try:
            async with aclosing(self.dispatcher.submit(req)) as stream:
                while True:
                    chunk = await self._next(stream, req)
                    if chunk is None:
                        raise RouterError(Code.INTERNAL, "dispatch: the stream ended without "
                                                         "a finish reason")
                    if ttft_s is None and chunk.token_ids:
                        ttft_s = time.perf_counter() - t0
                    num_tokens += len(chunk.token_ids)
                    if not chunk.finished:
                        yield GenerateOutput(request_id=req.request_id, token_ids=chunk.token_ids,
                                             text_delta=chunk.text_delta)
                        continue
                    outcome = "aborted" if chunk.finish_reason is FinishReason.ABORT else "finished"
                    yield self._final(req, chunk, num_tokens, ttft_s, t0)
                    return
        except RouterError as exc:
            outcome = "aborted" if exc.code is Code.DEADLINE_EXCEEDED else "failed"
            raise
        except Exception:
            outcome = "failed"
            raise
        finally:
            self._unregister(req, outcome, num_tokens)

    async def _next(self, stream: AsyncIterator[TokenChunk], req: RoutedRequest
                    ) -> TokenChunk | None:
        """The next chunk, None at the end; dispatch errors and the deadline as RouterError."""
        loop = asyncio.get_running_loop()
        when = None if req.deadline is None else loop.time() + (req.deadline - time.time())
        try:
            # Only the wait is under the timeout (never a yield): expiry cancels the dispatcher's
            # stream mid-wait, whose cleanup aborts the request on its workers.
            async with asyncio.timeout_at(when):
                return await anext(stream)
        except StopAsyncIteration:
            return None
        except TimeoutError:
            raise RouterError(Code.DEADLINE_EXCEEDED, f"deadline: request '{req.request_id}' "
                                                      "ran past its deadline; generation stopped"
                              ) from None
        except DeadlineExceeded as exc:
            raise from_dispatch_error(exc) from None
        except WorkerUnavailable as exc:
            self.registry.mark_failed(exc.worker, str(exc))
            raise from_dispatch_error(exc) from None
        except DispatchError as exc:
            raise from_dispatch_error(exc) from None

    def _final(self, req: RoutedRequest, chunk: TokenChunk, num_tokens: int,
               ttft_s: float | None, t0: float) -> GenerateOutput:
        return GenerateOutput(
            request_id=req.request_id, token_ids=chunk.token_ids, text_delta=chunk.text_delta,
            finish_reason=chunk.finish_reason,
            usage=Usage(prompt_tokens=len(req.prompt_ids), completion_tokens=num_tokens),
            ttft_s=ttft_s, latency_s=time.perf_counter() - t0, spec=chunk.spec)

    async def abort(self, request_id: str) -> bool:
        """Stop a request in flight; its stream ends with FinishReason.ABORT."""
        if not request_id:
            raise RouterError(Code.INVALID_ARGUMENT, "request_id: required")
        if request_id not in self._in_flight:
            return False
        return await self.dispatcher.abort(request_id)

    # ---- state ------------------------------------------------------------------------------

    def workers(self) -> list[WorkerState]:
        self.registry.refresh()
        return self.registry.states()

    def serving(self) -> bool:
        """Whether some served model can take a request now (the health service's answer)."""
        self.registry.maybe_refresh()
        return any(self.registry.serving(m.name) for m in self._models)

    def stats(self) -> RouterStats:
        c = self._counters
        return RouterStats(
            num_requests=c.requests, num_rejected=c.rejected, num_in_flight=len(self._in_flight),
            num_finished=c.finished, num_aborted=c.aborted, num_failed=c.failed,
            num_prompt_tokens=c.prompt_tokens, num_completion_tokens=c.completion_tokens,
            workers=tuple(self.workers()), spec=self.dispatcher.stats().spec)

    async def close(self) -> None:
        await self.dispatcher.close()

    # ---- internals --------------------------------------------------------------------------

    def _budget(self, timeout_s: float | None) -> float | None:
        limits = [t for t in (timeout_s, self.cfg.max_request_s) if t is not None]
        if not limits:
            return None
        budget = min(limits)
        if not math.isfinite(budget) or budget <= 0:
            raise RouterError(Code.DEADLINE_EXCEEDED, "deadline: already passed on arrival")
        return budget

    def _new_room(self) -> int:
        while True:
            room = secrets.randbits(64)
            if room and room not in self._rooms:
                return room

    def _register(self, req: RoutedRequest) -> None:
        self._in_flight[req.request_id] = req
        self._rooms.add(req.room)
        self._counters.requests += 1
        self._counters.prompt_tokens += len(req.prompt_ids)
        p = req.placement
        for name in {p.prefill_worker, p.decode_worker}:
            self.registry.assign(name)

    def _unregister(self, req: RoutedRequest, outcome: str, num_tokens: int) -> None:
        self._in_flight.pop(req.request_id, None)
        self._rooms.discard(req.room)
        p = req.placement
        for name in {p.prefill_worker, p.decode_worker}:
            self.registry.release(name)
        self._counters.completion_tokens += num_tokens
        setattr(self._counters, outcome, getattr(self._counters, outcome) + 1)
        log.debug("request %s (room %d) %s after %d tokens", req.request_id, req.room, outcome,
                  num_tokens)


def _num_chars(inp: GenerateInput) -> int:
    return len(inp.prompt or "") + sum(len(m.content) for m in inp.messages)
