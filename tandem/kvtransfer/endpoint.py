"""What `PrefillSender` and `DecodeReceiver` share: `EndpointConfig`, registration of a layout with
a backend, the endpoint's identity (`EndpointInfo`), metrics, and the polling wait loop."""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass

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
    timeout_s: float = 30.0  # default transfer deadline of expect(); covers prefill queue + compute
    drain_timeout_s: float = 35.0  # sender: after a failure, wait this long for posted writes
    lease_margin_s: float = 45.0  # decode: lease = timeout_s + this; then the writer is fenced
    # Entries per backend write; None = the backend's own limit (Mooncake 1024, NIXL none: one
    # write per push keeps NIXL at one transfer handle however scattered the pages are).
    max_batch_entries: int | None = None
    poll_sleep_s: float = 0.0005  # wait loops sleep this long between polls...
    # ...after polling back to back for this long: a grant or a write that completes within it
    # is seen at once, not a sleep (>= 50 us of scheduler granularity) later.
    spin_s: float = 0.002
    recent_outcomes: int = 4096  # sender: finished rooms remembered to answer a late ABORT

    def __post_init__(self) -> None:
        if self.lease_margin_s < self.drain_timeout_s:
            raise ValueError(f"EndpointConfig.lease_margin_s ({self.lease_margin_s}) must be >= "
                             f"drain_timeout_s ({self.drain_timeout_s})")
        if self.max_batch_entries is not None and self.max_batch_entries < 1:
            raise ValueError("EndpointConfig.max_batch_entries must be >= 1 or None, got "
                             f"{self.max_batch_entries}")
        if self.spin_s < 0 or self.poll_sleep_s < 0:
            raise ValueError("EndpointConfig.spin_s / poll_sleep_s must be >= 0")


class EndpointBase:
    """Owns one backend instance and the registration of one layout with it."""

    role = ""

    def __init__(self, backend: TransferBackend | str, layout: KVLayout, compat: CompatInfo, *,
                 config: EndpointConfig | None, options: BackendOptions | None,
                 clock: Callable[[], float]):
        self.backend = create_backend(backend, options) if isinstance(backend, str) else backend
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
        spin_until = time.perf_counter() + self.config.spin_s
        while True:
            self._pump()
            if done():
                return
            if end is not None and self.clock() >= end:
                raise TransferError(ErrorKind.TIMEOUT, f"{what}: no answer within {timeout_s:g}s")
            # sleep(0) yields the core (and the GIL) without the timer's slack.
            time.sleep(0 if time.perf_counter() < spin_until else self.config.poll_sleep_s)

    def _pump(self) -> None:
        """Make progress; events/outcomes accumulate until the owner's next `poll()`, so that a
        method that progresses internally (start, push_layers, abort...) never swallows them."""
        raise NotImplementedError
