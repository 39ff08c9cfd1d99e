"""What a deployment asks of the Ray cluster, checked before anything is placed, and placement
that fails in bounded time instead of waiting forever.

A launch on a cluster too small for it used to hang: Ray keeps a placement group or actor that
cannot be placed pending for as long as its creator waits (a Ray job on a 2-CPU head reserved
both CPUs for the workers, and the router's actor waited 15 minutes). Now:

1. `check_fits(needs, nodes)` compares what every worker (its ranks share one node: STRICT_PACK)
   and every helper actor asks for with the alive nodes' resources: the totals per resource,
   each worker's ranks on one node, then all of them together (first-fit, largest first). A
   deployment that cannot fit is refused at once by a `PlacementError` naming the resource,
   what each part asks, what the cluster has, and the config field to change.
2. `wait_placed(groups, timeout_s)` waits for the placement groups (`placement.timeout_s`,
   default 30 s); the launcher then removes every group and actor it made and raises a
   `PlacementError` naming the groups not placed and the cluster's free resources (another job
   may hold them, or an autoscaler may not have brought the node yet).

Helper actors ask for no CPU (the bench's router actor: its work is I/O and light), so they
never compete with the workers for placement.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from tandem.deploy.config import DeployConfig, GroupConfig
from tandem.engine.config import ConfigError

_EPS = 1e-4  # Ray's resource granularity
_FIELD = {"CPU": "num_cpus", "GPU": "num_gpus"}
_SHOWN = ("CPU", "GPU")  # named in "the cluster has ... free" when the cluster has them


class PlacementError(ConfigError):
    """The deployment cannot be placed on this cluster (as configured)."""


@dataclass(frozen=True, slots=True)
class Need:
    """One gang of bundles that must share a node: a worker's ranks, or a helper actor."""

    who: str  # "prefill-0", "colocated server"
    role: str  # config section whose fields set it ("prefill", "decode")
    bundle: Mapping[str, float]  # per rank: {"CPU": 1.0, "GPU": 1.0, custom...}
    ranks: int = 1

    def total(self, resource: str) -> float:
        return self.bundle.get(resource, 0.0) * self.ranks

    def gang(self) -> dict[str, float]:
        return {r: v * self.ranks for r, v in self.bundle.items() if v > 0}

    def field(self, resource: str) -> str:
        key = _FIELD.get(resource, f"resources.{resource}")
        return f"{self.role}.{key}"


def group_bundle(group: GroupConfig) -> dict[str, float]:
    """A rank's placement-group bundle (what the launcher reserves)."""
    bundle: dict[str, float] = {"CPU": group.num_cpus, **group.resources}
    if group.num_gpus:
        bundle["GPU"] = group.num_gpus
    return bundle


def deployment_needs(cfg: DeployConfig) -> list[Need]:
    """Every worker of a disaggregated deployment."""
    return [Need(who=f"{role}-{i}", role=role, bundle=group_bundle(group),
                 ranks=group.world_size)
            for role, group in (("prefill", cfg.prefill), ("decode", cfg.decode))
            for i in range(group.replicas)]


def _fmt(resources: Mapping[str, float]) -> str:
    return ", ".join(f"{v:g} {r}" for r, v in sorted(resources.items())) or "nothing"


def _have(nodes: Sequence[Mapping[str, float]], resource: str) -> str:
    per_node = " + ".join(f"{n.get(resource, 0.0):g}" for n in nodes)
    return f"{sum(n.get(resource, 0.0) for n in nodes):g} ({per_node} on {len(nodes)} node(s))"


def check_fits(needs: Sequence[Need], nodes: Sequence[Mapping[str, float]]) -> None:
    """PlacementError unless `needs` fit `nodes` (each node's resources) all at once."""
    if not nodes:
        raise PlacementError("placement: the Ray cluster has no alive node")
    resources = sorted({r for n in needs for r, v in n.bundle.items() if v > 0})
    for res in resources:  # 1. the totals
        want = sum(n.total(res) for n in needs)
        if want > sum(node.get(res, 0.0) for node in nodes) + _EPS:
            parts = ", ".join(f"{n.who} {n.total(res):g}" for n in needs if n.total(res))
            fields = " / ".join(dict.fromkeys(n.field(res) for n in needs if n.total(res)))
            raise PlacementError(
                f"{fields}: the deployment needs {want:g} {res} in all ({parts}); the cluster "
                f"has {_have(nodes, res)}: lower {fields}, fewer replicas, or add nodes with {res}")
    for n in needs:  # 2. each gang on one node
        gang = n.gang()
        if not any(_fits(gang, node) for node in nodes):
            res = next(r for r in sorted(gang) if max(node.get(r, 0.0) for node in nodes)
                       < gang[r] - _EPS)
            best = max(node.get(res, 0.0) for node in nodes)
            raise PlacementError(
                f"{n.field(res)}: {n.who} needs {gang[res]:g} {res} on one node ({n.ranks} "
                f"rank(s) x {n.bundle[res]:g}; a worker's ranks share a node); the largest node "
                f"has {best:g}: lower {n.field(res)} or {n.role}.tp/dp, or add a bigger node")
    free = [dict(node) for node in nodes]  # 3. all together: first fit, largest first
    for n in sorted(needs, key=lambda n: tuple(-n.total(r) for r in ("GPU", "CPU"))):
        gang = n.gang()
        slot = next((node for node in free if _fits(gang, node)), None)
        if slot is None:
            raise PlacementError(
                f"{n.role}: the workers fit the cluster's totals but not its nodes together: "
                f"{n.who} ({_fmt(gang)} on one node) finds no node with room left after the "
                f"larger workers (free per node then: "
                f"{'; '.join(_fmt({r: v for r, v in node.items() if r in gang}) for node in free)})"
                f": lower {n.role}.num_cpus/num_gpus, fewer replicas, or add a node")
        for r, v in gang.items():
            slot[r] -= v


def _fits(gang: Mapping[str, float], node: Mapping[str, float]) -> bool:
    return all(node.get(r, 0.0) + _EPS >= v for r, v in gang.items())


def cluster_nodes() -> list[dict[str, float]]:
    """The resources of each alive node of the connected Ray cluster (totals, not what is free:
    the check is about whether the deployment can ever fit; what others hold now shows as a
    placement timeout)."""
    import ray

    return [{r: float(v) for r, v in node["Resources"].items() if not r.startswith("node:")}
            for node in ray.nodes() if node.get("Alive")]


def check_cluster(needs: Sequence[Need], enabled: bool) -> None:
    """`check_fits` against the connected cluster, unless `placement.check` is off."""
    if enabled:
        check_fits(needs, cluster_nodes())


def wait_placed(groups: Sequence[tuple[str, object]], timeout_s: float) -> None:
    """Wait until every (name, placement group) is placed; PlacementError naming those that were
    not within `timeout_s` (the caller removes what it reserved)."""
    import ray

    deadline = time.monotonic() + timeout_s
    late = [(who, pg) for who, pg in groups
            if not pg.wait(max(0.0, deadline - time.monotonic()))]
    if not late:
        return
    free, total = ray.available_resources(), ray.cluster_resources()
    shown = {r: free.get(r, 0.0) for r in _SHOWN if r in total}
    for _, pg in late:
        shown.update({r: free.get(r, 0.0) for b in pg.bundle_specs for r in b})
    what = "; ".join(f"{who} ({len(pg.bundle_specs)} x {_fmt(pg.bundle_specs[0])})"
                     for who, pg in late)
    raise PlacementError(
        f"placement.timeout_s: not placed within {timeout_s:g} s: {what}; the cluster has "
        f"{_fmt(shown)} free (other jobs or deployments may hold the rest, or a node is still "
        "starting): free resources, or raise placement.timeout_s")
