"""Choosing the prefill and the decode worker of one request: pinned names are checked, the
rest is left to the policies. Pure apart from the policies' own cursors; raises `RouterError`s
that name `prefill_worker` / `decode_worker`."""

from __future__ import annotations

from tandem.router.dispatch import Placement, WorkerRole
from tandem.router.errors import Code, RouterError, invalid
from tandem.router.policy import PlacementQuery, Policy, WorkerState
from tandem.router.registry import WorkerRegistry


def place(registry: WorkerRegistry, query: PlacementQuery, prefill_policy: Policy,
          decode_policy: Policy, pinned_prefill: str = "", pinned_decode: str = "") -> Placement:
    """Prefill first; a colocated prefill worker also decodes. Decode is picked among decode
    workers (never a colocated one for a disaggregated prefill: its pool is not a KV target)."""
    if pinned_prefill:
        prefill = _pinned(registry, "prefill_worker", pinned_prefill, query.model, prefill=True)
    else:
        candidates = registry.candidates(query.model, prefill=True)
        if not candidates:
            raise RouterError(Code.UNAVAILABLE, _none_healthy(registry, query.model, "prefill"))
        prefill = prefill_policy.pick(candidates, query)
    if prefill.info.role is WorkerRole.COLOCATED:
        if pinned_decode and pinned_decode != prefill.name:
            raise invalid(f"decode_worker: '{prefill.name}' is a colocated worker and decodes its "
                          f"own requests; decode_worker must be empty or '{prefill.name}', got "
                          f"'{pinned_decode}'")
        return Placement(prefill_worker=prefill.name, decode_worker=prefill.name)
    if pinned_decode:
        decode = _pinned(registry, "decode_worker", pinned_decode, query.model, prefill=False)
        if decode.info.role is not WorkerRole.DECODE:
            raise invalid(f"decode_worker: '{decode.name}' is a {decode.info.role.value} worker; "
                          f"a request prefilled on '{prefill.name}' needs a decode worker")
    else:
        candidates = [c for c in registry.candidates(query.model, prefill=False)
                      if c.info.role is WorkerRole.DECODE]
        if not candidates:
            raise RouterError(Code.UNAVAILABLE, _none_healthy(registry, query.model, "decode"))
        decode = decode_policy.pick(candidates, query)
    return Placement(prefill_worker=prefill.name, decode_worker=decode.name)


def _pinned(registry: WorkerRegistry, field: str, name: str, model: str, *, prefill: bool
            ) -> WorkerState:
    state = registry.get(name)
    if state is None:
        raise RouterError(Code.NOT_FOUND, f"{field}: no worker named '{name}' (workers: "
                                          f"{', '.join(registry.names()) or 'none'})")
    role = state.info.role
    if not (role.can_prefill if prefill else role.can_decode):
        raise invalid(f"{field}: '{name}' is a {role.value} worker")
    if state.info.model != model:
        raise invalid(f"{field}: '{name}' serves model '{state.info.model}', not '{model}'")
    if not state.healthy:
        raise RouterError(Code.UNAVAILABLE, f"{field}: worker '{name}' is unhealthy: "
                                            f"{state.info.error or 'no reason given'}")
    return state


def _none_healthy(registry: WorkerRegistry, model: str, kind: str) -> str:
    states = ", ".join(f"{s.name}={'up' if s.healthy else 'down'}" for s in registry.states())
    return f"model: no healthy {kind} worker for model '{model}' (workers: {states or 'none'})"
