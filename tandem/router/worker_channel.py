"""`WorkerChannel`: the router's end of one worker's event stream (worker/channels.py is the
worker's end).

One long-lived `events` stream per router-worker pair carries, in batches, everything the worker
says about the requests this router placed on it: a prefill worker's first tokens and prefill
outcomes, a decode worker's outputs. The channel hands each event, as (worker name, event), to
the queue its room was opened with; a request's dispatcher reads only that queue.

When the stream breaks (the actor died, or its process is being restarted), every room open on
the channel gets a `ChannelLost` event at once -- their requests fail now, not at their
deadlines -- and the channel reconnects with backoff; a restarted actor serves the same channel
name again. Owns: the room -> queue map and the pump task. Used on the router's event loop only.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

log = logging.getLogger(__name__)

RECONNECT_MIN_S = 0.05
RECONNECT_MAX_S = 1.0


@dataclass(frozen=True, slots=True, kw_only=True)
class ChannelLost:
    """Put in a room's queue when its worker's event stream broke: nothing more will come."""

    worker: str
    error: str


class WorkerChannel:
    def __init__(self, worker: str, handle, channel_id: str) -> None:
        self.worker, self._handle, self._id = worker, handle, channel_id
        self._rooms: dict[int, asyncio.Queue] = {}
        self._pump: asyncio.Task | None = None
        self.last_batch = 0.0  # time.monotonic() of the last batch (keep-alives included)

    def open(self, room: int, queue: asyncio.Queue) -> None:
        """`room`'s events go to `queue` from now on (open it before submitting the room)."""
        self._start()
        self._rooms[room] = queue

    def close(self, room: int) -> None:
        self._rooms.pop(room, None)

    def _start(self) -> None:
        loop = asyncio.get_running_loop()
        if self._pump is None or self._pump.done() or self._pump.get_loop() is not loop:
            self._pump = loop.create_task(self._run())

    async def _run(self) -> None:
        backoff = RECONNECT_MIN_S
        while True:
            try:
                gen = self._handle.events.options(num_returns="streaming").remote(self._id)
                async for ref in gen:
                    batch = await ref
                    self.last_batch = time.monotonic()
                    backoff = RECONNECT_MIN_S
                    for event in batch:
                        q = self._rooms.get(event.room)
                        if q is not None:
                            q.put_nowait((self.worker, event))
                error = "the event stream ended"
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 -- the actor died or is restarting
                error = f"{type(exc).__name__}: {exc}"[:300]
            self._lose_all(error)
            await asyncio.sleep(backoff)
            backoff = min(RECONNECT_MAX_S, backoff * 2)

    def _lose_all(self, error: str) -> None:
        rooms, self._rooms = self._rooms, {}
        if rooms:
            log.warning("worker %s: event stream broke (%s); %d requests on it fail", self.worker,
                        error, len(rooms))
        for room, q in rooms.items():
            q.put_nowait((self.worker, ChannelLost(worker=self.worker, error=error)))

    async def close_all(self) -> None:
        if self._pump is not None:
            self._pump.cancel()
            try:
                await self._pump
            except BaseException:  # noqa: BLE001 -- cancelled
                pass
        self._lose_all("the router is shutting down")
