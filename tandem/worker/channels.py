"""The worker side of the router-worker event channel: what a worker tells its router about its
requests (first tokens, prefill outcomes, decode outputs) travels as batches on one long-lived
stream per router, not as one long-running actor call per request.

Why: an actor call in flight holds one of the actor's call slots. With a call per request
(a `prefill` that returned when its transfer ended, a `stream` per decode request), 64 streams
filled a worker's 64 slots and its control calls (health, abort, route) queued behind them for
seconds: the router marked a live worker down and every request failed. Now a request costs a
short submission call, and its events share the router's one `events` stream, which carries a
batch of whatever happened since the last batch (every output of one engine step, typically).

`EventChannels` owns, on one worker, the event queue of each router channel and the room ->
channel binding. It runs on the actor's event loop only (the loop thread hands events over with
`call_soon_threadsafe`). Events of a room that is bound to no channel (its router went away, or it
was never bound) are dropped: nobody is listening. A channel that no router reads for
`idle_drop_s` is dropped with its queue, so a router that died does not grow memory here.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

# A channel nobody has read for this long is dropped (its router is gone).
IDLE_DROP_S = 120.0
# An open stream yields an empty batch after this long without events: the router learns that
# the stream is alive (and the worker's event loop answers) without a separate call.
KEEPALIVE_S = 1.0


@dataclass(slots=True)
class _Channel:
    events: deque = field(default_factory=deque)  # queued for the router, oldest first
    wake: asyncio.Event = field(default_factory=asyncio.Event)  # set when events arrive
    last_read: float = field(default_factory=time.monotonic)
    # The newest stream of this channel is its one reader: a router that reconnects (its old
    # stream may linger in Ray, unread) takes the channel over, and an older stream stops
    # before it takes another event.
    generation: int = 0
    readers: int = 0


class EventChannels:
    def __init__(self, idle_drop_s: float = IDLE_DROP_S, keepalive_s: float = KEEPALIVE_S
                 ) -> None:
        self._channels: dict[str, _Channel] = {}
        self._room_channel: dict[int, str] = {}
        self._idle_drop_s, self._keepalive_s = idle_drop_s, keepalive_s

    def _channel(self, name: str) -> _Channel:
        ch = self._channels.get(name)
        if ch is None:
            ch = self._channels[name] = _Channel()
        return ch

    def bind(self, room: int, channel: str) -> None:
        """`room`'s events go to `channel` from now on."""
        self._channel(channel)
        self._room_channel[room] = channel

    def unbind(self, room: int) -> None:
        self._room_channel.pop(room, None)

    def bound(self, room: int) -> bool:
        return room in self._room_channel

    def emit(self, room: int, event: object, *, last: bool = False) -> None:
        """Queue `event` for `room`'s router; `last`: the room's final event (unbind it)."""
        name = self._room_channel.get(room)
        if last:
            self.unbind(room)
        ch = self._channels.get(name) if name is not None else None
        if ch is not None:
            ch.events.append(event)
            ch.wake.set()

    def num_rooms(self) -> int:
        return len(self._room_channel)

    async def stream(self, channel: str) -> AsyncIterator[list]:
        """The channel's events, in order, in batches (an empty batch every `keepalive_s`
        without events). A router that reconnects (same channel name) gets what was queued
        meanwhile; the stream it replaces ends."""
        ch = self._channel(channel)
        ch.generation += 1
        mine = ch.generation
        ch.readers += 1
        try:
            while ch.generation == mine:
                ch.last_read = time.monotonic()
                self._drop_idle()
                if not ch.events:
                    ch.wake.clear()
                    try:
                        await asyncio.wait_for(ch.wake.wait(), self._keepalive_s)
                    except asyncio.TimeoutError:
                        pass
                    if ch.generation != mine:
                        return
                batch = list(ch.events)
                ch.events.clear()
                yield batch
        finally:
            ch.readers -= 1
            ch.last_read = time.monotonic()

    def _drop_idle(self) -> None:
        now = time.monotonic()
        for name, ch in list(self._channels.items()):
            if ch.readers == 0 and now - ch.last_read > self._idle_drop_s:
                del self._channels[name]
                for room in [r for r, c in self._room_channel.items() if c == name]:
                    del self._room_channel[room]
