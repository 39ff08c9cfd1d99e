"""`WorkerRegistry`: the router's view of the workers and their health.

Owns (the only writer): the last `WorkerInfo` each worker reported through the dispatcher, the
router's count of requests placed on each worker and not yet ended, and the quarantine of
workers the router saw fail. A worker is a candidate for new requests only when its last report
says healthy, it was in the last report at all, and it is not quarantined: a dead worker stops
getting requests at once (quarantine on the first failure the router sees), not only at the
next report. Single-threaded: used from the router's event loop only.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import replace

from tandem.router.dispatch import WorkerInfo
from tandem.router.policy import WorkerState

log = logging.getLogger(__name__)


class WorkerRegistry:
    def __init__(self, source: Callable[[], Sequence[WorkerInfo]], refresh_s: float = 0.5,
                 quarantine_s: float = 5.0, clock: Callable[[], float] = time.monotonic) -> None:
        self._source, self._refresh_s, self._quarantine_s = source, refresh_s, quarantine_s
        self._clock = clock
        self._infos: dict[str, WorkerInfo] = {}
        self._assigned: dict[str, int] = {}
        self._quarantined_until: dict[str, tuple[float, str]] = {}  # name -> (until, reason)
        self._last_refresh = -float("inf")
        self.refresh()

    def refresh(self) -> None:
        """Replace the view with a fresh report; workers missing from it are dead."""
        try:
            report = list(self._source())
        except Exception as exc:  # noqa: BLE001 -- keep the last view; the next refresh retries
            log.warning("worker report failed: %s", exc)
            return
        seen = {w.name: w for w in report}
        for name, old in self._infos.items():
            if name not in seen:
                seen[name] = replace(old, healthy=False, error="missing from the last report")
        self._infos = seen
        self._last_refresh = self._clock()

    def maybe_refresh(self) -> None:
        if self._clock() - self._last_refresh >= self._refresh_s:
            self.refresh()

    def mark_failed(self, name: str, reason: str) -> None:
        """The router saw `name` fail: no new requests go there for `quarantine_s`."""
        log.warning("worker %s failed: %s", name, reason)
        self._quarantined_until[name] = (self._clock() + self._quarantine_s, reason)

    def assign(self, name: str) -> None:
        self._assigned[name] = self._assigned.get(name, 0) + 1

    def release(self, name: str) -> None:
        self._assigned[name] = max(0, self._assigned.get(name, 0) - 1)

    def get(self, name: str) -> WorkerState | None:
        info = self._infos.get(name)
        return None if info is None else self._state(info)

    def states(self) -> list[WorkerState]:
        return [self._state(info) for info in sorted(self._infos.values(), key=lambda w: w.name)]

    def names(self) -> list[str]:
        return sorted(self._infos)

    def candidates(self, model: str, *, prefill: bool) -> list[WorkerState]:
        """Healthy workers of `model` that can prefill (prefill=True) or decode."""
        return [s for s in self.states() if s.healthy and s.info.model == model
                and (s.info.role.can_prefill if prefill else s.info.role.can_decode)]

    def serving(self, model: str) -> bool:
        """Whether a request for `model` can be placed now."""
        return bool(self.candidates(model, prefill=True)) and bool(
            self.candidates(model, prefill=False))

    def _state(self, info: WorkerInfo) -> WorkerState:
        quarantine = self._quarantined_until.get(info.name)
        quarantined = quarantine is not None and self._clock() < quarantine[0]
        if quarantine is not None and not quarantined:
            del self._quarantined_until[info.name]
        if quarantined and info.healthy:
            info = replace(info, error=f"quarantined after a failure: {quarantine[1]}")
        return WorkerState(info=info, num_assigned=self._assigned.get(info.name, 0),
                           quarantined=quarantined)
