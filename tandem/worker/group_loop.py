"""`GroupLoop`: drives the ranks of a TP worker in lockstep, the SPMD counterpart of `WorkerLoop`.

Why SPMD with a broadcast front instead of "rank 0 schedules and ships plans": the prefill and
decode workers interleave scheduling, drafting, verification and commit inside one `step()`;
splitting that into a plan that followers replay would duplicate the engine's control flow.
Instead every rank runs the whole worker, and we make sure its inputs are identical:

  each iteration, on every rank:
    1. rank 0 broadcasts the commands that arrived since the last iteration (messages/
       commands.py: reserve, submit, abort, connect, ...) plus whether to stop;
    2. every rank applies those commands, in order, to its own worker (`worker.apply`); the
       per-rank results are all-gathered so rank 0 can answer its caller (e.g. one Destination
       per rank);
    3. every rank runs `worker.step()` (which agrees on transfer events internally) -- also when
       idle, as `WorkerLoop` does: an idle step still polls the transfer endpoint, which must
       answer handshakes from prefill workers.

Every rank thus issues the same collectives in the same order, and no rank ever waits on a
collective the others skip. When the worker is idle, rank 0 waits between iterations (a call wakes it at once) and the
others wait in the broadcast. Only rank 0's outputs go out: with TP the others compute the same
ones; with DP attention the decode worker all-gathers every rank's outputs inside `step()`.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Protocol

from tandem.worker.loop import SteppedWorker
from tandem.worker.ranks import RankSync

log = logging.getLogger(__name__)


class CommandedWorker(SteppedWorker, Protocol):
    def apply(self, cmd: Any) -> Any:
        """Apply one command (a frozen value of messages/commands.py) between two steps; fields
        that differ per rank (`PerRank`) are read at this rank."""


@dataclass(frozen=True, slots=True)
class _Tick:
    """What rank 0 broadcasts each iteration."""

    commands: tuple[Any, ...]  # in arrival order
    stop: bool  # leave the loop (shutdown)


class GroupLoop:
    """Owns the loop thread of one rank. On rank 0, `call()` is the only way in from outside."""

    def __init__(self, worker: CommandedWorker, sync: RankSync,
                 on_outputs: Callable[[list[Any]], None] | None,
                 idle_sleep_s: float = 0.005, name: str = "group-loop") -> None:
        self.worker, self.sync, self._on_outputs = worker, sync, on_outputs
        self._idle = idle_sleep_s
        self._lock = threading.Lock()  # guards _pending and _stopping
        self._pending: list[tuple[Any, Future]] = []  # (command, its Future)
        self._stopping = False
        self.error: BaseException | None = None  # set if an iteration raised: the loop stops
        self._done = threading.Event()
        self._wake = threading.Event()  # a call arrived: an idle rank 0 iterates at once
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    @property
    def is_leader(self) -> bool:
        return self.sync.rank == 0

    def call(self, cmd: Any) -> list[Any]:
        """Rank 0: apply `cmd` on every rank between two steps; returns the per-rank results,
        or raises rank 0's exception (else the first rank's)."""
        return self.submit(cmd).result()

    def submit(self, cmd: Any) -> Future:
        """Rank 0: queue `call`'s work; the Future of its per-rank results."""
        if not self.is_leader:
            raise RuntimeError("GroupLoop.call: only rank 0 takes calls")
        if self.error is not None:
            raise RuntimeError(f"worker loop stopped after an error: {self.error!r}")
        fut: Future = Future()
        with self._lock:
            if self._stopping:
                raise RuntimeError("worker loop is shutting down")
            self._pending.append((cmd, fut))
        self._wake.set()
        return fut

    def _next_tick(self) -> tuple[_Tick, list[Future]]:
        if not self.is_leader:
            return _Tick((), False), []
        with self._lock:
            pending, self._pending = self._pending, []
            stop = self._stopping
        return _Tick(tuple(c for c, _ in pending), stop), [f for _, f in pending]

    def _apply(self, cmd: Any) -> tuple[bool, Any]:
        try:
            return True, self.worker.apply(cmd)
        except Exception as exc:  # the caller gets it; the loop goes on
            return False, exc

    def _run(self) -> None:
        futures: list[Future] = []
        try:
            while True:
                self._wake.clear()
                tick, futures = self._next_tick()
                tick = self.sync.broadcast(tick)  # followers block here until rank 0 speaks
                if tick.stop:
                    break
                if tick.commands:
                    local = [self._apply(c) for c in tick.commands]
                    per_rank = self.sync.all_gather(local)
                    for i, fut in enumerate(futures):
                        _resolve(fut, [r[i] for r in per_rank])
                    futures = []
                outs = self.worker.step()
                busy = self.worker.busy()
                if outs and self.is_leader and self._on_outputs is not None:
                    self._on_outputs(outs)
                if not busy and self.is_leader:
                    self._wake.wait(self._idle)
        except BaseException as exc:  # a crashed iteration (or a dead peer): report, stop
            log.exception("rank %d: group loop failed", self.sync.rank)
            self.error = exc
            for fut in futures:
                fut.set_exception(RuntimeError(f"worker loop failed: {exc!r}"))
        finally:
            self._done.set()
            self._fail_pending()

    def _fail_pending(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, []
            self._stopping = True
        for _, fut in pending:
            fut.set_exception(RuntimeError("worker loop stopped"))

    def close(self, timeout_s: float = 10.0) -> None:
        """Rank 0: stop every rank's loop (the stop rides the next broadcast)."""
        with self._lock:
            self._stopping = True
        self._wake.set()
        self._thread.join(timeout=timeout_s)

    def wait_stopped(self, timeout_s: float | None = None) -> bool:
        return self._done.wait(timeout_s)


def _resolve(fut: Future, results: list[tuple[bool, Any]]) -> None:
    failed = [v for ok, v in results if not ok]
    if not results[0][0]:
        fut.set_exception(results[0][1])
    elif failed:
        fut.set_exception(failed[0])
    else:
        fut.set_result([v for _, v in results])
