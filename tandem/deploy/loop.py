"""`WorkerLoop`: drives a single-threaded worker (`step()` + calls between steps) from a
background thread, the way a Ray actor runs it. Every call into the worker holds one lock, so
the worker never sees two threads; outputs go to a callback outside the lock."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

log = logging.getLogger(__name__)
T = TypeVar("T")


class SteppedWorker(Protocol):
    def step(self) -> list[Any]: ...

    def busy(self) -> bool: ...


class WorkerLoop:
    def __init__(self, worker: SteppedWorker, on_outputs: Callable[[list[Any]], None],
                 idle_sleep_s: float = 0.002, name: str = "worker-loop") -> None:
        self.worker, self._on_outputs, self._idle = worker, on_outputs, idle_sleep_s
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.error: BaseException | None = None  # set if a step raised: the loop stops
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def call(self, fn: Callable[..., T], *args: Any) -> T:
        if self.error is not None:
            raise RuntimeError(f"worker loop stopped after an error: {self.error!r}")
        with self._lock:
            return fn(*args)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                with self._lock:
                    outs = self.worker.step()
                    busy = self.worker.busy()
            except BaseException as exc:  # a crashed step: report, stop, never spin
                log.exception("worker step failed")
                self.error = exc
                return
            if outs:
                self._on_outputs(outs)
            if not busy:
                time.sleep(self._idle)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
