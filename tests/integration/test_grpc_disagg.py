"""The whole disaggregated system through the public gRPC API: Ray prefill/decode actors,
Mooncake transfers, the router. Output equals the colocated speculative engine; killing a
worker or breaking a transfer mid-request ends that request with UNAVAILABLE within its
deadline, other requests are unaffected, and no page leaks."""

from __future__ import annotations

import random
import threading
import time

import grpc
import pytest

from grpc_system import SHORT, System, dirs, local_ray  # noqa: F401 -- module fixtures
from tandem.deploy.config import DeployConfig, GroupConfig
from tandem.engine import EngineConfig, SamplingParams
from tandem.kvtransfer import FailureInjection, FaultKind
from tandem.spec import SpecConfig, SpecEngine

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]
ray = pytest.importorskip("ray")


def _cfg(dirs, prefill=1, decode=1, prefill_faults=None) -> DeployConfig:
    model_dir, head_dir = dirs
    return DeployConfig(
        engine=EngineConfig(model=str(model_dir), dtype="float32", page_size=4, num_pages=256),
        spec=SpecConfig(draft_model=str(head_dir), num_steps=3),
        transfer_backend="mooncake", transfer_timeout_s=4.0, endpoint=SHORT,
        prefill=GroupConfig(replicas=prefill, num_cpus=0.5, faults=prefill_faults),
        decode=GroupConfig(replicas=decode, num_cpus=0.5))


def test_grpc_disaggregated_equals_colocated_and_survives_worker_death(local_ray, dirs):
    cfg = _cfg(dirs, prefill=2, decode=2)
    rng = random.Random(3)
    prompts = [[rng.randrange(256) for _ in range(rng.randint(2, 20))] for _ in range(6)]
    colocated = SpecEngine.from_config(cfg.engine, cfg.spec).generate(
        prompts, SamplingParams(max_new_tokens=10, ignore_eos=True))
    system = System(cfg)
    try:
        results = [None] * len(prompts)

        def run(i):
            results[i] = system.tokens(prompts[i], 10)

        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
        [t.start() for t in threads]
        [t.join() for t in threads]
        assert results == [list(c.output_ids) for c in colocated]

        # Kill decode-1 while a long request streams from it: that request fails fast with
        # UNAVAILABLE; a request on decode-0 at the same time is unaffected.
        doomed = system.generate([1, 2, 3], 400, decode_worker="decode-1")
        next(iter(doomed))
        survivor = {}
        t = threading.Thread(target=lambda: survivor.setdefault(
            "tokens", system.tokens(prompts[0], 10, decode_worker="decode-0")))
        t.start()
        t0 = time.monotonic()
        ray.kill(system.dep.decode["decode-1"], no_restart=True)
        with pytest.raises(grpc.RpcError) as err:
            for _ in doomed:
                pass
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert time.monotonic() - t0 < 15
        t.join()
        assert survivor["tokens"] == list(colocated[0].output_ids)
        # The dead worker stops getting requests: new ones keep succeeding.
        time.sleep(1.5)
        for p, c in zip(prompts[:3], colocated[:3]):
            assert system.tokens(p, 10) == list(c.output_ids)
        assert system.all_free(skip=("decode-1",))
    finally:
        system.close()


def test_prefill_death_mid_transfer_is_unavailable_and_frees_decode_pages(local_ray, dirs):
    # Every transfer is held for 3 s, so the prefill worker can be killed in the middle.
    cfg = _cfg(dirs, prefill=2, prefill_faults=FailureInjection(
        probability=1.0, kind=FaultKind.DELAY, delay_s=3.0))
    system = System(cfg)
    try:
        call = system.generate([5, 6, 7, 8], 20, timeout=30, prefill_worker="prefill-1")
        time.sleep(1.0)
        t0 = time.monotonic()
        ray.kill(system.dep.prefill["prefill-1"], no_restart=True)
        with pytest.raises(grpc.RpcError) as err:
            list(call)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert time.monotonic() - t0 < 15
        assert system.tokens([9, 10], 4, prefill_worker="prefill-0")  # still serving
        assert system.all_free(skip=("prefill-1",))
    finally:
        system.close()


@pytest.mark.parametrize("kind", [FaultKind.FAIL_TRANSFER, FaultKind.CORRUPT_AUX])
def test_broken_transfer_is_unavailable_and_leaks_nothing(local_ray, dirs, kind):
    system = System(_cfg(dirs, prefill_faults=FailureInjection(probability=1.0, kind=kind)))
    try:
        t0 = time.monotonic()
        with pytest.raises(grpc.RpcError) as err:
            list(system.generate([1, 2, 3, 4], 8, timeout=30))
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert time.monotonic() - t0 < 15
        assert system.all_free()
    finally:
        system.close()


def test_a_request_its_first_token_ends_frees_decode_pages_at_once(local_ray, dirs):
    """max_tokens=1: prefill's first token ends the request and nothing is sent; the router
    releases decode's reserved pages right away, not at the transfer deadline (4 s here)."""
    cfg = _cfg(dirs)
    prompt = [3, 4, 5, 6]
    want = SpecEngine.from_config(cfg.engine, cfg.spec).generate(
        [prompt], SamplingParams(max_new_tokens=1, ignore_eos=True))[0].output_ids
    system = System(cfg)
    try:
        assert system.tokens(prompt, 1) == list(want)
        assert system.all_free(timeout_s=1.5)
    finally:
        system.close()
