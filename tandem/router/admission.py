"""`Admission`: how many requests a dispatcher runs at once, and how many may wait for a turn.

A request holds a running slot from its placement to its end. When every slot is taken it waits
in a FIFO queue (until a slot frees or its deadline passes); when the queue is full too it is
refused at once with `CapacityExceeded` (RESOURCE_EXHAUSTED) and a message naming the bound. A
decode worker that is out of KV pages sends its request back to wait here (`wait_for_capacity`)
instead of failing it: capacity is pages and this bound, never an actor's call cap.

Owns the count of running requests and the waiters. Used on the router's event loop only, but
for the counts (`num_running`, `num_queued`, `num_waiting_for_pages`), which a metrics scrape may
read from another thread: they copy a queue before counting in it.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from contextlib import asynccontextmanager
from dataclasses import dataclass

from tandem.router.dispatch import CapacityExceeded, DeadlineExceeded

# A request waiting for decode pages tries again at least this often.
CAPACITY_RETRY_S = 2.0


@dataclass(frozen=True, slots=True, kw_only=True)
class AdmissionConfig:
    max_running: int = 256  # requests dispatched to workers at once (per dispatcher)
    max_queued: int = 1024  # requests waiting for a running slot; beyond: RESOURCE_EXHAUSTED

    def __post_init__(self) -> None:
        if self.max_running < 1:
            raise ValueError(f"max_running: must be >= 1, got {self.max_running}")
        if self.max_queued < 0:
            raise ValueError(f"max_queued: must be >= 0, got {self.max_queued}")


class Admission:
    def __init__(self, cfg: AdmissionConfig | None = None) -> None:
        self.cfg = cfg or AdmissionConfig()
        self._running = 0
        self._waiters: deque[asyncio.Future] = deque()
        # Requests waiting for decode pages (`wait_for_capacity`), oldest first
        self._capacity_waiters: deque[asyncio.Future] = deque()

    @property
    def num_running(self) -> int:
        return self._running

    @property
    def num_queued(self) -> int:
        """Requests waiting for a running slot."""
        return sum(1 for w in list(self._waiters) if not w.done())

    @property
    def num_waiting_for_pages(self) -> int:
        """Requests holding a running slot that wait for decode pages (`wait_for_capacity`)."""
        return sum(1 for t in list(self._capacity_waiters) if not t.done())

    @asynccontextmanager
    async def slot(self, request_id: str, deadline: float | None):
        """Hold a running slot for the body; waits in the queue (until `deadline`, time.time()
        seconds) when all are taken, refused at once when the queue is full."""
        await self._acquire(request_id, deadline)
        try:
            yield
        finally:
            self._release()

    async def _acquire(self, request_id: str, deadline: float | None) -> None:
        if self._running < self.cfg.max_running and not self.num_queued:
            self._running += 1
            return
        if self.num_queued >= self.cfg.max_queued:
            raise CapacityExceeded(
                f"queue: {self._running} requests running and {self.num_queued} waiting "
                f"(limits {self.cfg.max_running} and {self.cfg.max_queued}); retry later")
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            await asyncio.wait_for(waiter, _remaining(deadline))
        except asyncio.TimeoutError:
            self._drop(waiter)
            raise DeadlineExceeded(f"request '{request_id}' passed its deadline while queued "
                                   f"behind {self._running} running requests") from None
        except BaseException:
            if waiter.done() and not waiter.cancelled():  # the slot was handed over: pass it on
                self._release()
            self._drop(waiter)
            raise
        # the slot was handed to us by _release (the count did not drop)

    def _drop(self, waiter: asyncio.Future) -> None:
        """Take a waiter that left (deadline, cancel) out of the queue now, not at the next
        release: the queue holds only requests still waiting."""
        try:
            self._waiters.remove(waiter)
        except ValueError:  # already handed a slot (popped by _release)
            pass

    def _release(self) -> None:
        while self._waiters:
            w = self._waiters.popleft()
            if not w.done():
                w.set_result(None)  # hand the slot over directly: FIFO, no barging
                break
        else:
            self._running -= 1
        while self._capacity_waiters:  # a request ended: the oldest page waiter tries again
            turn = self._capacity_waiters.popleft()
            if not turn.done():
                turn.set_result(None)
                break

    async def wait_for_capacity(self, request_id: str, deadline: float | None,
                                max_wait_s: float = CAPACITY_RETRY_S) -> None:
        """Wait for a turn to try decode's pages again: the oldest waiter is woken when a
        request ends (one end frees pages for about one request: waking every waiter made
        them all retry at once), each at least every `max_wait_s`; DeadlineExceeded when the
        deadline has passed."""
        left = _remaining(deadline)
        if left is not None and left <= 0:
            raise DeadlineExceeded(f"request '{request_id}' passed its deadline waiting for KV "
                                   "pages on the decode workers")
        turn = asyncio.get_running_loop().create_future()
        self._capacity_waiters.append(turn)
        try:
            await asyncio.wait_for(turn, max_wait_s if left is None else min(left, max_wait_s))
        except asyncio.TimeoutError:
            pass
        finally:
            if not turn.done():
                turn.cancel()


def _remaining(deadline: float | None) -> float | None:
    return None if deadline is None else max(0.0, deadline - time.time())
