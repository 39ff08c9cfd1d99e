"""Running a router: `Router` -> `RouterServer`, served until SIGINT/SIGTERM and then stopped
gracefully (what `tandem serve` runs), or in a background thread (`BackgroundServer`: tests, an
in-process demo, the colocated and router actors). Building the router over its workers is the
caller's part (colocated_node.build_colocated_router, deploy/serve.py).

Other fronts over the same router (the HTTP front, tandem.http_api) run on the same event loop:
they are started before the gRPC server and stopped before it, because stopping the gRPC server
closes the router."""

from __future__ import annotations

import asyncio
import signal
import threading
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Protocol, TypeVar

from tandem.router.router import Router
from tandem.router.server import RouterServer, ServerConfig

if TYPE_CHECKING:
    from typing import Self

T = TypeVar("T")


class Front(Protocol):
    """Another API over the router, served on the router's event loop; it leaves the router
    open when it stops (the gRPC server's stop closes it)."""

    async def start(self) -> int:
        """Bind and serve; returns the port."""

    async def stop(self, grace_s: float | None) -> None: ...


async def serve(router: Router, cfg: ServerConfig,
                on_ready: Callable[[RouterServer], None] | None = None,
                grace_s: float = 5.0, fronts: Sequence[Front] = ()) -> None:
    server = RouterServer(router, cfg)
    await _start(server, fronts)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    if on_ready is not None:
        on_ready(server)
    try:
        await stop.wait()
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
        for front in fronts:
            await front.stop(grace_s)
        await server.stop(grace_s)


async def _start(server: RouterServer, fronts: Sequence[Front]) -> None:
    """Start `fronts`, then `server`; on a failure, stop what started (the router stays open
    for the caller to close) and raise."""
    started: list[Front] = []
    try:
        for front in fronts:
            await front.start()
            started.append(front)
        await server.start()
    except BaseException:
        for front in started:
            await front.stop(None)
        raise


class BackgroundServer:
    """A `RouterServer` (and `fronts`) on its own event loop in a daemon thread, for callers
    that are not async (tests, an in-process demo). Owns that thread and loop; `with` starts
    and stops it."""

    def __init__(self, router: Router, cfg: ServerConfig, grace_s: float = 1.0,
                 fronts: Sequence[Front] = ()) -> None:
        self.router, self.cfg, self.grace_s = router, cfg, grace_s
        self.fronts = tuple(fronts)
        self.port = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="router-server", daemon=True)

    def start(self, timeout_s: float = 30.0) -> Self:
        self._thread.start()
        if not self._ready.wait(timeout_s):
            raise TimeoutError("router server did not start")
        if self._error is not None:
            raise self._error
        return self

    def call(self, fn: Callable[[], Awaitable[T]], timeout_s: float = 30.0) -> T:
        """Run `fn()` on the server's loop (the router is single-threaded) and return its result."""
        assert self._loop is not None
        return asyncio.run_coroutine_threadsafe(fn(), self._loop).result(timeout_s)

    def stop(self, timeout_s: float = 30.0) -> None:
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(timeout_s)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _run(self) -> None:
        asyncio.run(self._main())

    async def _main(self) -> None:
        self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
        server = RouterServer(self.router, self.cfg)
        try:
            await _start(server, self.fronts)
        except Exception as exc:  # noqa: BLE001 -- re-raised by start() in the caller's thread
            self._error = exc
            self._ready.set()
            return
        self.port = server.port
        self._ready.set()
        await self._stop.wait()
        for front in self.fronts:
            await front.stop(self.grace_s)
        await server.stop(self.grace_s)
