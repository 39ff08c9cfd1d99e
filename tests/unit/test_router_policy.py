"""Placement policies, the worker registry (health, quarantine, in-flight counts) and placement
with pinned workers."""

from __future__ import annotations

from collections import Counter

import pytest

from tandem.router import (
    Code,
    LeastLoad,
    PlacementQuery,
    PowerOfTwo,
    PrefixCacheAware,
    RoundRobin,
    RouterError,
    WorkerInfo,
    WorkerRegistry,
    WorkerRole,
    WorkerState,
    make_policy,
)
from tandem.router.placement import place

Q = PlacementQuery(model="m", prompt_ids=(1, 2, 3), num_tokens=10)


def _w(name, role=WorkerRole.COLOCATED, model="m", free=8, pages=8, running=0, waiting=0,
       healthy=True) -> WorkerInfo:
    return WorkerInfo(name=name, role=role, model=model, num_free_pages=free, num_pages=pages,
                      num_running=running, num_waiting=waiting, healthy=healthy)


def _s(info: WorkerInfo, assigned: int = 0) -> WorkerState:
    return WorkerState(info=info, num_assigned=assigned)


def test_round_robin_cycles_in_name_order():
    rr = RoundRobin()
    ws = [_s(_w("b")), _s(_w("a")), _s(_w("c"))]
    assert [rr.pick(ws, Q).name for _ in range(6)] == ["a", "b", "c", "a", "b", "c"]


def test_least_load_prefers_router_count_then_queue_then_kv():
    ll = LeastLoad()
    assert ll.pick([_s(_w("a"), 2), _s(_w("b"), 1)], Q).name == "b"
    assert ll.pick([_s(_w("a", running=3)), _s(_w("b", running=1, waiting=1))], Q).name == "b"
    assert ll.pick([_s(_w("a", free=1)), _s(_w("b", free=5))], Q).name == "b"
    assert ll.pick([_s(_w("b")), _s(_w("a"))], Q).name == "a"  # deterministic tie-break


def test_power_of_two_picks_lower_kv_load_of_two():
    p2 = PowerOfTwo(seed=0)
    ws = [_s(_w("full", free=0)), _s(_w("half", free=4)), _s(_w("empty", free=8))]
    picks = Counter(p2.pick(ws, Q).name for _ in range(300))
    assert picks["full"] == 0  # it loses every comparison it is drawn into
    assert picks["empty"] > picks["half"] > 0
    assert PowerOfTwo().pick([ws[0]], Q).name == "full"  # single candidate


def test_prefix_cache_policy_without_history_is_least_load():
    assert PrefixCacheAware().pick([_s(_w("a"), 3), _s(_w("b"), 0)], Q).name == "b"


def test_make_policy_registry():
    for name in ("round-robin", "least-load", "power-of-two", "prefix-cache"):
        assert make_policy(name).name == name
    with pytest.raises(ValueError, match="prefill_policy: unknown placement policy 'x'"):
        make_policy("x", "prefill_policy")


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def test_registry_health_missing_workers_quarantine_and_counts():
    report = [_w("a"), _w("b", healthy=False)]
    clock = Clock()
    reg = WorkerRegistry(lambda: report, refresh_s=1.0, quarantine_s=5.0, clock=clock)
    assert [s.name for s in reg.candidates("m", prefill=True)] == ["a"]
    assert reg.candidates("other", prefill=True) == []
    reg.assign("a")
    reg.assign("a")
    reg.release("a")
    assert reg.get("a").num_assigned == 1
    reg.mark_failed("a", "boom")
    assert not reg.get("a").healthy and "boom" in reg.get("a").info.error
    assert not reg.serving("m")
    clock.t = 6.0  # quarantine over
    assert reg.get("a").healthy and reg.serving("m")
    report = [_w("b")]  # 'a' vanished from the report: dead
    reg.maybe_refresh()
    assert reg.get("a") is not None and not reg.get("a").healthy
    assert [s.name for s in reg.candidates("m", prefill=True)] == ["b"]


def test_registry_survives_a_failing_report():
    calls = {"n": 0}

    def source():
        calls["n"] += 1
        if calls["n"] > 1:
            raise ConnectionError("ray down")
        return [_w("a")]

    reg = WorkerRegistry(source, refresh_s=0.0)
    reg.refresh()
    assert reg.get("a").healthy  # keeps the last view


def _registry(*infos):
    return WorkerRegistry(lambda: list(infos), refresh_s=1e9)


def test_place_colocated_and_disaggregated():
    ll, p2 = LeastLoad(), PowerOfTwo(seed=1)
    reg = _registry(_w("c0"))
    p = place(reg, Q, ll, p2)
    assert (p.prefill_worker, p.decode_worker) == ("c0", "c0")
    reg = _registry(_w("p0", WorkerRole.PREFILL), _w("d0", WorkerRole.DECODE, free=1),
                    _w("d1", WorkerRole.DECODE, free=7))
    p = place(reg, Q, ll, p2)
    assert p.prefill_worker == "p0" and p.decode_worker == "d1"
    p = place(reg, Q, ll, p2, pinned_decode="d0")
    assert p.decode_worker == "d0"


@pytest.mark.parametrize("kw, code, start", [
    ({"pinned_prefill": "nope"}, Code.NOT_FOUND, "prefill_worker: no worker named 'nope'"),
    ({"pinned_decode": "nope"}, Code.NOT_FOUND, "decode_worker: no worker named 'nope'"),
    ({"pinned_prefill": "d0"}, Code.INVALID_ARGUMENT, "prefill_worker: 'd0' is a decode"),
    ({"pinned_decode": "p0"}, Code.INVALID_ARGUMENT, "decode_worker: 'p0' is a prefill"),
    ({"pinned_prefill": "px"}, Code.INVALID_ARGUMENT, "prefill_worker: 'px' serves model 'x'"),
    ({"pinned_decode": "dead"}, Code.UNAVAILABLE, "decode_worker: worker 'dead' is unhealthy"),
])
def test_place_pinned_errors_name_the_field(kw, code, start):
    reg = _registry(_w("p0", WorkerRole.PREFILL), _w("d0", WorkerRole.DECODE),
                    _w("px", WorkerRole.PREFILL, model="x"),
                    _w("dead", WorkerRole.DECODE, healthy=False))
    with pytest.raises(RouterError) as e:
        place(reg, Q, LeastLoad(), LeastLoad(), **kw)
    assert e.value.code is code and e.value.message.startswith(start)


def test_place_colocated_rejects_a_different_decode_worker():
    reg = _registry(_w("c0"), _w("c1"))
    with pytest.raises(RouterError) as e:
        place(reg, Q, LeastLoad(), LeastLoad(), pinned_prefill="c0", pinned_decode="c1")
    assert e.value.code is Code.INVALID_ARGUMENT and e.value.message.startswith("decode_worker")


def test_place_no_decode_worker_is_unavailable():
    reg = _registry(_w("p0", WorkerRole.PREFILL), _w("d0", WorkerRole.DECODE, healthy=False))
    with pytest.raises(RouterError) as e:
        place(reg, Q, LeastLoad(), LeastLoad())
    assert e.value.code is Code.UNAVAILABLE and "no healthy decode worker" in e.value.message


def test_prefix_cache_policy_follows_shared_prefixes():
    from tandem.router.policy import PlacementQuery

    policy = PrefixCacheAware(block=4, max_imbalance=2)
    a, b = _w("a"), _w("b")
    system = tuple(range(100, 112))  # a 12-token shared system prompt
    q1 = PlacementQuery(model="m", prompt_ids=system + (1, 2, 3, 4), num_tokens=40)
    q2 = PlacementQuery(model="m", prompt_ids=system + (9, 9, 9, 9), num_tokens=40)
    other = PlacementQuery(model="m", prompt_ids=tuple(range(500, 516)), num_tokens=40)
    first = policy.pick([_s(a, 0), _s(b, 0)], q1).name
    # Same 12-token prefix: same worker, even though it is now slightly busier.
    assert policy.pick([_s(a, 1 if first == "a" else 0), _s(b, 1 if first == "b" else 0)],
                       q2).name == first
    # An unrelated prompt goes to the least loaded worker.
    busy = {"a": 1 if first == "a" else 0, "b": 1 if first == "b" else 0}
    assert policy.pick([_s(a, busy["a"]), _s(b, busy["b"])], other).name != first
    # Too much imbalance overrides affinity.
    loads = {first: 5, ("b" if first == "a" else "a"): 0}
    assert policy.pick([_s(a, loads["a"]), _s(b, loads["b"])], q1).name != first
    fresh = policy.block_keys(system + (7, 7, 7, 7))
    assert policy.matched_blocks(first, fresh) == 3  # the shared 12 tokens, not the suffix
