"""Starting and stopping what a bench config describes, on Ray (local, `--ray-address`, or the
cluster of a Ray job), and measuring the hardware floors of its model before it starts (while
its GPUs are still free).

- colocated: one `ColocatedServer` actor (tandem/colocated_node/server.py; resources of the
  config's `decode` group) that serves the gRPC API itself -- `decode.tp` of them, one per TP
  rank, rank 0 serving and driving the others in lockstep.
- disaggregated: the prefill and decode actors of `tandem.deploy.launcher`, and the router in
  an actor of its own (`RouterActor`): the bench's clients share no process with it, as with
  `tandem serve --config`, whose process runs only the router.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, replace

from tandem.bench.config import DeploymentSpec
from tandem.bench.dummy_head import DUMMY, write_dummy_head
from tandem.bench.floors import (DTYPE_BYTES, Bandwidth, ModelFloors, measure_link_bandwidth,
                                 measure_memory_bandwidth)
from tandem.engine.config import ModelConfig

log = logging.getLogger(__name__)
MEASURE_TIMEOUT_S = 180.0
# The disaggregated router's actor asks for no CPU: a helper (its work is network I/O and
# light), it must never wait for a CPU the workers hold (deploy/resources.py).
ROUTER_CPUS = 0


@dataclass(frozen=True, slots=True)
class StartedTarget:
    address: str  # host:port of the router
    close: Callable[[], None]


def model_config(spec: DeploymentSpec) -> ModelConfig | None:
    """The model's shape, read here (None when this node cannot read it, e.g. a checkpoint
    that exists only on the workers' nodes)."""
    from tandem.engine.loader import resolve_model

    try:
        return resolve_model(spec.deploy.engine)[0]
    except (ValueError, OSError) as exc:
        log.warning("%s: cannot read the model config here (%s): floors n/a", spec.source, exc)
        return None


def prepare(spec: DeploymentSpec, model: ModelConfig | None) -> DeploymentSpec:
    """Resolve `draft_model: dummy` into a random head directory of the model's shape."""
    if spec.deploy.spec.draft_model != DUMMY or not spec.speculative:
        return spec
    if model is None:
        raise ValueError(f"{spec.source}: spec.draft_model: dummy needs the model config")
    path = write_dummy_head(model, spec.deploy.engine.dtype)
    log.info("random EAGLE head for %s: %s", spec.deploy.engine.model, path)
    dep = spec.deploy
    return replace(spec, deploy=replace(dep, spec=replace(dep.spec, draft_model=str(path))))


def _ray_task(fn: Callable[[], Bandwidth], num_gpus: int, what: str) -> Bandwidth:
    import ray

    ref = ray.remote(num_gpus=num_gpus, num_cpus=0)(fn).remote()
    try:
        return ray.get(ref, timeout=MEASURE_TIMEOUT_S)
    except ray.exceptions.GetTimeoutError:
        ray.cancel(ref, force=True)
        return Bandwidth(bytes_per_s=None, method=f"{what}: no node with {num_gpus} free GPU(s)")
    except Exception as exc:  # noqa: BLE001 -- a failed measurement leaves the floor n/a
        return Bandwidth(bytes_per_s=None, method=f"{what} failed: {exc}")


def measure_floors(spec: DeploymentSpec, model: ModelConfig | None) -> ModelFloors:
    """HBM (or host memory) bandwidth where the workers run; the GPU link for disaggregated
    CUDA deployments. On CUDA both run as Ray tasks, so they land on a GPU node."""
    eng = spec.deploy.engine
    dtype_bytes = DTYPE_BYTES[eng.dtype]
    if eng.device.startswith("cuda"):
        memory = _ray_task(lambda: measure_memory_bandwidth("cuda"), 1, "HBM bandwidth")
        link = (_ray_task(measure_link_bandwidth, 2, "GPU link bandwidth")
                if spec.mode == "disaggregated"
                else Bandwidth(bytes_per_s=None, method="colocated: no transfer"))
    else:
        memory = measure_memory_bandwidth("cpu")
        link = Bandwidth(bytes_per_s=None, method=(
            "CPU deployment: loopback transfer, not measured" if spec.mode == "disaggregated"
            else "colocated: no transfer"))
    log.info("floors: memory %s; link %s", memory, link)
    return ModelFloors(model=model, dtype_bytes=dtype_bytes, memory=memory, link=link,
                       decode_tp=spec.deploy.decode.tp, decode_dp=spec.deploy.decode.dp)


def init(ray_address: str | None) -> None:
    from tandem.deploy.launcher import init_ray

    # The same defaults as `tandem serve` (init_ray): a local instance of at least 4 CPU
    # slots, or the cluster at --ray-address / $RAY_ADDRESS (inside a Ray job).
    init_ray(ray_address)


def start(spec: DeploymentSpec, startup_timeout_s: float = 900.0) -> StartedTarget:
    if spec.mode == "colocated":
        return _start_colocated(spec, startup_timeout_s)
    return _start_disaggregated(spec, startup_timeout_s)


def _start_colocated(spec: DeploymentSpec, startup_timeout_s: float) -> StartedTarget:
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from tandem.colocated_node import ColocatedServer, ColocatedServerConfig
    from tandem.deploy.launcher import actor_runtime_env
    from tandem.deploy.resources import Need, check_cluster, group_bundle, wait_placed

    dep, group = spec.deploy, spec.deploy.decode
    cfg = ColocatedServerConfig(model_name=dep.model_name, engine=dep.engine,
                                spec=dep.spec if spec.speculative else None,
                                torch_threads=group.torch_threads)
    # The server's resources (the config's `decode` group: one bundle per TP rank) in a
    # placement group of its own: checked against the cluster first, then placed within
    # placement.timeout_s or released.
    need = Need(who="colocated server", role="decode", bundle=group_bundle(group),
                ranks=group.tp)
    check_cluster([need], dep.placement.check)
    pg = ray.util.placement_group([dict(need.bundle) for _ in range(group.tp)],
                                  strategy="STRICT_PACK", name="tandem-colocated")
    try:
        wait_placed([(need.who, pg)], dep.placement.timeout_s)
    except Exception:
        ray.util.remove_placement_group(pg)
        raise
    ranks: list = []

    def create():
        for rank in range(group.tp):
            ranks.append(ray.remote(ColocatedServer).options(
                name=None, num_cpus=group.num_cpus, num_gpus=group.num_gpus,
                resources=group.resources or None, max_restarts=0,
                runtime_env=actor_runtime_env(),
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=pg, placement_group_bundle_index=rank),
            ).remote(cfg, rank, group.tp, group.ep))
        if group.tp > 1:  # the ranks meet at rank 0's address, then each builds its share
            host, port = ray.get(ranks[0].rendezvous.remote(), timeout=startup_timeout_s)
            ray.get([r.join.remote(host, port) for r in ranks], timeout=startup_timeout_s)
        return ranks[0]

    def stop_all() -> None:
        for r in ranks[1:]:  # rank 0's shutdown (before this) released them from lockstep
            try:
                ray.get(r.shutdown.remote(), timeout=30)
            except Exception:  # noqa: BLE001 -- already dead: nothing to stop
                pass
            ray.kill(r, no_restart=True)
        ray.util.remove_placement_group(pg)

    return _serving_actor(create, startup_timeout_s, also_stop=stop_all)


def _start_disaggregated(spec: DeploymentSpec, startup_timeout_s: float) -> StartedTarget:
    import ray

    from tandem.deploy.launcher import actor_runtime_env, launch
    from tandem.deploy.serve import RouterActor

    dep = launch(spec.deploy)
    return _serving_actor(lambda: ray.remote(RouterActor).options(
        num_cpus=ROUTER_CPUS, max_restarts=0, runtime_env=actor_runtime_env()).remote(
            dep.cfg, dep.prefill, dep.decode, dep.endpoints),
        startup_timeout_s, also_stop=dep.shutdown)


def _serving_actor(create: Callable[[], object], startup_timeout_s: float,
                   also_stop: Callable[[], None] = lambda: None) -> StartedTarget:
    """An actor that serves the gRPC API (`address()`, `shutdown()`): created, waited for, and
    stopped with what it serves (`also_stop`) by the target's close -- or at once if it fails
    to come up."""
    import ray

    actor = None

    def close() -> None:
        if actor is not None:
            try:
                ray.get(actor.shutdown.remote(), timeout=30)
            except Exception:  # noqa: BLE001 -- already dead: nothing to stop
                pass
            ray.kill(actor, no_restart=True)
        also_stop()

    try:
        actor = create()
        address = ray.get(actor.address.remote(), timeout=startup_timeout_s)
    except Exception:
        if actor is not None:
            ray.kill(actor, no_restart=True)
        also_stop()
        raise
    return StartedTarget(address=address, close=close)
