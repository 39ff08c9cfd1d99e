"""DP attention inside the Ray decode worker: a prefill worker of 1 rank and a decode worker of
dp=2 ranks (2 actors in one placement group, gloo), the decode front (rank 0) giving each
reserve to the least loaded DP rank, the prefill worker pushing KV to that rank over Mooncake;
speculation on, greedy float32 -- token-identical to the colocated single-rank SpecEngine.
One request alone (rank 1 idle, joining every verify with an empty forward), then a burst that
both ranks serve, with requests ending at different rounds, whose acceptance counts the front
reports summed over both ranks. Afterwards every page and seed slot is back on every rank.
Config errors name the field."""

from __future__ import annotations

import asyncio
import time

import pytest
from disagg_helpers import random_requests, tiny_dispatcher, tiny_model_and_head

from tandem.deploy.config import DeployConfig, GroupConfig, parse_deploy
from tandem.engine import EngineConfig, SamplingParams
from tandem.engine.config import ConfigError
from tandem.router.dispatch import Placement, RoutedRequest
from tandem.spec import SpecConfig, SpecEngine

ray = pytest.importorskip("ray")


def _config(dirs) -> DeployConfig:
    model_dir, head_dir = dirs
    return DeployConfig(
        engine=EngineConfig(model=str(model_dir), dtype="float32", page_size=4, num_pages=128),
        spec=SpecConfig(draft_model=str(head_dir), num_steps=3),
        transfer_backend="mooncake", transfer_timeout_s=20.0,
        prefill=GroupConfig(num_cpus=0.5, torch_threads=1),
        decode=GroupConfig(dp=2, num_cpus=0.5, torch_threads=1),
    )


def _requests(n: int, seed: int):
    return random_requests(n, seed, new_tokens=(2, 14))


@pytest.fixture(scope="module")
def deployment(tmp_path_factory):
    from tandem.deploy.launcher import init_ray, launch

    cfg = _config(tiny_model_and_head(tmp_path_factory.mktemp("dp")))
    if ray.is_initialized():
        ray.shutdown()
    init_ray(num_cpus=4)
    dep = None
    try:
        dep = launch(cfg, startup_timeout_s=90)
        disp = tiny_dispatcher(dep)
        yield cfg, dep, disp
    finally:
        if dep is not None:
            dep.shutdown()
        ray.shutdown()


def _run(disp, prompts, params, room0: int, rounds: list[int] | None = None):
    """Each request's tokens; `rounds` gets each request's speculative rounds (one streamed
    chunk per round after the first token, from its final chunk's stats)."""
    async def one(i, prompt, sp):
        req = RoutedRequest(request_id=f"r{room0 + i}", room=room0 + i, model="default",
                            prompt_ids=tuple(prompt), params=sp,
                            placement=Placement(prefill_worker="prefill-0",
                                                decode_worker="decode-0"),
                            deadline=time.time() + 60)
        toks = []
        async for chunk in disp.submit(req):
            toks.extend(chunk.token_ids)
            if chunk.finished and rounds is not None:
                rounds.append(chunk.spec.num_rounds if chunk.spec else 0)
        return tuple(toks)

    async def run_all():
        return await asyncio.gather(*(one(i, p, sp) for i, (p, sp)
                                      in enumerate(zip(prompts, params))))

    return list(asyncio.run(run_all()))


def _decode_ranks(dep):
    """Health of decode rank 0 (the front) and rank 1, waiting until every page came back."""
    handles = [dep.decode["decode-0"], *dep.followers]
    end = time.monotonic() + 15
    while True:
        hs = ray.get([h.health.remote() for h in handles])
        if all(h.num_free_pages == h.num_pages and h.num_free_slots == h.num_slots
               for h in hs) or time.monotonic() > end:
            return hs
        time.sleep(0.2)


def _assert_all_free(dep, hs) -> None:
    prefill = ray.get(dep.prefill["prefill-0"].health.remote())
    assert all(h.healthy for h in [*hs, prefill]), [h.error for h in [*hs, prefill]]
    assert all(h.num_free_pages == h.num_pages for h in [*hs, prefill])
    assert all(h.num_free_slots == h.num_slots > 0 for h in hs)
    assert hs[0].num_pages == 2 * hs[1].num_pages  # the front sums its DP ranks


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_dp2_one_request_other_rank_idle(deployment):
    cfg, dep, disp = deployment
    from tandem.worker import decode_per_rank
    from tandem.kvtransfer import EndpointInfo

    # Each DP rank holds every KV head (tp 1), the same per-rank layout as the prefill worker:
    # its handshake info says so (and matches the prefill's).
    infos = [EndpointInfo.decode(b) for b in
             decode_per_rank(dep.endpoints["decode-0"], 2, "decode endpoint")]
    assert [(i.compat.tp_size, i.compat.tp_rank) for i in infos] == [(1, 0), (1, 0)]
    assert infos[0].session != infos[1].session

    prompts, params = _requests(1, seed=3)
    params = [SamplingParams(max_new_tokens=12, ignore_eos=True)]
    colocated = SpecEngine.from_config(cfg.engine, cfg.spec).generate(prompts, params)
    before = [h.num_rounds for h in _decode_ranks(dep)]
    assert _run(disp, prompts, params, 9200) == [c.output_ids for c in colocated]
    hs = _decode_ranks(dep)
    _assert_all_free(dep, hs)
    # Ties go to the lowest rank: rank 0 ran the rounds, rank 1 only empty verify forwards.
    assert hs[0].num_rounds > before[0] and hs[1].num_rounds == before[1]


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_dp2_disaggregated_equals_colocated(deployment):
    cfg, dep, disp = deployment
    prompts, params = _requests(6, seed=0)
    colocated = SpecEngine.from_config(cfg.engine, cfg.spec).generate(prompts, params)
    before = _decode_ranks(dep)
    rounds: list[int] = []
    assert _run(disp, prompts, params, 9300, rounds) == [c.output_ids for c in colocated]
    hs = _decode_ranks(dep)
    _assert_all_free(dep, hs)
    # The front reports acceptance summed over its DP ranks: its rounds grew by every request's
    # rounds, i.e. by rank 1's (its own health) plus rank 0's -- and both ranks ran some.
    front, rank1 = (hs[0].num_rounds - before[0].num_rounds,
                    hs[1].num_rounds - before[1].num_rounds)
    assert front == sum(rounds) and 0 < rank1 < front, (front, rank1, rounds)
    assert len(hs[0].per_position) == 3 and 1.0 <= hs[0].mean_acceptance_length <= 4.0


def test_spec_totals_sum_counts_and_recompute_means():
    """What the front reports under DP: counts add (a rank without rounds has no positions
    yet), tau and per-position rates come from the sums, not from averaging the ranks' means."""
    from tandem.decode_node.worker import SpecTotals

    rank0 = SpecTotals(num_rounds=3, num_tokens=9, accepted_at=(3, 2, 1))
    rank1 = SpecTotals(num_rounds=1, num_tokens=1, accepted_at=(0, 0, 0))
    total = rank0 + rank1 + SpecTotals()
    assert total == SpecTotals(num_rounds=4, num_tokens=10, accepted_at=(3, 2, 1))
    assert total.mean_acceptance_length == 2.5  # not (3 + 1) / 2
    assert total.per_position() == (0.75, 0.5, 0.25)


def test_dp_config_errors_name_the_field():
    with pytest.raises(ConfigError, match=r"^prefill\.dp: must be 1"):
        DeployConfig(prefill=GroupConfig(dp=2), decode=GroupConfig(dp=2))
    with pytest.raises(ConfigError, match=r"^decode\.dp: must be an integer >= 1"):
        parse_deploy({"decode": {"dp": 0}})
    with pytest.raises(ConfigError, match=r"^decode\.ep: must be 1 or equal to dp \(2\)"):
        parse_deploy({"decode": {"dp": 2, "ep": 3}})
    # DP ranks of tp > 1, and a prefill of another tp (re-sliced): test_ray_dp_tp.py.
    cfg = parse_deploy({"decode": {"dp": 2, "ep": 2}})
    assert (cfg.decode.dp, cfg.decode.world_size) == (2, 2)


def test_route_to_decode_picks_the_dp_rank():
    from tandem.worker import (
        encode_dp_destination,
        encode_per_rank,
        route_to_decode,
    )

    endpoints = encode_per_rank([b'{"e":0}', b'{"e":1}'])
    dest = encode_dp_destination(1, [b'{"d":1}'])
    (route,) = route_to_decode(endpoints, dest, 1)
    assert (route.endpoints, route.destinations) == ((b'{"e":1}',), (b'{"d":1}',))
    with pytest.raises(ValueError, match="DP rank 2"):
        route_to_decode(endpoints, encode_dp_destination(2, [b'{"d":1}']), 1)
    # Without DP: rank r to rank r, as before.
    (route,) = route_to_decode(encode_per_rank([b'{"e":0}']), encode_per_rank([b'{"d":0}']), 1)
    assert (route.endpoints, route.destinations) == ((b'{"e":0}',), (b'{"d":0}',))


def test_choose_dp_rank_least_reserved_pages_ties_to_lowest():
    from tandem.decode_node.worker import PoolLoad, _ReserveBid, choose_dp_rank

    load = PoolLoad(num_free_pages=0, num_pages=0, num_free_slots=0, num_slots=0,
                    num_running=0)

    def bid(reserved: int, fits: bool = True) -> _ReserveBid:
        return _ReserveBid(reserved_pages=reserved, fits=fits, holds_room=False, load=load)

    assert choose_dp_rank([bid(0), bid(0)]) == 0
    assert choose_dp_rank([bid(5), bid(3), bid(3)]) == 1
    assert choose_dp_rank([bid(0, fits=False), bid(9)]) == 1  # the least loaded must fit
    assert choose_dp_rank([bid(0, fits=False), bid(0, fits=False)]) is None
