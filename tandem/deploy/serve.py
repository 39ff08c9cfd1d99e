"""Putting a disaggregated deployment behind the gRPC router: launch the actors, build the
`DisaggregatedDispatcher` and the `Router` (tokenizer loaded in the router process)."""

from __future__ import annotations

import logging

from tandem.deploy.config import DeployConfig
from tandem.deploy.launcher import Deployment, launch
from tandem.router.disagg import DisaggregatedDispatcher
from tandem.router.dispatch import ModelInfo
from tandem.router.router import Router, RouterConfig

log = logging.getLogger(__name__)


def load_tokenizer(cfg: DeployConfig):
    from tandem.engine.loader import resolve_model
    from tandem.tokenizer import Tokenizer

    _, path = resolve_model(cfg.engine)
    if path is None or not (path / "tokenizer.json").is_file():
        log.warning("model '%s' has no tokenizer.json: only prompt_token_ids requests can be "
                    "served", cfg.engine.model)
        return None
    return Tokenizer.from_dir(path)


def build_disaggregated_router(dep: Deployment, router_cfg: RouterConfig | None = None
                               ) -> Router:
    return router_for(dep.cfg, dep.prefill, dep.decode, dep.endpoints, router_cfg)


def router_for(cfg: DeployConfig, prefill: dict[str, object], decode: dict[str, object],
               endpoints: dict[str, bytes], router_cfg: RouterConfig | None = None) -> Router:
    """The router over running worker actors (their handles and decode endpoints), in any
    process connected to their Ray cluster."""
    import ray

    limits = [ray.get(h.limits.remote()) for h in decode.values()]
    vocab, max_len = limits[0][0], min(x[1] for x in limits)
    model = ModelInfo(name=cfg.model_name, vocab_size=vocab, max_model_len=max_len,
                      max_request_tokens=min(x[2] for x in limits))
    dispatcher = DisaggregatedDispatcher(prefill, decode, endpoints, model,
                                         num_steps=cfg.spec.num_steps, admission=cfg.router)
    return Router(dispatcher, {cfg.model_name: load_tokenizer(cfg)}, router_cfg or RouterConfig())


class RouterActor:
    """The router of a running disaggregated deployment in a process of its own (a Ray actor
    the caller wraps with `ray.remote`), serving the gRPC API on `host`. `tandem bench` uses it
    so that its clients do not share a process -- and a GIL -- with the router they measure
    (as with `tandem serve`, whose process runs only the router)."""

    def __init__(self, cfg: DeployConfig, prefill: dict[str, object], decode: dict[str, object],
                 endpoints: dict[str, bytes], host: str | None = None) -> None:
        from tandem.router.app import BackgroundServer
        from tandem.router.server import ServerConfig
        from tandem.worker import node_ip, tune_process
        from tandem.worker.process import serving_host

        tune_process()
        router = router_for(cfg, prefill, decode, endpoints)
        host = host or serving_host()  # None: the node's advertised address, not the wildcard
        self._server = BackgroundServer(router, ServerConfig(host=host, port=0)).start()
        self._host = node_ip() if host in ("0.0.0.0", "::") else host
        log.info("router for '%s' on %s", cfg.model_name, self.address())

    def address(self) -> str:
        return f"{self._host}:{self._server.port}"

    def shutdown(self) -> None:
        self._server.stop()


def launch_and_build(cfg: DeployConfig, router_cfg: RouterConfig | None = None
                     ) -> tuple[Deployment, Router]:
    dep = launch(cfg)
    try:
        return dep, build_disaggregated_router(dep, router_cfg)
    except Exception:
        dep.shutdown()
        raise
