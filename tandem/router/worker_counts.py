"""What the router counts of its workers for its metrics: cumulative counters a worker reports
(speculative acceptance, KV transfers), made monotonic across its restarts.

A worker counts from 0 when its process starts, and Ray restarts a worker as a new process with
a new incarnation (`WorkerHealth.incarnation`). `CountCarry` keeps, per worker, the counts of
its earlier incarnations plus the latest counts of its current one, so what the router exports
never goes backwards: a restart adds the new process's counts to what the old ones reported.
What an old process counted after its last report before it died is lost (at most one health
period, `router/worker_health.py`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from tandem.router.dispatch import WorkerCounts


@dataclass(frozen=True, slots=True, kw_only=True)
class _Carried:
    incarnation: str
    earlier: WorkerCounts = WorkerCounts()  # finished incarnations, summed
    current: WorkerCounts = WorkerCounts()  # the live one's last report
    num_restarts: int = 0


class CountCarry:
    """Owns, per worker, the counts of its earlier incarnations and the last report of its
    current one. Fed by whoever hears the worker's reports (the health poll); read at scrapes,
    which may come from another thread (prometheus-client's own server): each worker's record
    is a frozen value replaced whole, so a reader never sees half an update."""

    def __init__(self) -> None:
        self._workers: dict[str, _Carried] = {}

    def report(self, name: str, incarnation: str, counts: WorkerCounts) -> None:
        """`name`'s cumulative counts as of now, from its process `incarnation`."""
        c = self._workers.get(name)
        if c is None:  # the first report: a restart before it is not seen (nothing was lost)
            self._workers[name] = _Carried(incarnation=incarnation, current=counts)
        elif incarnation == c.incarnation:
            self._workers[name] = replace(c, current=counts)
        else:  # a new process, counting from 0
            self._workers[name] = _Carried(incarnation=incarnation, earlier=c.earlier + c.current,
                                           current=counts, num_restarts=c.num_restarts + 1)

    def totals(self, name: str) -> WorkerCounts:
        c = self._workers.get(name)
        return WorkerCounts() if c is None else c.earlier + c.current

    def num_restarts(self, name: str) -> int:
        c = self._workers.get(name)
        return 0 if c is None else c.num_restarts
