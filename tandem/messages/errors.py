"""Errors a worker raises to its router, matched there by type (they cross Ray pickled, as the
`cause` of Ray's task error)."""

from __future__ import annotations


class OutOfCapacity(RuntimeError):
    """A decode worker has not enough free pages or seed slots to reserve for this request now
    (it may later: the router queues the request and tries again)."""
