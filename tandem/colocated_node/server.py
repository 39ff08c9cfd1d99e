"""A colocated server: one engine (prefill and decode in the same process, no KV transfer) behind
its own router and gRPC server. `tandem serve` without a deployment config runs the same thing
in the foreground (`build_colocated_router`); `tandem bench --config` starts `ColocatedServer` as
a Ray actor to compare against the disaggregated layout of the same model on the same cluster.

`ColocatedServer` is plain Python (the caller wraps it with `ray.remote`, one actor per rank
with `tp` > 1: bench/deployments.py); it serves through `ColocatedDispatcher`, `Router` and
`BackgroundServer`.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

from tandem.colocated_node.dispatcher import ColocatedDispatcher
from tandem.colocated_node.lockstep import LockstepEngine, follow
from tandem.colocated_node.tp_processes import build_engine, join_rank
from tandem.engine.config import EngineConfig
from tandem.router import Router, RouterConfig
from tandem.spec.config import SpecConfig
from tandem.worker import node_ip, tune_process
from tandem.worker.process import serving_host
from tandem.worker.ranks import RankInfo, leave_group, rendezvous_address

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
    """Owns one engine, its router and the gRPC server in front of them. With `tp` > 1 it is
    one rank of `tp` (one Ray actor each, one GPU each): every rank joins the process group
    (`rendezvous` on rank 0, then `join` on every rank) and builds its share of the engine;
    rank 0 serves, driving the ranks in lockstep (lockstep.py)."""

    def __init__(self, cfg: ColocatedServerConfig, rank: int = 0, tp: int = 1,
                 ep: int = 1) -> None:
        tune_process()  # the same process settings as the disaggregated workers
        if cfg.torch_threads:
            import torch

            torch.set_num_threads(cfg.torch_threads)
        self.cfg, self.ranks = cfg, RankInfo(rank=rank, tp=tp, ep=ep)
        self._server = self._host = self._dispatcher = None
        self._lockstep: LockstepEngine | None = None
        self._follower: threading.Thread | None = None
        if tp == 1:
            t0 = time.perf_counter()
            engine = build_engine(cfg.engine, cfg.spec)
            log.info("colocated engine built in %.1f s", time.perf_counter() - t0)
            self._serve(engine)

    def _serve(self, engine) -> None:
        # grpc loads when a server starts, not with this module
        from tandem.router.app import BackgroundServer
        from tandem.router.server import ServerConfig

        router = build_colocated_router(engine, model=self.cfg.model_name)
        self._dispatcher = router.dispatcher
        host = self.cfg.host or serving_host()
        self._server = BackgroundServer(router, ServerConfig(host=host, port=0)).start()
        self._host = node_ip() if host in ("0.0.0.0", "::") else host
        log.info("colocated server for '%s' (tp=%d) on %s", self.cfg.model_name,
                 self.ranks.tp, self.address())

    def rendezvous(self) -> tuple[str, int]:
        """Rank 0 of tp > 1: where the ranks' process group meets."""
        return rendezvous_address()

    def join(self, host: str, port: int) -> None:
        """tp > 1, every rank: join the process group and build this rank's engine; rank 0
        then serves, the others follow it on a thread of their own."""
        t0 = time.perf_counter()
        engine, sync = join_rank(self.ranks, host, port, self.cfg.engine, self.cfg.spec)
        log.info("colocated engine rank %d/%d built in %.1f s", self.ranks.rank, self.ranks.tp,
                 time.perf_counter() - t0)
        if self.ranks.rank == 0:
            self._lockstep = LockstepEngine(engine, sync)
            self._serve(self._lockstep)
            return
        self._follower = threading.Thread(target=follow, args=(engine, sync),
                                          name="colocated-follow", daemon=True)
        self._follower.start()

    def address(self) -> str:
        """host:port of the gRPC server (rank 0)."""
        if self._server is None:
            raise RuntimeError("address: this rank serves nothing (rank 0 of a joined group "
                               "does)")
        return f"{self._host}:{self._server.port}"

    def shutdown(self) -> None:
        if self._server is not None:
            self._server.stop()
            self._dispatcher.stop_loops()  # no step after this
        if self._lockstep is not None:
            self._lockstep.close()  # the other ranks' follow returns
        if self._follower is not None:
            self._follower.join(timeout=30.0)
        if self.ranks.tp > 1:
            leave_group()
