"""`EngineLoop`: one engine (`LLMEngine` or `SpecEngine`) driven by a background thread, fed
from asyncio code.

Owns the engine: the loop thread is its only caller once `start()` ran. Other threads talk to it
through a FIFO command queue (submit, abort, stop) and read an immutable `EngineLoopStats`
snapshot published after every iteration. Each request's outputs go back to the event loop that
submitted it through `loop.call_soon_threadsafe`, into that request's `RequestStream`.

Invariants:
- Every submitted request gets exactly one terminal `LoopOutput` (finish_reason or error set).
- A request that leaves the loop early (abort, consumer gone, deadline, engine failure) is
  aborted in the engine, which returns all its KV pages: after the loop is idle,
  `engine.allocator.num_free == engine.allocator.num_usable`.
- Commands are applied in order, so an abort sent after a submit always finds its request.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum

import torch

from tandem.engine.llm import PoolTooSmall
from tandem.engine.request import FinishReason, RequestOutput
from tandem.engine.sampling import SamplingParams
from tandem.messages import TokenLogprob

log = logging.getLogger(__name__)


class LoopErrorKind(str, Enum):
    REJECTED = "rejected"  # the engine refused the request (message names the field)
    CAPACITY = "capacity"  # the request needs more KV pages than the engine's pool has
    DEADLINE = "deadline"  # the request's deadline passed; it was aborted
    ENGINE_FAILED = "engine_failed"  # a step raised; the engine serves nothing more
    REQUEST_FAILED = "request_failed"  # this request's own row failed; the engine serves on
    STOPPED = "stopped"  # the loop was stopped


@dataclass(frozen=True, slots=True, kw_only=True)
class LoopError:
    kind: LoopErrorKind
    message: str


@dataclass(frozen=True, slots=True, kw_only=True)
class LoopRequest:
    req_id: str
    prompt_ids: tuple[int, ...]
    params: SamplingParams
    deadline: float | None = None  # time.time() seconds; None = no deadline


@dataclass(frozen=True, slots=True, kw_only=True)
class LoopOutput:
    """What one engine step produced for one request: one token, or accepted + 1 tokens when
    the engine speculates. Terminal when `finish_reason` or `error` is set."""

    req_id: str
    token_ids: tuple[int, ...]
    text_delta: str
    finish_reason: FinishReason | None = None
    error: LoopError | None = None
    logprobs: tuple[TokenLogprob, ...] = ()  # [len(token_ids)] when the request asks
    queue_s: float | None = None  # a finished output: seconds queued in the engine

    @property
    def terminal(self) -> bool:
        return self.finish_reason is not None or self.error is not None


@dataclass(frozen=True, slots=True, kw_only=True)
class AcceptanceSnapshot:
    """A copy of `SpecEngine.spec_stats` (over all requests so far)."""

    mean_acceptance_length: float
    per_position: tuple[float, ...]
    num_rounds: int


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineLoopStats:
    healthy: bool
    error: str  # why the loop is unhealthy ("" when healthy)
    num_running: int
    num_waiting: int
    num_free_pages: int
    num_pages: int
    num_steps: int
    acceptance: AcceptanceSnapshot | None  # None unless the engine speculates


class RequestStream:
    """One request's outputs, read with `async for` on the event loop that submitted it.
    `cancel()` (idempotent) aborts the request in the engine if it has not ended yet."""

    def __init__(self, owner: EngineLoop, req_id: str, aloop: asyncio.AbstractEventLoop) -> None:
        self.req_id = req_id
        self._owner, self._aloop = owner, aloop
        self._queue: asyncio.Queue[LoopOutput] = asyncio.Queue()
        self._done = False

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> LoopOutput:
        if self._done:
            raise StopAsyncIteration
        out = await self._queue.get()
        self._done = out.terminal
        return out

    def cancel(self) -> None:
        if not self._done:
            self._done = True
            self._owner.abort(self.req_id)

    def _deliver(self, out: LoopOutput) -> None:
        """Loop thread only. Raises RuntimeError when the consumer's event loop is closed."""
        self._aloop.call_soon_threadsafe(self._queue.put_nowait, out)


@dataclass(frozen=True, slots=True)
class _Submit:
    request: LoopRequest
    stream: RequestStream


@dataclass(frozen=True, slots=True)
class _Abort:
    req_id: str


@dataclass(frozen=True, slots=True)
class _Stop:
    pass


_Command = _Submit | _Abort | _Stop


class EngineLoop:
    """Owns `engine` from `start()` on (see the module docstring); the request table `_live`
    (request id -> its stream) is written by the loop thread only."""

    def __init__(self, engine, name: str = "engine") -> None:
        self.engine, self.name = engine, name
        self._commands: queue.SimpleQueue[_Command] = queue.SimpleQueue()
        self._live: dict[str, tuple[LoopRequest, RequestStream]] = {}  # loop thread only
        self._thread: threading.Thread | None = None
        self._failure = ""  # set once by the loop thread when the engine fails
        self._num_steps = 0
        self._idle = threading.Condition()
        self._is_idle = True
        self._stopped = False  # set by the loop thread as it exits; guarded by _idle
        self._stats = self._snapshot()

    # ---- any thread -----------------------------------------------------------------------

    def start(self) -> EngineLoop:
        if self._thread is not None:
            raise RuntimeError(f"engine loop '{self.name}' already started")
        self._thread = threading.Thread(target=self._run, name=f"engine-loop-{self.name}",
                                        daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float | None = 10.0) -> None:
        """Abort everything in flight (error STOPPED) and end the thread."""
        if self._thread is None:
            return
        self._commands.put(_Stop())
        self._thread.join(timeout)

    def submit(self, request: LoopRequest) -> RequestStream:
        """Queue a request; call from a running event loop, which receives its outputs."""
        stream = RequestStream(self, request.req_id, asyncio.get_running_loop())
        self._command(_Submit(request, stream))
        return stream

    def abort(self, req_id: str) -> None:
        """Stop a request (no-op if unknown or finished); its stream ends with ABORT."""
        self._command(_Abort(req_id))

    def _command(self, cmd: _Command) -> None:
        # Queued under the idle lock, so `wait_idle` never sees "idle" with a command in flight.
        with self._idle:
            if not self._stopped:
                self._commands.put(cmd)
                self._is_idle = False
                return
        if isinstance(cmd, _Submit):  # the thread is gone: answer here (on the event loop)
            cmd.stream._queue.put_nowait(_stopped_output(cmd.request.req_id, self.name))

    @property
    def stats(self) -> EngineLoopStats:
        return self._stats  # replaced whole by the loop thread; never mutated

    @property
    def error(self) -> str:
        """Why the loop serves nothing more ("" while healthy)."""
        return self._failure

    @property
    def started(self) -> bool:
        return self._thread is not None

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._failure

    def wait_idle(self, timeout: float) -> bool:
        """Block until nothing is queued, running or waiting in the engine (True), or timeout."""
        with self._idle:
            return self._idle.wait_for(lambda: self._is_idle, timeout)

    # ---- loop thread ----------------------------------------------------------------------

    def _run(self) -> None:
        with torch.inference_mode():
            while True:
                try:
                    if not self._iterate():
                        break
                except Exception as exc:  # noqa: BLE001 -- a bug outside step: fail, never hang
                    self._fail(exc)
                self._stats = self._snapshot()
                self._update_idle()
        with self._idle:
            self._stopped = True
        for cmd in self._drain(block=False):  # submitted while stopping
            if isinstance(cmd, _Submit):
                self._send(cmd.stream, _stopped_output(cmd.request.req_id, self.name))
        self._stats = self._snapshot()
        self._update_idle()

    def _iterate(self) -> bool:
        """One round: apply commands, expire deadlines, step. False when told to stop."""
        # Block on the queue only when the engine has nothing to do: no request of ours, and
        # no step in flight (overlap scheduling, engine/overlap.py: a step launched for
        # requests aborted since is still read, so its pages and rows are settled).
        if not self._apply(self._drain(block=not self._busy())):
            return False
        self._expire_deadlines()
        if self._busy():
            self._step()
        return True

    def _busy(self) -> bool:
        return (bool(self._live) or self.engine.has_unfinished()) and not self._failure

    def _fail(self, exc: Exception) -> None:
        """The engine is in an unknown state: end every live request, accept no more."""
        log.error("engine loop '%s' failed", self.name, exc_info=exc)
        self._failure = f"worker '{self.name}' failed: {type(exc).__name__}: {exc}"
        self._stats = self._snapshot()  # unhealthy before any consumer hears of it
        for req_id in list(self._live):
            self._end(req_id, LoopError(kind=LoopErrorKind.ENGINE_FAILED, message=self._failure))

    def _drain(self, block: bool) -> list[_Command]:
        commands = [self._commands.get()] if block else []
        while True:
            try:
                commands.append(self._commands.get_nowait())
            except queue.Empty:
                return commands

    def _apply(self, commands: Sequence[_Command]) -> bool:
        """Apply commands in order; False when told to stop."""
        for cmd in commands:
            if isinstance(cmd, _Stop):
                for req_id in list(self._live):
                    self._end(req_id, _stopped_output(req_id, self.name).error)
                return False
            if isinstance(cmd, _Abort):
                if cmd.req_id in self._live:
                    self._end(cmd.req_id, None)
                continue
            self._add(cmd.request, cmd.stream)
        return True

    def _add(self, req: LoopRequest, stream: RequestStream) -> None:
        error: LoopError | None = None
        if self._failure:
            error = LoopError(kind=LoopErrorKind.ENGINE_FAILED, message=self._failure)
        elif req.req_id in self._live:
            error = LoopError(kind=LoopErrorKind.REJECTED,
                              message=f"request_id: '{req.req_id}' is already in the engine")
        else:
            try:
                self.engine.add_request(list(req.prompt_ids), req.params, req.req_id)
            except PoolTooSmall as exc:
                error = LoopError(kind=LoopErrorKind.CAPACITY, message=str(exc))
            except ValueError as exc:  # the engine's validation (message names the field)
                error = LoopError(kind=LoopErrorKind.REJECTED, message=str(exc))
            except Exception as exc:  # anything else: this request fails, the loop lives on
                log.exception("engine loop '%s': add_request(%s) failed", self.name, req.req_id)
                error = LoopError(kind=LoopErrorKind.REJECTED,
                                  message=f"request: the worker refused it ({exc})")
        if error is not None:
            self._send(stream, LoopOutput(req_id=req.req_id, token_ids=(), text_delta="",
                                          error=error))
            return
        self._live[req.req_id] = (req, stream)

    def _end(self, req_id: str, error: LoopError | None) -> None:
        """Take a live request out early: abort it in the engine (pages return) and send its
        terminal output -- ABORT, or `error`."""
        _, stream = self._live.pop(req_id)
        try:
            self.engine.abort(req_id)
        except Exception:  # a failed engine may not abort cleanly; the request is gone anyway
            log.exception("engine loop '%s': abort of %s failed", self.name, req_id)
        self._send(stream, LoopOutput(
            req_id=req_id, token_ids=(), text_delta="",
            finish_reason=FinishReason.ABORT if error is None else None, error=error))

    def _send(self, stream: RequestStream, out: LoopOutput) -> None:
        try:
            stream._deliver(out)
        except RuntimeError:
            # The consumer's event loop is closed: nobody will read this request again.
            if out.req_id in self._live:
                self._live.pop(out.req_id)
                self.engine.abort(out.req_id)

    def _expire_deadlines(self) -> None:
        now = time.time()
        for req_id, (req, _) in list(self._live.items()):
            if req.deadline is not None and now >= req.deadline:
                self._end(req_id, LoopError(
                    kind=LoopErrorKind.DEADLINE,
                    message=f"deadline: request '{req_id}' ran past its deadline; aborted"))

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as exc:  # noqa: BLE001 -- logged by _fail; every request is ended
            self._fail(exc)
            return
        self._num_steps += 1
        for out in _merge_per_request(outputs):
            entry = self._live.get(out.req_id)
            if entry is None:
                continue  # a request added to the engine by someone else (tests)
            if out.terminal:
                del self._live[out.req_id]
            self._send(entry[1], out)

    def _snapshot(self) -> EngineLoopStats:
        s = self.engine.stats()
        spec = getattr(self.engine, "spec_stats", None)  # set only by speculative engines
        acceptance = None if spec is None else AcceptanceSnapshot(
            mean_acceptance_length=spec.mean_acceptance_length,
            per_position=tuple(spec.per_position()), num_rounds=spec.num_rounds)
        return EngineLoopStats(
            healthy=not self._failure, error=self._failure, num_running=s.num_running,
            num_waiting=s.num_waiting, num_free_pages=s.num_free_pages, num_pages=s.num_pages,
            num_steps=self._num_steps, acceptance=acceptance)

    def _update_idle(self) -> None:
        with self._idle:
            idle = not self._live and not self.engine.has_unfinished() and self._commands.empty()
            self._is_idle = idle
            if idle:
                self._idle.notify_all()


def _stopped_output(req_id: str, name: str) -> LoopOutput:
    return LoopOutput(req_id=req_id, token_ids=(), text_delta="", error=LoopError(
        kind=LoopErrorKind.STOPPED, message=f"worker '{name}' is shutting down"))


def _merge_per_request(outputs: Sequence[RequestOutput]) -> list[LoopOutput]:
    """One LoopOutput per request per step (a speculative round yields several tokens). A
    request the engine failed (FinishReason.ERROR) ends with a REQUEST_FAILED error instead of
    a finish reason; the engine already returned its pages."""
    merged: dict[str, list[RequestOutput]] = {}
    for o in outputs:
        merged.setdefault(o.req_id, []).append(o)
    return [_merged(req_id, outs) for req_id, outs in merged.items()]


def _merged(req_id: str, outs: Sequence[RequestOutput]) -> LoopOutput:
    last = outs[-1]
    failed = last.finish_reason is FinishReason.ERROR
    return LoopOutput(
        req_id=req_id, token_ids=tuple(t for o in outs for t in o.new_token_ids),
        text_delta="".join(o.text_delta for o in outs),
        logprobs=tuple(lp for o in outs for lp in o.logprobs), queue_s=last.queue_s,
        finish_reason=last.finish_reason if last.finished and not failed else None,
        error=LoopError(kind=LoopErrorKind.REQUEST_FAILED, message=last.error) if failed
        else None)
