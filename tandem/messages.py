"""Messages that cross processes between the router and the workers, beyond the request values
of router/dispatch.py. Torch-free: the router imports this module, and so do the workers.

(Today only what the router matches by type lives here; the prefill outcome and the decode
output are still defined next to their workers and are told apart by the channel they came on.)
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True, kw_only=True)
class FirstToken:
    """A prefill worker's first token of a room, as soon as its forward is over (before the
    KV moves): the router streams it to the client at once."""

    room: int
    token: int
    text: str


class OutOfCapacity(RuntimeError):
    """A decode worker has not enough free pages or seed slots to reserve for this request now
    (it may later: the router queues the request and tries again)."""
