"""What `PrefillSender` and `DecodeReceiver` share: `EndpointConfig`, registration of a layout with
a backend, the endpoint's identity (`EndpointInfo`), metrics, and the polling wait loop with its
sleep schedule (`poll_pause_s`, `PollBackoff`: also for owners' loops that poll an endpoint)."""

from __future__ import annotations

import os
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

from tandem.kvtransfer.backend import BackendOptions, TransferBackend, create_backend
from tandem.kvtransfer.compat import CompatInfo
from tandem.kvtransfer.contract import EndpointInfo, ErrorKind, TransferError
from tandem.kvtransfer.layout import MAX_BATCH_ENTRIES, KVLayout
from tandem.kvtransfer.metrics import MetricsRecorder, TransferMetrics


@dataclass(frozen=True, slots=True, kw_only=True)
class EndpointConfig:
    """Deadlines and limits. Defaults suit production; tests shrink them.

    Ordering the lease relies on: timeout_s < timeout_s + drain_timeout_s <= timeout_s +
    lease_margin_s, and with Mooncake drain_timeout_s > MC_TRANSFER_TIMEOUT (default 30 s)."""

    handshake_timeout_s: float = 10.0  # connect(): HELLO → WELCOME
    timeout_s: float = 30.0  # default transfer deadline of expect(), counted from the grant
    # How long a reservation waits for its writer to begin (the prefill queue and forward, which
    # must not count against the transfer); None: the transfer deadline counts from the
    # reservation (what unit tests of deadlines use). The router aborts a request at its own
    # deadline, so this bounds only reservations whose router went away.
    reserve_wait_s: float | None = 300.0
    drain_timeout_s: float = 35.0  # sender: after a failure, wait this long for posted writes
    lease_margin_s: float = 45.0  # decode: lease = timeout_s + this; then the writer is fenced
    # Entries per backend write; None = the backend's own limit (Mooncake 1024, NIXL none: one
    # write per push keeps NIXL at one transfer handle however scattered the pages are).
    max_batch_entries: int | None = None
    # Wait loops (see `poll_pause_s`): poll back to back (yielding the core) for spin_s, then
    # sleep between polls for 1/16 of the time waited so far, within [poll_min_sleep_s,
    # poll_sleep_s]. A grant or write that completes within the spin is seen at once; a later
    # one at most ~6% (+ the kernel's ~50 us timer slack) late; an idle wait costs a core only
    # for spin_s. Keep poll_sleep_s < 1 ms: a fixed 1 ms quantum was a whole transfer's time.
    poll_sleep_s: float = 0.0005
    poll_min_sleep_s: float = 20e-6
    spin_s: float = 0.001
    recent_outcomes: int = 4096  # sender: finished rooms remembered to answer a late ABORT

    def __post_init__(self) -> None:
        if self.lease_margin_s < self.drain_timeout_s:
            raise ValueError(f"EndpointConfig.lease_margin_s ({self.lease_margin_s}) must be >= "
                             f"drain_timeout_s ({self.drain_timeout_s})")
        if self.max_batch_entries is not None and self.max_batch_entries < 1:
            raise ValueError("EndpointConfig.max_batch_entries must be >= 1 or None, got "
                             f"{self.max_batch_entries}")
        if self.spin_s < 0 or not 0 <= self.poll_min_sleep_s <= self.poll_sleep_s:
            raise ValueError(f"EndpointConfig: need spin_s >= 0 and 0 <= poll_min_sleep_s <= "
                             f"poll_sleep_s, got spin_s={self.spin_s}, poll_min_sleep_s="
                             f"{self.poll_min_sleep_s}, poll_sleep_s={self.poll_sleep_s}")


BACKOFF_FRACTION = 1 / 16  # sleep this fraction of the time waited so far (after the spin)


def poll_pause_s(waited_s: float, config: EndpointConfig) -> float:
    """Seconds a wait loop sleeps after a poll that found nothing, `waited_s` into the wait.
    Pure: 0 (yield only) within spin_s, then waited_s / 16 clamped to [poll_min_sleep_s,
    poll_sleep_s] - an event is seen at most ~6% of the wait late, and never a fixed quantum
    late (tests/unit/test_kvtransfer_endpoints.py pins this)."""
    if waited_s < config.spin_s:
        return 0.0
    return min(config.poll_sleep_s, max(config.poll_min_sleep_s, waited_s * BACKOFF_FRACTION))


_OS_SLEEP = time.sleep  # a clock patched in (tests) gets its own sleep(0) for a yield


class PollBackoff:
    """The `poll_pause_s` schedule for a loop that polls: `pause()` after a poll that found
    nothing (sleeps), `reset()` after one that made progress (back to spinning). Endpoint waits
    use it; so can an owner's loop that polls a receiver (a fixed sleep there, or a sub-ms
    timeout that poll(2) rounds up to 1 ms, delays every grant by that much)."""

    def __init__(self, config: EndpointConfig, clock: Callable[[], float] | None = None,
                 sleep: Callable[[float], None] | None = None):
        self.config = config
        self._clock = clock or time.perf_counter  # looked up per instance: tests patch `time`
        self._sleep = sleep or time.sleep
        # A pause of 0 yields the core (and the GIL). `time.sleep(0)` is not that everywhere:
        # it cost 71 us on this project's CPU VM (timer slack), a whole grant round trip, while
        # sched_yield costs 0.6 us there.
        self._yield = os.sched_yield if self._sleep is _OS_SLEEP else lambda: self._sleep(0.0)
        self._since = self._clock()

    def reset(self) -> None:
        self._since = self._clock()

    def pause(self) -> float:
        """Sleep per the schedule; returns the seconds asked for (0 = a yield)."""
        s = poll_pause_s(self._clock() - self._since, self.config)
        if s > 0:
            self._sleep(s)
        else:
            self._yield()
        return s


def options_for_role(options: BackendOptions | None, role: str) -> BackendOptions:
    """Fill role-dependent defaults: NIXL's progress thread (None = by role) is on for the
    decode receiver - the target of the writes. A host-memory write (the aux slot) completes at
    the sender only once the target's UCX progresses; without the thread that is the decode
    loop's next poll, which may be a whole forward pass away. The sender polls its own writes
    while they are in flight, so it runs without the thread (no wakeup latency on its side)."""
    options = options or BackendOptions()
    if options.nixl_progress_thread is None:
        options = replace(options, nixl_progress_thread=role == "decode")
    return options


class EndpointBase:
    """Owns one backend instance and the registration of one layout with it."""

    role = ""

    def __init__(self, backend: TransferBackend | str, layout: KVLayout, compat: CompatInfo, *,
                 config: EndpointConfig | None, options: BackendOptions | None,
                 clock: Callable[[], float]):
        self.backend = (create_backend(backend, options_for_role(options, self.role))
                        if isinstance(backend, str) else backend)
        self.layout = layout
        self.compat = compat
        self.config = config or EndpointConfig()
        self.clock = clock
        self.session = random.SystemRandom().getrandbits(63)
        self._metrics = MetricsRecorder()
        for region in layout.regions:  # GPU regions register as VRAM: chosen by region.device
            self.backend.register(region.base_ptr, region.nbytes, region.device)
        self.backend.register(layout.aux.base_ptr, layout.aux.nbytes, layout.aux.device)
        self._closed = False
        # Entries per write: the tighter of the config's and the backend's limit.
        limits = [n for n in (self.config.max_batch_entries,
                              getattr(self.backend, "max_batch_entries", MAX_BATCH_ENTRIES))
                  if n is not None]
        self.max_batch_entries: int | None = min(limits) if limits else None

    def info(self) -> EndpointInfo:
        """Publish after construction: NIXL's address embeds the registrations made above."""
        return EndpointInfo(backend=self.backend.name, address=self.backend.address(),
                            session=self.session, role=self.role, compat=self.compat)

    def metrics(self) -> TransferMetrics:
        return self._metrics.snapshot()

    def _wait_until(self, done: Callable[[], bool], timeout_s: float | None, what: str) -> None:
        """Poll until `done()`; TransferError(TIMEOUT) after `timeout_s` (None = no limit)."""
        end = None if timeout_s is None else self.clock() + timeout_s
        backoff = PollBackoff(self.config)
        while True:
            self._pump()
            if done():
                return
            if end is not None and self.clock() >= end:
                raise TransferError(ErrorKind.TIMEOUT, f"{what}: no answer within {timeout_s:g}s")
            backoff.pause()

    def _pump(self) -> None:
        """Make progress; events/outcomes accumulate until the owner's next `poll()`, so that a
        method that progresses internally (start, push_layers, abort...) never swallows them."""
        raise NotImplementedError
