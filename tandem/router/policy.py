"""Placement policies: which of the healthy candidate workers gets a request.

A policy sees `WorkerState`s (the dispatcher's last report plus the router's own count of
requests it placed there and that have not ended -- fresher than any report) and a
`PlacementQuery`. It returns one of the candidates; the list is never empty. Policies own only
their own cursor/RNG state. `make_policy(name)` is the registry the CLI uses.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from tandem.router.dispatch import WorkerInfo


@dataclass(frozen=True, slots=True, kw_only=True)
class WorkerState:
    info: WorkerInfo
    num_assigned: int  # requests the router placed on this worker that have not ended
    quarantined: bool = False  # the router saw it fail recently (not a candidate)

    @property
    def name(self) -> str:
        return self.info.name

    @property
    def healthy(self) -> bool:
        return self.info.healthy and not self.quarantined


@dataclass(frozen=True, slots=True, kw_only=True)
class PlacementQuery:
    model: str
    prompt_ids: tuple[int, ...]  # for prefix-cache-aware placement
    num_tokens: int  # prompt + max new tokens: the KV slots the request may hold


class Policy(Protocol):
    name: str

    def pick(self, candidates: Sequence[WorkerState], query: PlacementQuery) -> WorkerState: ...


class RoundRobin:
    """Candidates in name order, one after the other."""

    name = "round-robin"

    def __init__(self) -> None:
        self._next = 0

    def pick(self, candidates: Sequence[WorkerState], query: PlacementQuery) -> WorkerState:
        ordered = sorted(candidates, key=lambda w: w.name)
        chosen = ordered[self._next % len(ordered)]
        self._next += 1
        return chosen


class LeastLoad:
    """Fewest requests in flight (router's count first, then the worker's own queue), then the
    lowest KV load, then the name (deterministic ties)."""

    name = "least-load"

    def pick(self, candidates: Sequence[WorkerState], query: PlacementQuery) -> WorkerState:
        return min(candidates, key=_load_key)


class PowerOfTwo:
    """Two candidates at random; the one with the lower KV load (then fewer requests). Avoids
    the herd that pure least-load causes between load reports (decode side)."""

    name = "power-of-two"

    def __init__(self, seed: int | None = None) -> None:
        self._rng = random.Random(seed)

    def pick(self, candidates: Sequence[WorkerState], query: PlacementQuery) -> WorkerState:
        if len(candidates) == 1:
            return candidates[0]
        a, b = self._rng.sample(list(candidates), 2)
        return min((a, b), key=lambda w: (w.info.kv_load, w.num_assigned, w.name))


class PrefixCacheAware:
    """Prefill placement by cached prefix.

    TODO: keep a radix tree of the prompt prefixes recently sent to each prefill worker and pick
    the worker with the longest match, unless its load exceeds the least-loaded one's by more
    than a threshold (SGLang's cache-aware policy). Needs the prefill workers' prefix cache,
    which does not exist yet; until then this is least-load.
    """

    name = "prefix-cache"

    def __init__(self) -> None:
        self._fallback = LeastLoad()

    def pick(self, candidates: Sequence[WorkerState], query: PlacementQuery) -> WorkerState:
        return self._fallback.pick(candidates, query)


def _load_key(w: WorkerState) -> tuple[int, int, float, str]:
    return (w.num_assigned, w.info.num_running + w.info.num_waiting, w.info.kv_load, w.name)


POLICIES: dict[str, Callable[[], Policy]] = {
    RoundRobin.name: RoundRobin,
    LeastLoad.name: LeastLoad,
    PowerOfTwo.name: PowerOfTwo,
    PrefixCacheAware.name: PrefixCacheAware,
}


def make_policy(name: str, field: str = "policy") -> Policy:
    factory = POLICIES.get(name)
    if factory is None:
        raise ValueError(f"{field}: unknown placement policy '{name}' (one of "
                         f"{', '.join(sorted(POLICIES))})")
    return factory()
