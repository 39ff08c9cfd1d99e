"""KV head re-slicing on Ray: prefill and decode workers of different TP sizes (1 + 2, 2 + 1 and
4 + 2; the tiny Llama has 2 KV heads), each prefill rank pushing its heads to the decode ranks
that hold them over Mooncake (after the prefill, or layer-wise), speculation on, greedy float32
-- token-identical to the colocated single-rank SpecEngine, and every page and seed slot back
on every rank afterwards."""

from __future__ import annotations

import time

import pytest

from disagg_helpers import (health_once_all_free, random_requests, run_all,
                            tiny_dispatcher, tiny_model_and_head)
from tandem.deploy.config import DeployConfig, GroupConfig
from tandem.engine import EngineConfig
from tandem.spec import SpecConfig, SpecEngine

pytestmark = [pytest.mark.slow]

ray = pytest.importorskip("ray")


@pytest.fixture(scope="module")
def ray_session():
    from tandem.deploy.launcher import init_ray

    if ray.is_initialized():
        ray.shutdown()
    init_ray(num_cpus=4)  # 4 + 2 ranks of 0.5 CPU at most
    yield
    ray.shutdown()


def _config(dirs, prefill_tp: int, decode_tp: int, layerwise: bool) -> DeployConfig:
    model_dir, head_dir = dirs
    return DeployConfig(
        engine=EngineConfig(model=str(model_dir), dtype="float32", page_size=4, num_pages=128),
        spec=SpecConfig(draft_model=str(head_dir), num_steps=3),
        transfer_backend="mooncake", transfer_timeout_s=20.0,
        prefill=GroupConfig(tp=prefill_tp, num_cpus=0.5, torch_threads=1,
                            layerwise_push=layerwise),
        decode=GroupConfig(tp=decode_tp, num_cpus=0.5, torch_threads=1),
    )


def _requests(n: int, seed: int):
    return random_requests(n, seed)



def _prefill_ranks(dep) -> list:
    """Every rank of the prefill worker (its leader first)."""
    followers = [f for f, h in zip(dep.followers, ray.get([f.health.remote()
                                                          for f in dep.followers]))
                 if h.role == "prefill"]
    return [*dep.prefill.values(), *followers]


def _slow_prefill_layers(dep, seconds: float) -> None:
    """Make each target layer of every prefill rank take `seconds` more, so decode's grant (GO)
    arrives while the completing forward still runs -- as it does for a long prompt -- and
    layer-wise pushes happen inside it (test_layerwise_push.slow_layers, inside the actors)."""

    def slow(actor, seconds):
        import time as _time

        for layer in actor.worker.engine.model.layers:
            def forward(*args, _inner=layer.forward):
                _time.sleep(seconds)
                return _inner(*args)

            layer.forward = forward

    ray.get([h.__ray_call__.remote(slow, seconds) for h in _prefill_ranks(dep)])


def _layers_pushed_early(dep) -> list[int]:
    """Per prefill rank: (target layer, destination) pairs pushed inside a forward."""
    return ray.get([h.__ray_call__.remote(lambda actor: actor.worker.pusher.num_layers_early)
                    for h in _prefill_ranks(dep)])


@pytest.mark.timeout(90)
# Layer-wise push: with 2 + 1 each prefill rank pushes its heads inside the forward; with 1 + 2
# the one prefill rank feeds two decode ranks and pushes every layer to both inside it.
@pytest.mark.parametrize("prefill_tp,decode_tp,layerwise", [
    (1, 2, False), (2, 1, False), (2, 1, True), (1, 2, True),
    (4, 2, False)])  # prefill ranks 1 and 3 hold replicas: they send nothing
def test_ray_reslice_equals_colocated_tp1(tmp_path, ray_session, prefill_tp, decode_tp,
                                          layerwise):
    from tandem.deploy.launcher import launch

    dirs = tiny_model_and_head(tmp_path)
    cfg = _config(dirs, prefill_tp, decode_tp, layerwise)
    prompts, params = _requests(4, seed=prefill_tp)
    colocated = SpecEngine.from_config(cfg.engine, cfg.spec).generate(prompts, params)
    t0 = time.monotonic()
    dep = launch(cfg, startup_timeout_s=60)
    try:
        print(f"{prefill_tp} + {decode_tp} ranks up in {time.monotonic() - t0:.1f} s")
        if layerwise:
            _slow_prefill_layers(dep, 0.05)
        got = run_all(tiny_dispatcher(dep), prompts, params, room_base=9300)
        assert [e for _, e in got] == [[]] * len(prompts)
        assert [t for t, _ in got] == [c.output_ids for c in colocated]
        # Every rank of both workers got every page (and every decode seed slot) back.
        hs = health_once_all_free(dep, slots=True)
        assert all(h.healthy for h in hs), [h.error for h in hs]
        assert [(h.role, h.num_free_pages, h.num_free_slots) for h in hs] == [
            (h.role, h.num_pages, h.num_slots) for h in hs]
        decode = [h for h in hs if h.role == "decode"]
        assert len(decode) == decode_tp and decode[0].num_rounds > 0  # speculation really ran
        if layerwise:  # every prefill rank pushed layers inside its forward, not after it
            early = _layers_pushed_early(dep)
            assert len(early) == prefill_tp and all(n > 0 for n in early), early
    finally:
        dep.shutdown()


@pytest.mark.timeout(60)
def test_uneven_head_split_fails_launch_naming_the_field(tmp_path, ray_session):
    """Heads that do not split over decode tp 3 (4 query, 2 KV heads): the decode ranks refuse
    to build (HeadLayout, naming the field); `launch` raises that and leaves nothing running --
    no hang until the first request. (Engines that build always re-slice: both check the same
    even split, and `launcher.check_kv_reslice` checks it again from the endpoints.)"""
    from tandem.deploy.launcher import launch

    cfg = _config(tiny_model_and_head(tmp_path), 1, 3, False)
    t0 = time.monotonic()
    with pytest.raises(Exception, match=r"num_attention_heads: \d+ is not divisible by the "
                       r"group size 3"):
        launch(cfg, startup_timeout_s=40)
    assert time.monotonic() - t0 < 30
    assert ray.util.placement_group_table() == {} or all(
        pg["state"] == "REMOVED" for pg in ray.util.placement_group_table().values())
