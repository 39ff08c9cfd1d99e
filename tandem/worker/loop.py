"""`WorkerLoop`: drives a single-threaded worker (`step()` + calls between steps) from a
background thread, the way a Ray actor runs it.

The loop thread is the worker's only user: a call from outside (`submit`/`call`) is queued and
applied by the loop thread between two steps, in arrival order, and its result comes back
through a Future. So a call never waits behind a lock the stepping thread keeps re-taking (a
busy worker used to starve callers for many steps), an idle loop wakes the moment a call
arrives instead of at its next poll, and the actor's event loop awaits the Future directly
(`asyncio.wrap_future`) with no thread-pool hop. Outputs go to a callback from the loop thread.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, Protocol, TypeVar

log = logging.getLogger(__name__)
T = TypeVar("T")


class SteppedWorker(Protocol):
    def step(self) -> list[Any]: ...

    def busy(self) -> bool: ...


class WorkerLoop:
    def __init__(self, worker: SteppedWorker, on_outputs: Callable[[list[Any]], None],
                 idle_sleep_s: float = 0.002, name: str = "worker-loop",
                 on_error: Callable[[BaseException], None] | None = None) -> None:
        # idle_sleep_s: while not busy, the loop still steps this often (an idle step polls
        # the transfer endpoint, which answers handshakes); a call wakes it at once.
        self.worker, self._on_outputs, self._idle = worker, on_outputs, idle_sleep_s
        self._on_error = on_error  # called on the loop thread after a step raised
        self._calls: deque[tuple[Callable[..., Any], tuple[Any, ...], Future]] = deque()
        self._guard = threading.Lock()  # guards _calls and _stopping (never held for a step)
        self._wake = threading.Event()
        self._stopping = False
        self.error: BaseException | None = None  # set if a step raised: the loop stops
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[..., T], *args: Any) -> Future:
        """Queue `fn(*args)` for the loop thread (between two steps); its Future."""
        if self.error is not None:
            raise RuntimeError(f"worker loop stopped after an error: {self.error!r}")
        fut: Future = Future()
        with self._guard:
            if self._stopping:
                raise RuntimeError("worker loop is shutting down")
            self._calls.append((fn, args, fut))
        self._wake.set()
        return fut

    def wake(self) -> None:
        """Step now if idle (e.g. the worker was handed something through a thread-safe
        method of its own)."""
        self._wake.set()

    def call(self, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)` on the loop thread; blocks until it ran (raises what it raised). Never
        from the loop thread itself (its callbacks): that would wait for itself."""
        if threading.current_thread() is self._thread:
            return fn(*args)
        return self.submit(fn, *args).result()

    def _run_calls(self) -> None:
        while True:
            with self._guard:
                if not self._calls:
                    return
                fn, args, fut = self._calls.popleft()
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn(*args))
            except BaseException as exc:  # the caller gets it; the loop goes on
                fut.set_exception(exc)

    def _run(self) -> None:
        try:
            while not self._stopping:
                self._wake.clear()
                self._run_calls()
                outs = self.worker.step()
                busy = self.worker.busy()
                if outs:
                    self._on_outputs(outs)
                if not busy:
                    self._wake.wait(self._idle)
        except BaseException as exc:  # a crashed step: report, stop, never spin
            log.exception("worker step failed")
            self.error = exc
        finally:
            self._fail_queued()
        if self.error is not None and self._on_error is not None:
            self._on_error(self.error)

    def _fail_queued(self) -> None:
        with self._guard:
            self._stopping = True
            calls, self._calls = list(self._calls), deque()
        err = self.error
        for _, _, fut in calls:
            if fut.set_running_or_notify_cancel():
                fut.set_exception(RuntimeError(
                    f"worker loop stopped after an error: {err!r}" if err else
                    "worker loop stopped"))

    def close(self) -> None:
        with self._guard:
            self._stopping = True
        self._wake.set()
        self._thread.join(timeout=10)
