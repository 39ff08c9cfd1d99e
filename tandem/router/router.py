"""`Router`: the request lifecycle behind the gRPC API, as plain async Python.

generate = validate + tokenize (once) -> request id and 64-bit room -> placement -> dispatch ->
stream -> account. Owns the table of requests in flight (`RequestTable`,
router/request_table.py: (caller, request id) -> the request, with its room and placement), the
counters and the Prometheus metrics (`RouterMetrics`, router/metrics.py: its own registry,
rendered by `metrics_text()`); the `WorkerRegistry` owns worker health. The servicer only
converts protos to these values and back.

Ending a request early always reaches the workers: the router closes the dispatcher's stream
on every path out (client cancel, deadline, error), and the dispatcher's contract is that closing
an unfinished stream aborts the request on every worker and frees its pages.

Request ids belong to their caller. A caller is whoever the edge says sent the request: the
gRPC servicer passes the client's connection (its peer address, e.g. "ipv4:10.0.0.7:53114");
in-process callers share LOCAL_CALLER. A request's id (the client's own, or one the router
assigns) names it only within its caller's space: `abort(id, caller)` reaches only that caller's
requests, and a duplicate id is ALREADY_EXISTS only when the same caller has it in flight -- so
no client can stop another's request or learn which ids others use (an id in flight elsewhere is
indistinguishable from an unknown one). Workers see an id unique across callers: the client's
id, with a random suffix when another caller's request already holds it.

The event loop never tokenizes a long text: prompts above INLINE_TOKENIZE_CHARS are validated on
a small thread pool (`RouterConfig.tokenize_threads`; tokenization releases the GIL), after a
size bound that refuses hopeless prompts without tokenizing them (see router/validate.py). A
client's huge prompt therefore costs others neither the loop (Health, Stats, streaming) nor
more than `tokenize_threads` cores.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
import uuid
from collections.abc import AsyncIterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from contextlib import aclosing
from dataclasses import dataclass

from tandem import otel
from tandem.messages import FinishReason, TokenLogprob
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
from tandem.router.metrics import OK, RequestTimer, RouterMetrics, render
from tandem.router.placement import place
from tandem.router.policy import PlacementQuery, Policy, WorkerState, make_policy
from tandem.router.registry import WorkerRegistry
from tandem.router import request_span
from tandem.router.request_table import PreparedRequest, RequestTable
from tandem.router.validate import (
    GenerateInput,
    PromptTooLong,
    check_request_id,
    num_text_chars,
    resolve_model,
    validate,
)
from tandem.tokenizer import Tokenizer

log = logging.getLogger(__name__)

# Texts up to this many characters are tokenized on the event loop (about 1 ms at most: less
# than a hop to a thread and back); longer ones on the tokenizing pool.
INLINE_TOKENIZE_CHARS = 4096
LOCAL_CALLER = ""  # the id space of in-process callers (tests, the bench driver)


@dataclass(frozen=True, slots=True, kw_only=True)
class RouterConfig:
    default_max_tokens: int = 128  # when the request sets none (capped by context and pool)
    max_request_s: float | None = None  # deadline for requests whose client sets none
    refresh_s: float = 0.5  # worker reports older than this are refreshed before placing
    quarantine_s: float = 5.0  # a worker seen failing gets no requests for this long
    prefill_policy: str = "least-load"
    decode_policy: str = "power-of-two"
    # Threads that tokenize long prompts: at most this many cores go to tokenizing, however many
    # clients send long prompts at once (the rest wait their turn; short prompts never do).
    tokenize_threads: int = 1
    # A prompt refused as longer than the context is answered this late. The wait costs the
    # router nothing and slows a client that repeats such prompts in a loop: 4 clients sending
    # 3.9 MB prompts back to back made the router receive ~650 MB/s (the refusal itself takes
    # ~1 ms), and that traffic alone slowed other requests 7x on 2 cores.
    too_long_delay_s: float = 0.5

    def __post_init__(self) -> None:
        if self.default_max_tokens <= 0:
            raise ValueError(f"default_max_tokens: must be > 0, got {self.default_max_tokens}")
        if self.tokenize_threads <= 0:
            raise ValueError(f"tokenize_threads: must be > 0, got {self.tokenize_threads}")
        if self.max_request_s is not None and not self.max_request_s > 0:
            raise ValueError(f"max_request_s: must be > 0, got {self.max_request_s}")
        for name in ("refresh_s", "quarantine_s", "too_long_delay_s"):
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
    # [len(token_ids)] when the request asks (sampling.logprobs), else ()
    logprobs: tuple[TokenLogprob, ...] = ()
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
    num_refused: int  # RESOURCE_EXHAUSTED: refused for capacity, neither rejected nor failed
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
    refused: int = 0
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
        self._in_flight = RequestTable()  # the only table of requests in flight
        self._counters = _Counters()
        self.metrics = RouterMetrics(dispatcher.stats)
        self._tokenize_pool = ThreadPoolExecutor(cfg.tokenize_threads,
                                                 thread_name_prefix="router-tokenize")
        for name, tok in self._tokenizers.items():
            if tok is not None and tok.max_token_bytes is None:
                log.warning("model '%s': its tokenizer is not byte-level BPE without a "
                            "normalizer, so prompts are not refused by size before tokenizing",
                            name)

    # ---- requests ---------------------------------------------------------------------------

    async def prepare(self, inp: GenerateInput, timeout_s: float | None = None, *,
                      caller: str = LOCAL_CALLER, span: otel.Span = otel.NOOP
                      ) -> PreparedRequest:
        """Validate, tokenize and place; raises RouterError. Does not register the request.
        `span`: the request's span; the work shows as its child `router.prepare`, and the
        prepared request carries it to the dispatcher (`RoutedRequest.traceparent`)."""
        step = otel.start("router.prepare", span)
        try:
            prepared = await self._prepare(inp, timeout_s, caller, span.traceparent)
        except Exception as exc:
            step.fail(exc)
            raise
        finally:
            step.end()
        request_span.describe(span, prepared)
        return prepared

    async def _prepare(self, inp: GenerateInput, timeout_s: float | None, caller: str,
                       traceparent: str) -> PreparedRequest:
        check_request_id(inp.request_id)
        model = resolve_model(inp.model, self._models)
        args = (inp, model, self._tokenizers.get(model.name), self.cfg.default_max_tokens)
        if num_text_chars(inp) > INLINE_TOKENIZE_CHARS:  # keep the event loop serving meanwhile
            valid = await asyncio.get_running_loop().run_in_executor(self._tokenize_pool,
                                                                     validate, *args)
        else:
            valid = validate(*args)
        # From here to registration nothing awaits, so the id checks cannot race.
        if inp.request_id and self._in_flight.get(caller, inp.request_id) is not None:
            raise RouterError(Code.ALREADY_EXISTS,
                              f"request_id: '{inp.request_id}' is already in flight")
        self.registry.maybe_refresh()
        query = PlacementQuery(model=model.name, prompt_ids=valid.prompt_ids,
                               num_tokens=len(valid.prompt_ids) + valid.params.max_new_tokens)
        placement = place(self.registry, query, self._prefill_policy, self._decode_policy,
                          inp.prefill_worker, inp.decode_worker)
        budget = self._budget(timeout_s)
        request_id = inp.request_id or uuid.uuid4().hex
        routed = RoutedRequest(
            request_id=self._in_flight.routed_id(request_id), room=self._in_flight.new_room(),
            model=model.name, prompt_ids=valid.prompt_ids, params=valid.params,
            placement=placement, deadline=None if budget is None else time.time() + budget,
            traceparent=traceparent)
        return PreparedRequest(caller=caller, request_id=request_id, routed=routed)

    async def generate(self, inp: GenerateInput, timeout_s: float | None = None, *,
                       caller: str = LOCAL_CALLER, traceparent: str = "", api: str = "local"
                       ) -> AsyncIterator[GenerateOutput]:
        """Stream a request's outputs. `timeout_s`: the client's remaining deadline; `caller`:
        whose id space the request's id lives in; `traceparent`: the client's W3C trace context
        (the parent of the request's root span when tracing is on), `api` which front it came
        by (a span attribute). Raises RouterError (validation, placement, worker failure,
        DEADLINE_EXCEEDED); a cancelled consumer or `aclose()` stops the request on its
        workers."""
        t0 = time.perf_counter()
        span = otel.start("tandem.request", traceparent, kind=otel.SERVER)
        span.set("tandem.api", api)
        try:
            prepared = await self.prepare(inp, timeout_s, caller=caller, span=span)
        except RouterError as exc:
            outcome = request_span.refused(span, exc)  # refused (capacity) | rejected
            setattr(self._counters, outcome, getattr(self._counters, outcome) + 1)
            self.metrics.refused(exc.code.value)
            if isinstance(exc, PromptTooLong):
                await asyncio.sleep(self.cfg.too_long_delay_s)
            raise
        self._register(prepared)
        req, request_id = prepared.routed, prepared.request_id
        # The timer counts the tokens and times the first one, for the metrics and the answer.
        timer = self.metrics.request(len(req.prompt_ids), t0)
        outcome = "aborted"  # what ends the request if we leave early (cancel, close)
        code = Code.CANCELLED.value  # its status code then
        try:
            async with aclosing(self.dispatcher.submit(req)) as stream:
                while True:
                    chunk = await self._next(stream, req)
                    if chunk is None:
                        raise RouterError(Code.INTERNAL, "dispatch: the stream ended without "
                                                         "a finish reason")
                    if timer.ttft_s is None and chunk.token_ids:
                        span.event("first_token")
                    timer.chunk(chunk)
                    if not chunk.finished:
                        yield GenerateOutput(request_id=request_id, token_ids=chunk.token_ids,
                                             text_delta=chunk.text_delta,
                                             logprobs=chunk.logprobs)
                        continue
                    outcome = "aborted" if chunk.finish_reason is FinishReason.ABORT else "finished"
                    code = OK
                    span.set("gen_ai.response.finish_reasons", chunk.finish_reason.value)
                    yield self._final(prepared, chunk, timer)
                    return
        except RouterError as exc:
            # A capacity refusal (the queue is full, decode out of pages for good) is no
            # worker's failure: counted apart.
            outcome = {Code.DEADLINE_EXCEEDED: "aborted",
                       Code.RESOURCE_EXHAUSTED: "refused"}.get(exc.code, "failed")
            code = exc.code.value
            span.fail(exc)
            raise
        except Exception as exc:
            outcome, code = "failed", Code.INTERNAL.value
            span.fail(exc)
            raise
        finally:
            self._unregister(prepared, outcome, timer.num_tokens)
            timer.ended(code)
            span.set("gen_ai.usage.output_tokens", timer.num_tokens)
            request_span.ended(span, outcome, code)

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

    def _final(self, prepared: PreparedRequest, chunk: TokenChunk, timer: RequestTimer
               ) -> GenerateOutput:
        return GenerateOutput(
            request_id=prepared.request_id, token_ids=chunk.token_ids,
            text_delta=chunk.text_delta, finish_reason=chunk.finish_reason,
            logprobs=chunk.logprobs,
            usage=Usage(prompt_tokens=len(prepared.routed.prompt_ids),
                        completion_tokens=timer.num_tokens),
            ttft_s=timer.ttft_s, latency_s=timer.elapsed_s(), spec=chunk.spec)

    async def abort(self, request_id: str, *, caller: str = LOCAL_CALLER) -> bool:
        """Stop `caller`'s request in flight; its stream ends with FinishReason.ABORT. False
        when `caller` has no such request (another caller's request of that id is untouched)."""
        if not request_id:
            raise RouterError(Code.INVALID_ARGUMENT, "request_id: required")
        prepared = self._in_flight.get(caller, request_id)
        if prepared is None:
            return False
        return await self.dispatcher.abort(prepared.routed.request_id)

    # ---- state ------------------------------------------------------------------------------

    def tokenizer(self, model: str) -> Tokenizer | None:
        """The tokenizer of served model `model` (None: it has none; the HTTP front names
        returned tokens with it)."""
        return self._tokenizers.get(model)

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
            num_refused=c.refused,
            num_prompt_tokens=c.prompt_tokens, num_completion_tokens=c.completion_tokens,
            workers=tuple(self.workers()), spec=self.dispatcher.stats().spec)

    def metrics_text(self) -> tuple[bytes, str]:
        """The Prometheus scrape: this router's metrics as text, and its Content-Type."""
        return render(self.metrics.registry)

    async def close(self) -> None:
        self._tokenize_pool.shutdown(wait=False, cancel_futures=True)
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

    def _register(self, prepared: PreparedRequest) -> None:
        req = prepared.routed
        self._in_flight.add(prepared)
        self._counters.requests += 1
        self._counters.prompt_tokens += len(req.prompt_ids)
        p = req.placement
        for name in {p.prefill_worker, p.decode_worker}:
            self.registry.assign(name)

    def _unregister(self, prepared: PreparedRequest, outcome: str, num_tokens: int) -> None:
        req = prepared.routed
        self._in_flight.pop(prepared)
        p = req.placement
        for name in {p.prefill_worker, p.decode_worker}:
            self.registry.release(name)
        self._counters.completion_tokens += num_tokens
        setattr(self._counters, outcome, getattr(self._counters, outcome) + 1)
        log.debug("request %s of %r (workers' id %s, room %d) %s after %d tokens",
                  prepared.request_id, prepared.caller, req.request_id, req.room, outcome,
                  num_tokens)
