"""`RouterServer`: the gRPC server in front of a `Router` -- the `tandem.v1.Router` service, the
standard `grpc.health.v1` health service, server reflection, optional bearer-token auth and TLS,
and the receive-size limit.

Owns the `grpc.aio.Server` and the task that keeps the health status in step with the worker
registry (SERVING while some model can take a request, NOT_SERVING otherwise, and
NOT_SERVING during shutdown).

Closed by default: it binds 127.0.0.1 unless told otherwise, and `start` warns when an address
beyond loopback is served without a token, or with a token but without TLS (auth.edge_warnings).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from tandem.router.auth import BearerAuthInterceptor, check_listener, edge_warnings
from tandem.router.router import Router
from tandem.router.servicer import SERVICE_NAME, RouterServicer, add_router_servicer

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True, kw_only=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 50051  # 0: any free port (see RouterServer.port)
    auth_token: str | None = None  # require `authorization: Bearer <token>` when set
    tls_cert: Path | None = None  # PEM certificate chain; with tls_key, serve TLS only
    tls_key: Path | None = None
    max_message_bytes: int = 4 << 20  # larger requests end with RESOURCE_EXHAUSTED
    health_interval_s: float = 1.0

    def __post_init__(self) -> None:
        check_listener(port=self.port, tls_cert=self.tls_cert, tls_key=self.tls_key,
                       auth_token=self.auth_token)
        if self.max_message_bytes <= 0:
            raise ValueError(f"max_message_bytes: must be > 0, got {self.max_message_bytes}")
        if not self.health_interval_s > 0:
            raise ValueError(f"health_interval_s: must be > 0, got {self.health_interval_s}")

    @property
    def tls(self) -> bool:
        return self.tls_cert is not None


class RouterServer:
    def __init__(self, router: Router, cfg: ServerConfig) -> None:
        self.router, self.cfg = router, cfg
        self.port = 0
        self._health = health.aio.HealthServicer()
        self._health_task: asyncio.Task[None] | None = None
        interceptors = [BearerAuthInterceptor(cfg.auth_token)] if cfg.auth_token else []
        self._server = grpc.aio.server(interceptors=interceptors, options=[
            ("grpc.max_receive_message_length", cfg.max_message_bytes),
            ("grpc.so_reuseport", 0),  # a port in use must fail, not be shared
        ])
        add_router_servicer(RouterServicer(router), self._server)
        health_pb2_grpc.add_HealthServicer_to_server(self._health, self._server)
        reflection.enable_server_reflection(
            (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), self._server)

    async def start(self) -> int:
        """Bind and serve; returns the port (useful with port 0)."""
        address = f"{self.cfg.host}:{self.cfg.port}"
        try:
            if self.cfg.tls:
                creds = grpc.ssl_server_credentials(
                    [(Path(self.cfg.tls_key).read_bytes(), Path(self.cfg.tls_cert).read_bytes())])
                self.port = self._server.add_secure_port(address, creds)
            else:
                self.port = self._server.add_insecure_port(address)
        except RuntimeError as exc:  # grpc's "Failed to bind"
            raise OSError(f"port: could not bind {address} ({exc})") from exc
        if self.port == 0:
            raise OSError(f"port: could not bind {address}")
        await self._update_health()
        await self._server.start()
        self._health_task = asyncio.create_task(self._health_loop())
        log.info("router listening on %s:%d (%s%s)", self.cfg.host, self.port,
                 "TLS" if self.cfg.tls else "plaintext", ", auth" if self.cfg.auth_token else "")
        for warning in edge_warnings(self.cfg.host, auth=self.cfg.auth_token is not None,
                                     tls=self.cfg.tls):
            log.warning("%s", warning)
        return self.port

    async def stop(self, grace_s: float | None = 5.0) -> None:
        """Refuse new calls, let running ones finish for `grace_s`, then stop the workers."""
        if self._health_task is not None:
            self._health_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._health_task
        await self._health.enter_graceful_shutdown()
        await self._server.stop(grace_s)
        await self.router.close()

    async def wait_for_termination(self) -> None:
        await self._server.wait_for_termination()

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.health_interval_s)
            try:
                await self._update_health()
            except Exception:  # never let a report failure kill the health task
                log.exception("health update failed")

    async def _update_health(self) -> None:
        status = (health_pb2.HealthCheckResponse.SERVING if self.router.serving()
                  else health_pb2.HealthCheckResponse.NOT_SERVING)
        await self._health.set("", status)  # the server as a whole
        await self._health.set(SERVICE_NAME, status)
