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
    from tandem.engine.tokenizer import Tokenizer

    _, path = resolve_model(cfg.engine)
    if path is None or not (path / "tokenizer.json").is_file():
        log.warning("model '%s' has no tokenizer.json: only prompt_token_ids requests can be "
                    "served", cfg.engine.model)
        return None
    return Tokenizer.from_dir(path)


def build_disaggregated_router(dep: Deployment, router_cfg: RouterConfig | None = None
                               ) -> Router:
    import ray

    limits = [ray.get(h.limits.remote()) for h in dep.decode.values()]
    vocab, max_len = limits[0][0], min(x[1] for x in limits)
    model = ModelInfo(name=dep.cfg.model_name, vocab_size=vocab, max_model_len=max_len,
                      max_request_tokens=min(x[2] for x in limits))
    dispatcher = DisaggregatedDispatcher(dep.prefill, dep.decode, dep.endpoints, model,
                                         num_steps=dep.cfg.spec.num_steps)
    return Router(dispatcher, {dep.cfg.model_name: load_tokenizer(dep.cfg)},
                  router_cfg or RouterConfig())


def launch_and_build(cfg: DeployConfig, router_cfg: RouterConfig | None = None
                     ) -> tuple[Deployment, Router]:
    dep = launch(cfg)
    try:
        return dep, build_disaggregated_router(dep, router_cfg)
    except Exception:
        dep.shutdown()
        raise
