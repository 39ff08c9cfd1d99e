"""Placement policies: which of the healthy candidate workers gets a request.

A policy sees `WorkerState`s (the dispatcher's last report plus the router's own count of
requests it placed there and that have not ended -- fresher than any report) and a
`PlacementQuery`. It returns one of the candidates; the list is never empty. Policies own only
their own cursor/RNG state. `make_policy(name)` is the registry the CLI uses.
"""

from __future__ import annotations

import random
from collections import OrderedDict
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
    """Prefill placement by shared prompt prefix (SGLang's cache-aware idea, approximated with
    block hashes instead of a radix tree).

    The prompt is cut into blocks of `block` tokens; block i's key hashes blocks 0..i, so two
    prompts share key i exactly when they share their first (i+1)*block tokens. For every
    worker the policy remembers (LRU, bounded) the keys of prompts it sent there. A request goes
    to the worker holding its longest prefix -- where a prefix cache would already have those
    pages -- unless that worker has `max_imbalance` more requests in flight than the least
    loaded one; with no match it goes to the least loaded worker.
    """

    name = "prefix-cache"

    def __init__(self, block: int = 16, max_imbalance: int = 4,
                 max_keys_per_worker: int = 200_000) -> None:
        self.block, self.max_imbalance, self.max_keys = block, max_imbalance, max_keys_per_worker
        self._fallback = LeastLoad()
        self._keys: dict[str, OrderedDict[int, None]] = {}

    def block_keys(self, prompt_ids: Sequence[int]) -> list[int]:
        keys, h = [], 0
        for i in range(len(prompt_ids) // self.block):
            h = hash((h, tuple(prompt_ids[i * self.block : (i + 1) * self.block])))
            keys.append(h)
        return keys

    def matched_blocks(self, worker: str, keys: Sequence[int]) -> int:
        held = self._keys.get(worker)
        if not held:
            return 0
        n = 0
        for k in keys:  # a chain: block i can only match if block i-1 did
            if k not in held:
                break
            n += 1
        return n

    def pick(self, candidates: Sequence[WorkerState], query: PlacementQuery) -> WorkerState:
        keys = self.block_keys(query.prompt_ids)
        least = self._fallback.pick(candidates, query)
        best = max(candidates, key=lambda w: (self.matched_blocks(w.name, keys),
                                              -w.num_assigned, w.name == least.name))
        if (self.matched_blocks(best.name, keys) == 0
                or best.num_assigned - least.num_assigned > self.max_imbalance):
            best = least
        held = self._keys.setdefault(best.name, OrderedDict())
        for k in keys:
            held[k] = None
            held.move_to_end(k)
        while len(held) > self.max_keys:
            held.popitem(last=False)
        return best


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
