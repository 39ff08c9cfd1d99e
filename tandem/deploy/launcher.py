"""Starts a deployment on a Ray cluster: N prefill and M decode workers, each gang-scheduled in
its own placement group with one bundle per rank (tp * dp of them; STRICT_PACK: a worker's ranks
share a node, as TP and DP attention need fast links), one actor per bundle. A worker of more
than one rank then meets in a torch.distributed group at its rank 0's address. Waits until every worker is up and stops them
all on `shutdown`.

Owns the actor handles and placement groups of one deployment.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field

from tandem.deploy.actors import FAST_DEATH_ENV, DecodeActor, PrefillActor
from tandem.deploy.config import DeployConfig, GroupConfig
from tandem.deploy.resources import (PlacementError, check_cluster, deployment_needs,
                                     group_bundle, wait_placed)
from tandem.engine.config import ConfigError
from tandem.worker import QUIET_ENV, WorkerConfig

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Deployment:
    cfg: DeployConfig
    prefill: dict[str, object]  # name -> Ray actor handle of the worker's rank 0
    decode: dict[str, object]
    placement_groups: list[object]
    endpoints: dict[str, bytes]  # decode worker name -> every rank's EndpointInfo (one blob)
    followers: list[object] = field(default_factory=list)  # ranks 1.. of every multi-rank worker

    def shutdown(self) -> None:
        import ray

        # Leaders first: their shutdown stops their followers' loops.
        for handle in [*self.prefill.values(), *self.decode.values(), *self.followers]:
            try:
                ray.get(handle.shutdown.remote(), timeout=15)
            except Exception:  # already dead: nothing to stop
                pass
            ray.kill(handle, no_restart=True)
        for pg in self.placement_groups:
            ray.util.remove_placement_group(pg)

    def release(self) -> None:
        """Kill every actor and remove every placement group at once: for a launch whose
        workers were never placed (asking them to shut down would wait on actors that do not
        exist yet)."""
        import ray

        for handle in [*self.prefill.values(), *self.decode.values(), *self.followers]:
            ray.kill(handle, no_restart=True)
        for pg in self.placement_groups:
            ray.util.remove_placement_group(pg)


LOCAL_MIN_CPUS = 4  # CPU slots of a local Ray instance at least (init_ray)


def init_ray(address: str | None = None, num_cpus: int | None = None) -> None:
    """Connect to `address` (or RAY_ADDRESS, or the cluster `ray start` runs on this machine),
    else start a local Ray instance; with Ray token authentication unless RAY_AUTH_MODE=disabled
    (ray_auth.py). The workers of a local instance advertise - and their KV transfer listeners
    accept - 127.0.0.1 only (a joined cluster's: their node's IP; kvtransfer/bind.py); the
    workers run with the bind() shim preloaded, which binds those listeners to that address."""
    import ray

    from tandem.deploy.ray_auth import cluster_to_join, configure_ray_auth
    from tandem.kvtransfer import KV_HOST_ENV

    if ray.is_initialized():
        return
    joining = cluster_to_join(address) is not None
    configure_ray_auth(joining=joining)
    for k, v in FAST_DEATH_ENV.items():  # this process's core worker (the router's calls)
        os.environ.setdefault(k, v)
    env = {"env_vars": {**QUIET_ENV, **FAST_DEATH_ENV, **_bind_shim_env()}}
    if joining:
        ray.init(address=address, runtime_env=env, log_to_driver=False)
    else:
        env["env_vars"][KV_HOST_ENV] = os.environ.get(KV_HOST_ENV) or "127.0.0.1"
        # Ray's CPU count is placement, not a measure of what this machine can run: a local
        # instance offers at least LOCAL_MIN_CPUS slots, so the bundled configs place on a
        # small machine as they do on a cluster of that size (serve, bench and demo alike).
        cpus = num_cpus if num_cpus is not None else max(LOCAL_MIN_CPUS, os.cpu_count() or 1)
        ray.init(num_cpus=cpus, runtime_env=env, include_dashboard=False, log_to_driver=False)


def _bind_shim_env() -> dict[str, str]:
    """LD_PRELOAD of the bind() shim for the job's workers (kvtransfer/bindshim.py), built here
    if this machine has not yet; none if it cannot be built (the listeners are then filtered)."""
    from tandem.kvtransfer.bindshim import build, preload_value

    path = build()
    return {"LD_PRELOAD": preload_value(path)} if path is not None else {}


def actor_runtime_env() -> dict | None:
    """What every tandem actor's `runtime_env` adds to the job's: the request-trace file when
    this process marks stages (tandem/trace.py), the OTLP collector and OTEL_* settings when it
    exports spans (tandem/otel.py). A job's environment is fixed when Ray starts, so a bench
    that turns tracing on in a Ray instance already running passes it per actor."""
    from tandem import otel, trace

    env = {**trace.env_vars(), **otel.env_vars()}
    return {"env_vars": env} if env else None


# Call slots of a worker actor. Every call is short -- request calls (`submit`, `reserve`) queue
# work for the worker loop and return; control calls (health, abort, route) answer from the
# actor's state -- except one `events` stream per router (worker/channels.py). So the slots bound
# how many calls are in flight at once, never how many requests run, and a control call never
# waits for a slot behind requests. (No Ray concurrency groups: Ray runs each group of an async
# actor on an event loop of its own, and the actor's state lives on one loop.)
CALL_SLOTS = 1024


def _start(cls: type, role: str, name: str, group: GroupConfig, wcfg: WorkerConfig,
           pgs: list[object]) -> list[object]:
    """The worker's actors, rank order (not yet joined)."""
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    bundle = group_bundle(group)
    pg = ray.util.placement_group([dict(bundle) for _ in range(group.world_size)],
                                  strategy="STRICT_PACK", name=f"tandem-{name}")
    pgs.append(pg)
    log.info("starting %s worker %s (tp=%d, dp=%d, ep=%d)", role, name, group.tp, group.dp,
             group.ep)
    ranks = []
    for rank in range(group.world_size):
        remote = ray.remote(cls).options(
            name=f"tandem-{name}" if rank == 0 else f"tandem-{name}-rank{rank}",
            num_cpus=group.num_cpus, num_gpus=group.num_gpus,
            resources=group.resources or None, max_concurrency=CALL_SLOTS,
            max_restarts=group.max_restarts if group.world_size == 1 else 0,
            runtime_env=actor_runtime_env(),
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                placement_group=pg, placement_group_bundle_index=rank),
        )
        ranks.append(remote.remote(wcfg, rank, group.tp, group.ep, group.dp))
    return ranks


def _join(workers: list[list[object]], timeout_s: float) -> None:
    """Every multi-rank worker's ranks meet at their rank 0's address (all workers at once)."""
    import ray

    multi = [ranks for ranks in workers if len(ranks) > 1]
    if not multi:
        return
    addrs = ray.get([ranks[0].rendezvous.remote() for ranks in multi], timeout=timeout_s)
    refs = [r.join.remote(host, port) for ranks, (host, port) in zip(multi, addrs)
            for r in ranks]
    ray.get(refs, timeout=timeout_s)


def check_kv_reslice(prefill_endpoint: bytes, decode_endpoint: bytes) -> None:
    """ConfigError naming `prefill.tp` / `decode.tp` unless KV moves between the two workers:
    equal TP sizes, or the model's KV heads (stated in every endpoint's CompatInfo) split evenly
    over both sizes. Checked at startup so a bad pairing fails `launch`, not the first request."""
    import json

    from tandem.kvtransfer import EndpointInfo
    from tandem.kvtransfer.reslice import reslice_problem

    p, d = (EndpointInfo.decode(json.loads(blob)[0].encode()).compat
            for blob in (prefill_endpoint, decode_endpoint))
    if p.tp_size == d.tp_size:
        return
    why = (reslice_problem(p.num_kv_heads, p.tp_size, d.tp_size) if p.num_kv_heads
           else "prefill.tp: the workers do not state num_kv_heads")
    if why:
        raise ConfigError(f"{why}; prefill.tp {p.tp_size} and decode.tp {d.tp_size} cannot "
                          "re-slice the model's KV heads")


def launch(cfg: DeployConfig, startup_timeout_s: float = 300.0) -> Deployment:
    """Start every worker and wait until all answer; raises with the failing worker's error.
    A deployment the cluster cannot hold is refused before anything is placed, and workers
    not placed within `cfg.placement.timeout_s` fail the launch (resources.py); either way
    nothing stays reserved."""
    import ray

    # Refuse at once what cannot fit the cluster (nothing is reserved yet).
    check_cluster(deployment_needs(cfg), cfg.placement.check)
    pgs: list[object] = []
    named: list[tuple[str, object]] = []  # (worker, its placement group)
    prefill, decode = {}, {}

    def worker_cfg(name: str, group: GroupConfig) -> WorkerConfig:
        return WorkerConfig(name=name, engine=cfg.engine, spec=cfg.spec,
                            transfer_backend=cfg.transfer_backend,
                            transfer_timeout_s=cfg.transfer_timeout_s,
                            torch_threads=group.torch_threads, endpoint=cfg.endpoint,
                            faults=group.faults, layerwise_push=group.layerwise_push)

    followers: list[object] = []
    started: list[list[object]] = []
    for role, cls, group in (("prefill", PrefillActor, cfg.prefill),
                             ("decode", DecodeActor, cfg.decode)):
        for i in range(group.replicas):
            name = f"{role}-{i}"
            ranks = _start(cls, role, name, group, worker_cfg(name, group), pgs)
            named.append((name, pgs[-1]))
            (prefill if role == "prefill" else decode)[name] = ranks[0]
            followers += ranks[1:]
            started.append(ranks)
    dep = Deployment(cfg=cfg, prefill=prefill, decode=decode, placement_groups=pgs, endpoints={},
                     followers=followers)
    try:
        wait_placed(named, cfg.placement.timeout_s)
    except PlacementError:
        dep.release()
        raise
    try:
        _join(started, startup_timeout_s)
        names = [*prefill, *decode]
        refs = [h.endpoint.remote() for h in [*prefill.values(), *decode.values()]]
        values = ray.get(refs, timeout=startup_timeout_s)
        dep.endpoints = {n: v for n, v in zip(names, values) if n in decode}
        for n, v in zip(names, values):  # every prefill worker can feed every decode worker
            if n in prefill:
                for blob in dep.endpoints.values():
                    check_kv_reslice(v, blob)
    except Exception:
        dep.shutdown()
        raise
    log.info("deployment up: %d prefill, %d decode workers (%s)", len(prefill), len(decode),
             cfg.transfer_backend)
    return dep
