"""TP inside the Ray workers: a prefill worker of 2 ranks and a decode worker of 2 ranks (4 actors,
each pair in one placement group, joined by gloo), KV pushed rank to rank over Mooncake,
speculation on, greedy float32 -- token-identical to the colocated single-rank SpecEngine."""

from __future__ import annotations

import time

import pytest

from disagg_helpers import (health_once_all_free, random_requests, run_all,
                            tiny_dispatcher, tiny_model_and_head)
from tandem.deploy.config import DeployConfig, GroupConfig
from tandem.engine import EngineConfig
from tandem.engine.config import ConfigError
from tandem.spec import SpecConfig, SpecEngine

pytestmark = [pytest.mark.slow, pytest.mark.timeout(150)]

ray = pytest.importorskip("ray")


def _config(dirs, tp: int) -> DeployConfig:
    model_dir, head_dir = dirs
    return DeployConfig(
        engine=EngineConfig(model=str(model_dir), dtype="float32", page_size=4, num_pages=128),
        spec=SpecConfig(draft_model=str(head_dir), num_steps=3),
        transfer_backend="mooncake", transfer_timeout_s=20.0,
        prefill=GroupConfig(tp=tp, num_cpus=0.5, torch_threads=1),
        decode=GroupConfig(tp=tp, num_cpus=0.5, torch_threads=1),
    )


def _requests(n: int, seed: int = 0):
    return random_requests(n, seed)



def test_ep_must_match_tp():
    # Unequal prefill/decode TP is allowed now (re-slicing, tests/integration/test_ray_reslice.py).
    with pytest.raises(ConfigError, match="ep: must be 1 or equal to tp"):
        GroupConfig(tp=2, ep=4)


def test_per_rank_blob_checks_the_rank_count():
    from tandem.worker import decode_per_rank, encode_per_rank

    blob = encode_per_rank([b'{"a":1}', b'{"a":2}'])
    assert decode_per_rank(blob, 2, "decode endpoint") == [b'{"a":1}', b'{"a":2}']
    with pytest.raises(ValueError, match="decode endpoint: the blob holds 2 ranks, expected 1"):
        decode_per_rank(blob, 1, "decode endpoint")


def test_ray_tp2_disaggregated_equals_colocated_tp1(tmp_path):
    from tandem.deploy.launcher import init_ray, launch

    dirs = tiny_model_and_head(tmp_path)
    cfg = _config(dirs, tp=2)
    prompts, params = _requests(5)
    colocated = SpecEngine.from_config(cfg.engine, cfg.spec).generate(prompts, params)
    if ray.is_initialized():
        ray.shutdown()
    init_ray(num_cpus=4)
    try:
        t0 = time.monotonic()
        dep = launch(cfg, startup_timeout_s=90)
        try:
            print(f"4 ranks up in {time.monotonic() - t0:.1f} s")
            from tandem.worker import decode_per_rank
            from tandem.kvtransfer import EndpointInfo

            infos = [EndpointInfo.decode(b) for b in
                     decode_per_rank(dep.endpoints["decode-0"], 2, "decode endpoint")]
            assert [(i.compat.tp_size, i.compat.tp_rank) for i in infos] == [(2, 0), (2, 1)]
            got = run_all(tiny_dispatcher(dep), prompts, params, room_base=9100)
            assert [t for t, _ in got] == [c.output_ids for c in colocated]
            # Every rank of both workers got every page back.
            hs = health_once_all_free(dep)
            assert all(h.healthy for h in hs), [h.error for h in hs]
            assert all(h.num_free_pages == h.num_pages for h in hs)
            # Decode ranks really ran speculative rounds (not a silent fallback).
            assert hs[1].num_rounds > 0
        finally:
            dep.shutdown()
    finally:
        ray.shutdown()
