"""DP attention with TP inside each DP rank, on Ray: a prefill worker of tp 1 or 2 feeding a
decode worker of dp 2 (each DP rank a TP group of `decode_tp` ranks). The decode front gives
each reserve to the least loaded DP rank; the prefill ranks push their KV heads to that DP
rank's TP ranks over Mooncake (rank to rank at tp 2 + 2, re-sliced at 2 + 1 and 1 + 2:
kvtransfer/reslice.py).
Speculation on, greedy float32 -- token-identical to the colocated single-rank SpecEngine; both
DP ranks serve, the TP ranks of a DP rank run the same rounds, and every page and seed slot is
back on every rank afterwards."""

from __future__ import annotations

import time

import pytest
from disagg_helpers import (health_once_all_free, random_requests, run_all, tiny_dispatcher,
                            tiny_model_and_head)

from tandem.deploy.config import DeployConfig, GroupConfig, parse_deploy
from tandem.engine import EngineConfig
from tandem.engine.config import ConfigError
from tandem.spec import SpecConfig, SpecEngine

ray = pytest.importorskip("ray")


@pytest.fixture(scope="module")
def ray_session():
    from tandem.deploy.launcher import init_ray

    if ray.is_initialized():
        ray.shutdown()
    init_ray(num_cpus=4)  # 2 + 4 ranks of 0.5 CPU
    yield
    ray.shutdown()


def _config(dirs, prefill_tp: int, decode_tp: int) -> DeployConfig:
    model_dir, head_dir = dirs
    return DeployConfig(
        engine=EngineConfig(model=str(model_dir), dtype="float32", page_size=4, num_pages=128),
        spec=SpecConfig(draft_model=str(head_dir), num_steps=3),
        transfer_backend="mooncake", transfer_timeout_s=20.0,
        prefill=GroupConfig(tp=prefill_tp, num_cpus=0.5, torch_threads=1),
        decode=GroupConfig(dp=2, tp=decode_tp, num_cpus=0.5, torch_threads=1),
    )


@pytest.mark.slow
@pytest.mark.timeout(150)
@pytest.mark.parametrize("prefill_tp,decode_tp", [(2, 2), (2, 1), (1, 2)])
def test_prefill_tp_to_decode_dp2_equals_colocated(tmp_path, ray_session, prefill_tp,
                                                   decode_tp):
    from tandem.deploy.launcher import launch
    from tandem.kvtransfer import EndpointInfo
    from tandem.worker import decode_per_rank

    cfg = _config(tiny_model_and_head(tmp_path), prefill_tp, decode_tp)
    prompts, params = random_requests(4, seed=prefill_tp + decode_tp)
    colocated = SpecEngine.from_config(cfg.engine, cfg.spec).generate(prompts, params)
    t0 = time.monotonic()
    dep = launch(cfg, startup_timeout_s=90)
    try:
        print(f"{prefill_tp} + {2 * decode_tp} ranks up in {time.monotonic() - t0:.1f} s")
        # One endpoint per decode rank, DP-major: each states its place in its DP rank's TP
        # group (the heads it holds), and each has its own session.
        infos = [EndpointInfo.decode(b) for b in
                 decode_per_rank(dep.endpoints["decode-0"], 2 * decode_tp, "decode endpoint")]
        assert [(i.compat.tp_size, i.compat.tp_rank) for i in infos] == [
            (decode_tp, r % decode_tp) for r in range(2 * decode_tp)]
        assert len({i.session for i in infos}) == 2 * decode_tp
        got = run_all(tiny_dispatcher(dep), prompts, params, room_base=9500)
        assert [e for _, e in got] == [[]] * len(prompts)
        assert [t for t, _ in got] == [c.output_ids for c in colocated]
        hs = health_once_all_free(dep, slots=True)
        assert all(h.healthy for h in hs), [h.error for h in hs]
        assert [(h.role, h.num_free_pages, h.num_free_slots) for h in hs] == [
            (h.role, h.num_pages, h.num_slots) for h in hs]
        # Decode ranks in rank order (the front reports its DP ranks' sums; followers their
        # own): DP rank 1 served too, and its TP ranks ran the same rounds.
        decode = [h for h in hs if h.role == "decode"]
        assert len(decode) == 2 * decode_tp
        dp1 = [h.num_rounds for h in decode[decode_tp:]]
        assert dp1[0] > 0 and len(set(dp1)) == 1, dp1
        assert decode[0].num_rounds > dp1[0]  # the front's sum holds DP rank 0's rounds too
    finally:
        dep.shutdown()


def test_dp_tp_config():
    cfg = parse_deploy({"decode": {"dp": 2, "tp": 2, "ep": 4}, "prefill": {"tp": 2}})
    assert (cfg.decode.dp, cfg.decode.tp, cfg.decode.world_size) == (2, 2, 4)
    with pytest.raises(ConfigError, match=r"^decode\.ep: must be 1 or equal to dp \* tp \(4\)"):
        parse_deploy({"decode": {"dp": 2, "tp": 2, "ep": 2}})


def test_route_to_decode_feeds_the_tp_ranks_of_the_dp_rank():
    """Prefill tp 2 -> decode dp 2 x tp 2: DP rank 1's parts go to decode ranks 2 and 3 (the
    endpoint blob is DP-major), prefill rank r to that DP rank's TP rank r."""
    from tandem.worker import encode_dp_destination, encode_per_rank, route_to_decode

    endpoints = encode_per_rank([b'{"e":%d}' % r for r in range(4)])
    dest = encode_dp_destination(1, [b'{"d":0}', b'{"d":1}'])
    routes = route_to_decode(endpoints, dest, 2)
    assert [(r.endpoints, r.destinations) for r in routes] == [
        ((b'{"e":2}',), (b'{"d":0}',)), ((b'{"e":3}',), (b'{"d":1}',))]
