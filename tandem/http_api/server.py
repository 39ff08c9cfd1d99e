"""`HttpServer`: uvicorn serving the HTTP front's app on the caller's event loop -- the loop the
gRPC server runs on, so both fronts share one `Router` (which is single-threaded: every call on
it comes from that loop). `tandem serve` starts it next to `RouterServer` (router/app.py).

Owns the listening socket and the uvicorn server task. The socket is bound here, before uvicorn
starts, so that a port in use fails `start` with an OSError naming it (uvicorn would exit the
process) and port 0 gives a port to report. Signals stay with the process's owner: uvicorn's own
handlers would replace the ones `tandem serve` installs for a graceful stop of both fronts.

Closed by default like the gRPC front: 127.0.0.1 unless told otherwise, with the same warning
when an address beyond loopback is served without a token, or with one but without TLS.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket

import uvicorn

from tandem.http_api.app import build_app
from tandem.http_api.config import HttpConfig
from tandem.http_api.hooks import Observer
from tandem.router import Router
from tandem.router.auth import edge_warnings

log = logging.getLogger(__name__)


class _Uvicorn(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self):  # see the module docstring: the owner handles signals
        yield


class HttpServer:
    def __init__(self, router: Router, cfg: HttpConfig, *, observer: Observer | None = None
                 ) -> None:
        self.router, self.cfg = router, cfg
        self.port = 0
        self._app = build_app(router, cfg, observer=observer)
        self._socket: socket.socket | None = None
        self._server: _Uvicorn | None = None
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> int:
        """Bind and serve; returns the port (useful with port 0)."""
        self._socket = _bind(self.cfg.host, self.cfg.port)
        self.port = self._socket.getsockname()[1]
        config = uvicorn.Config(
            self._app, lifespan="off", ws="none", log_config=None, access_log=False,
            ssl_certfile=str(self.cfg.tls_cert) if self.cfg.tls_cert else None,
            ssl_keyfile=str(self.cfg.tls_key) if self.cfg.tls_key else None)
        try:
            config.load()  # reads the certificate: a bad one fails here, not in the task
        except Exception as exc:
            self._socket.close()
            if self.cfg.tls:
                raise OSError(f"tls_cert, tls_key: could not load them ({exc})") from exc
            raise
        self._server = _Uvicorn(config)
        self._task = asyncio.create_task(self._server.serve(sockets=[self._socket]),
                                         name="http-front")
        while not self._server.started:  # startup is a few awaits: no bind left to fail
            if self._task.done():
                self._socket.close()
                self._task.result()  # raises what stopped it
                raise OSError(f"port: the HTTP front on {self.cfg.host}:{self.port} stopped "
                              "at startup")
            await asyncio.sleep(0.01)
        log.info("HTTP front listening on %s:%d (%s%s)", self.cfg.host, self.port,
                 "HTTPS" if self.cfg.tls else "plaintext", ", auth" if self.cfg.auth_token else "")
        for warning in edge_warnings(self.cfg.host, auth=self.cfg.auth_token is not None,
                                     tls=self.cfg.tls):
            log.warning("HTTP front: %s", warning)
        return self.port

    async def stop(self, grace_s: float | None = 5.0) -> None:
        """Refuse new connections and let running requests finish for `grace_s`; the ones
        still running then are cancelled (and so aborted in the router). The router stays
        open: its owner closes it (RouterServer.stop)."""
        if self._server is None or self._task is None:
            return
        # None: no grace, as grpc.aio.Server.stop(None) (for uvicorn, None would wait forever)
        self._server.config.timeout_graceful_shutdown = grace_s or 0
        self._server.should_exit = True
        try:
            await self._task
        except Exception:  # the gRPC front's stop (which closes the router) must still run
            log.exception("HTTP front: uvicorn failed")
        finally:
            self._server = self._task = None


def _bind(host: str, port: int) -> socket.socket:
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM,
                                   flags=socket.AI_PASSIVE)
        family, _, _, _, address = infos[0]
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # no SO_REUSEPORT
            sock.bind(address)
            sock.listen(2048)
            sock.setblocking(False)
        except OSError:
            sock.close()
            raise
    except OSError as exc:
        raise OSError(f"port: could not bind {host}:{port} for the HTTP front ({exc})") from exc
    return sock
