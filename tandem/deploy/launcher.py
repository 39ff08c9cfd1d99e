"""Starts a deployment on a Ray cluster: N prefill and M decode actors, each gang-scheduled in
its own placement group (one bundle per worker for now; a TP group becomes one bundle per rank,
STRICT_PACK), waits until every actor is up, and stops them all on `shutdown`.

Owns the actor handles and placement groups of one deployment.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

from tandem.deploy.actors import QUIET_ENV, DecodeActor, PrefillActor
from tandem.deploy.config import DeployConfig, GroupConfig
from tandem.deploy.worker_config import WorkerConfig

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Deployment:
    cfg: DeployConfig
    prefill: dict[str, object]  # name -> Ray actor handle
    decode: dict[str, object]
    placement_groups: list[object]
    endpoints: dict[str, bytes]  # decode worker name -> encoded EndpointInfo

    def shutdown(self) -> None:
        import ray

        for handle in [*self.prefill.values(), *self.decode.values()]:
            try:
                ray.get(handle.shutdown.remote(), timeout=15)
            except Exception:  # already dead: nothing to stop
                pass
            ray.kill(handle, no_restart=True)
        for pg in self.placement_groups:
            ray.util.remove_placement_group(pg)


def init_ray(address: str | None = None, num_cpus: int | None = None) -> None:
    """Connect to `address` (or RAY_ADDRESS), else start a local Ray instance."""
    import ray

    if ray.is_initialized():
        return
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    env = {"env_vars": dict(QUIET_ENV)}
    if address or os.environ.get("RAY_ADDRESS"):
        ray.init(address=address or os.environ["RAY_ADDRESS"], runtime_env=env,
                 log_to_driver=False)
    else:
        ray.init(num_cpus=num_cpus, runtime_env=env, include_dashboard=False,
                 log_to_driver=False)


def _start(cls: type, role: str, name: str, group: GroupConfig, wcfg: WorkerConfig,
           pgs: list[object]):
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    bundle: dict[str, float] = {"CPU": group.num_cpus, **group.resources}
    if group.num_gpus:
        bundle["GPU"] = group.num_gpus
    pg = ray.util.placement_group([bundle], strategy="STRICT_PACK", name=f"tandem-{name}")
    pgs.append(pg)
    remote = ray.remote(cls).options(
        name=f"tandem-{name}", num_cpus=group.num_cpus, num_gpus=group.num_gpus,
        resources=group.resources or None, max_concurrency=64, max_restarts=0,
        scheduling_strategy=PlacementGroupSchedulingStrategy(placement_group=pg),
    )
    log.info("starting %s worker %s", role, name)
    return remote.remote(wcfg)


def launch(cfg: DeployConfig, startup_timeout_s: float = 300.0) -> Deployment:
    """Start every worker and wait until all answer; raises with the failing worker's error."""
    import ray

    pgs: list[object] = []
    prefill, decode = {}, {}

    def worker_cfg(name: str, group: GroupConfig) -> WorkerConfig:
        return WorkerConfig(name=name, engine=cfg.engine, spec=cfg.spec,
                            transfer_backend=cfg.transfer_backend,
                            transfer_timeout_s=cfg.transfer_timeout_s,
                            torch_threads=group.torch_threads, endpoint=cfg.endpoint,
                            faults=group.faults)

    for i in range(cfg.prefill.replicas):
        name = f"prefill-{i}"
        prefill[name] = _start(PrefillActor, "prefill", name, cfg.prefill,
                               worker_cfg(name, cfg.prefill), pgs)
    for i in range(cfg.decode.replicas):
        name = f"decode-{i}"
        decode[name] = _start(DecodeActor, "decode", name, cfg.decode,
                              worker_cfg(name, cfg.decode), pgs)
    dep = Deployment(cfg=cfg, prefill=prefill, decode=decode, placement_groups=pgs, endpoints={})
    try:
        names = [*prefill, *decode]
        refs = [h.endpoint.remote() for h in [*prefill.values(), *decode.values()]]
        values = ray.get(refs, timeout=startup_timeout_s)
        dep.endpoints = {n: v for n, v in zip(names, values) if n in decode}
    except Exception:
        dep.shutdown()
        raise
    log.info("deployment up: %d prefill, %d decode workers (%s)", len(prefill), len(decode),
             cfg.transfer_backend)
    return dep
