"""A colocated server: one engine (prefill and decode in the same process, no KV transfer) behind
its own router and gRPC server. `tandem serve` without a deployment config runs the same thing
in the foreground (`build_colocated_router`); `tandem bench --config` starts `ColocatedServer` as
a Ray actor to compare against the disaggregated layout of the same model on the same cluster.

`ColocatedServer` is plain Python (the caller wraps it with `ray.remote`); it converts and
delegates to `build_colocated_router` and `BackgroundServer`.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from tandem.colocated_node.dispatcher import ColocatedDispatcher
from tandem.engine.config import EngineConfig
from tandem.router import Router, RouterConfig
from tandem.spec.config import SpecConfig
from tandem.worker import node_ip, tune_process
from tandem.worker.process import serving_host

log = logging.getLogger(__name__)


def build_colocated_router(engine, model: str = "default", worker: str = "colocated-0",
                           cfg: RouterConfig | None = None) -> Router:
    """One colocated worker running `engine` (its loop thread starts here)."""
    dispatcher = ColocatedDispatcher.from_engine(engine, name=worker, model=model)
    return Router(dispatcher, {model: engine.tokenizer}, cfg or RouterConfig())


@dataclass(frozen=True, slots=True, kw_only=True)
class ColocatedServerConfig:
    model_name: str  # what clients put in `model`
    engine: EngineConfig
    spec: SpecConfig | None  # None: target only (no speculation)
    torch_threads: int = 0  # 0: torch's default
    # Bind address; None: the node's advertised address (worker.process.serving_host). The
    # wildcard ("0.0.0.0") listens everywhere and reports the node's IP.
    host: str | None = None


class ColocatedServer:
    """Owns one engine, its router and the gRPC server in front of them."""

    def __init__(self, cfg: ColocatedServerConfig) -> None:
        # grpc loads when a server starts, not with this module
        from tandem.router.app import BackgroundServer
        from tandem.router.server import ServerConfig

        tune_process()  # the same process settings as the disaggregated workers
        if cfg.torch_threads:
            import torch

            torch.set_num_threads(cfg.torch_threads)
        t0 = time.perf_counter()
        if cfg.spec is not None:
            from tandem.spec import SpecEngine

            engine = SpecEngine.from_config(cfg.engine, cfg.spec)
        else:
            from tandem.engine import LLMEngine

            engine = LLMEngine.from_config(cfg.engine)
        router = build_colocated_router(engine, model=cfg.model_name)
        host = cfg.host or serving_host()
        self._server = BackgroundServer(router, ServerConfig(host=host, port=0)).start()
        self._host = node_ip() if host in ("0.0.0.0", "::") else host
        log.info("colocated server for '%s' up in %.1f s on %s", cfg.model_name,
                 time.perf_counter() - t0, self.address())

    def address(self) -> str:
        return f"{self._host}:{self._server.port}"

    def shutdown(self) -> None:
        self._server.stop()
