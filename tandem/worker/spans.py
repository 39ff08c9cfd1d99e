"""`RoomSpans`: the OpenTelemetry spans of a worker's traced requests, one phase at a time.

On a worker a request goes through phases in order -- prefill: `prefill.queue` ->
`prefill.forward` -> (`prefill.wait_route` when decode's destination comes after the forward)
-> `kv.push`; decode: `kv.receive` -> `decode.generate` -- and each phase is one span under the
request's span on this worker (the traceparent its command brought: the actor's span of the
request, deploy/actors.py). The table holds each traced room's current phase until the room
ends on this worker.

Owned by the worker and used on its loop thread only. A room is traced only when tracing is on
in this process, its command carried a traceparent and this rank is the one that reports (rank
0 of a TP group; with DP attention, the rank that holds the room). Otherwise the table stays
empty and every method returns after a dict lookup; `bool(spans)` tells a step whether any
room is traced at all, so untraced steps skip the per-room work.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from tandem import otel
from tandem.messages import DecodeOutput, PrefillResult

# Traced rooms one worker keeps at most: a room whose end never reached the table (a bug, or a
# rank that lost it) must not grow memory; the oldest is ended when a new one comes past this.
MAX_ROOMS = 65536


@dataclass(slots=True)
class _Traced:
    parent: str  # traceparent of the request's span on this worker
    name: str  # the current phase ("" between phases)
    span: otel.Span
    num_tokens: int = 0  # decode: tokens this worker returned


class RoomSpans:
    def __init__(self, *, reporting: bool = True, page_bytes: int = 0) -> None:
        self._rooms: dict[int, _Traced] = {}  # room -> its current phase, insertion-ordered
        self._reporting = reporting  # False: a rank whose rooms another rank reports
        self._page_bytes = page_bytes  # bytes of one KV page on this rank, every layer

    def __bool__(self) -> bool:
        return bool(self._rooms)

    def open(self, room: int, parent: str, phase: str) -> None:
        """Trace `room` from its first phase `phase` on (a no-op unless it is traced)."""
        if not parent or not self._reporting or not otel.enabled():
            return
        if len(self._rooms) >= MAX_ROOMS:
            oldest = next(iter(self._rooms))
            self.close(oldest, error="lost: its end never reached the worker's span table")
        self._rooms[room] = _Traced(parent=parent, name=phase, span=otel.start(phase, parent))

    def phase(self, room: int, name: str, at_ns: int | None = None) -> None:
        """`room` enters phase `name` now (or at `at_ns`); the phase it was in ends then."""
        t = self._rooms.get(room)
        if t is None or t.name == name:
            return
        t.span.end(at_ns)
        t.name, t.span = name, otel.start(name, t.parent, at_ns=at_ns)

    def end_phase(self, room: int) -> None:
        """`room`'s current phase ends; the next `phase` starts the next."""
        t = self._rooms.get(room)
        if t is not None:
            t.span.end()
            t.name, t.span = "", otel.NOOP

    def set(self, room: int, key: str, value: otel.AttrValue) -> None:
        """An attribute of `room`'s current phase."""
        t = self._rooms.get(room)
        if t is not None:
            t.span.set(key, value)

    def in_phase(self, name: str) -> list[int]:
        return [room for room, t in self._rooms.items() if t.name == name]

    def close(self, room: int, error: str = "") -> None:
        """`room` ended on this worker: its phase ends (failed, with `error`)."""
        t = self._rooms.pop(room, None)
        if t is None:
            return
        if error:
            t.span.fail(error)
        t.span.end()

    # ---- what the workers report ------------------------------------------------------------

    def aborted(self, room: int) -> None:
        """`room` was aborted here (the router's cancel, deadline, or the end of a request that
        needs no more of this worker): it ends, not as a failure."""
        self.set(room, "tandem.aborted", True)
        self.close(room)

    def pages(self, room: int, num_pages: int) -> None:
        """The KV pages `room` moves in its current phase (this rank's: with TP each rank
        moves its own heads)."""
        t = self._rooms.get(room)
        if t is not None:
            t.span.set("tandem.kv.pages", num_pages)
            t.span.set("tandem.kv.bytes", num_pages * self._page_bytes)

    def started(self, rooms: Iterable[int], at_ns: int) -> None:
        """Prefill: `rooms` left the engine's queue in the step that began at `at_ns`
        (time.time_ns(), OpenTelemetry's clock)."""
        for room in rooms:
            self.phase(room, "prefill.forward", at_ns)

    def results(self, results: Iterable[PrefillResult]) -> None:
        """Prefill: each result ends its room here (a failure fails its phase)."""
        if not self._rooms:
            return
        for r in results:
            if r.ok or r.error_kind == "aborted":
                self.close(r.room)
            else:
                self.set(r.room, "tandem.error_kind", r.error_kind)
                self.close(r.room, error=r.error or r.error_kind)

    def outputs(self, outs: Iterable[DecodeOutput]) -> None:
        """Decode: count each traced room's tokens; a finished room ends here (an error fails
        its phase; the finish reason and the count go on it)."""
        if not self._rooms:
            return
        for o in outs:
            t = self._rooms.get(o.room)
            if t is None:
                continue
            t.num_tokens += len(o.token_ids)
            if o.finished:
                t.span.set("gen_ai.usage.output_tokens", t.num_tokens)
                t.span.set("gen_ai.response.finish_reasons", o.finish_reason or "")
                failed = o.finish_reason == "error"
                self.close(o.room, error=(o.error or "failed") if failed else "")

