"""`RequestTable`: the `Router`'s requests in flight, one `PreparedRequest` each.

A request is in the table from its registration to its end, keyed by (caller, the caller's
request id): a caller reaches only its own ids (router/router.py, "Request ids belong to their
caller"). With the records go two lookups that only `add` and `pop` write -- the workers' ids
and the rooms of the requests in the table -- so that a new request's workers' id and room are
chosen unique in O(1).
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass

from tandem.router.dispatch import RoutedRequest


@dataclass(frozen=True, slots=True, kw_only=True)
class PreparedRequest:
    """A request ready to dispatch, and whose it is."""

    caller: str  # the id space it belongs to (see router/router.py)
    request_id: str  # the caller's name for it: its own id, or the one assigned
    routed: RoutedRequest  # routed.request_id: unique across callers (what workers see)


class RequestTable:
    def __init__(self) -> None:
        self._requests: dict[tuple[str, str], PreparedRequest] = {}  # (caller, id) -> request
        # Lookups, always {r.routed.request_id} and {r.routed.room} over the records above
        self._routed_ids: set[str] = set()
        self._rooms: set[int] = set()

    def __len__(self) -> int:
        return len(self._requests)

    def get(self, caller: str, request_id: str) -> PreparedRequest | None:
        return self._requests.get((caller, request_id))

    def add(self, prepared: PreparedRequest) -> None:
        self._requests[prepared.caller, prepared.request_id] = prepared
        self._routed_ids.add(prepared.routed.request_id)
        self._rooms.add(prepared.routed.room)

    def pop(self, prepared: PreparedRequest) -> None:
        self._requests.pop((prepared.caller, prepared.request_id), None)
        self._routed_ids.discard(prepared.routed.request_id)
        self._rooms.discard(prepared.routed.room)

    def routed_id(self, request_id: str) -> str:
        """The workers' id: the caller's, unless another caller's request in flight holds it."""
        routed_id = request_id
        while routed_id in self._routed_ids:
            routed_id = f"{request_id}~{secrets.token_hex(4)}"
        return routed_id

    def new_room(self) -> int:
        """A 64-bit room no request in flight uses (never 0)."""
        while True:
            room = secrets.randbits(64)
            if room and room not in self._rooms:
                return room
