"""The router's Prometheus scrape over real workers: after known requests the request families
move by the right amounts, and the worker families carry the workers' own numbers labelled by
worker (and backend): colocated (a tiny speculative engine in the router's process) and
disaggregated (Ray prefill and decode actors, Mooncake), where a worker restarted by Ray
(kill -9) counts a restart and none of its counters goes back."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import time

import pytest
from prometheus_client.parser import text_string_to_metric_families

from disagg_helpers import tiny_model_and_head
from tandem.colocated_node import build_colocated_router
from tandem.engine import EngineConfig
from tandem.router import GenerateInput, SamplingInput
from tandem.spec import SpecConfig, SpecEngine

pytestmark = pytest.mark.timeout(400)

# Every family the scrape must hold, colocated or not (tests/unit/test_router_metrics.py has
# their types).
FAMILIES = (
    "tandem:request_success", "tandem:requests", "tandem:prompt_tokens",
    "tandem:generation_tokens", "tandem:time_to_first_token_seconds",
    "tandem:inter_token_latency_seconds", "tandem:request_time_per_output_token_seconds",
    "tandem:e2e_request_latency_seconds", "tandem:request_queue_time_seconds",
    "tandem:num_requests_running", "tandem:num_requests_waiting", "tandem:kv_pages_free",
    "tandem:kv_pages_used", "tandem:kv_cache_usage_perc", "tandem:worker_healthy",
    "tandem:worker_restarts", "tandem:spec_decode_acceptance_length",
    "tandem:spec_decode_num_drafts", "tandem:spec_decode_num_accepted_tokens",
    "tandem:spec_decode_num_accepted_tokens_per_pos", "tandem:kv_transfer_bytes",
    "tandem:kv_transfer_latency_seconds", "tandem:kv_transfer_failures",
)


class Scrape:
    """One scrape, parsed with prometheus-client's own parser."""

    def __init__(self, text: bytes) -> None:
        families = list(text_string_to_metric_families(text.decode()))
        names = {f.name for f in families}
        missing = [f for f in FAMILIES if f not in names]
        assert not missing, f"families missing from the scrape: {missing}"
        self.samples = [s for f in families for s in f.samples]

    def get(self, name: str, **labels) -> float:
        """The sample's value (0 when absent)."""
        for s in self.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
        return 0.0

    def labels(self, name: str) -> list[dict[str, str]]:
        return [s.labels for s in self.samples if s.name == name]


def _prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(256) for _ in range(rng.randint(3, 12))] for _ in range(n)]


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    return tiny_model_and_head(tmp_path_factory.mktemp("m"))


def test_colocated_scrape_moves_by_the_requests(dirs):
    model_dir, head_dir = dirs
    engine = SpecEngine.from_config(
        EngineConfig(model=str(model_dir), dtype="float32", page_size=4, num_pages=128),
        SpecConfig(draft_model=str(head_dir), num_steps=3))
    router = build_colocated_router(engine, model="tiny", worker="colocated-0")
    prompts, max_tokens = _prompts(3, seed=1), [5, 8, 11]

    async def main():
        before = Scrape(router.metrics_text()[0])
        outs = []
        for prompt, n in zip(prompts, max_tokens):
            inp = GenerateInput(prompt_token_ids=tuple(prompt),
                                sampling=SamplingInput(max_tokens=n, ignore_eos=True))
            outs.append([o async for o in router.generate(inp)])
        # the engine frees a request's pages in the step after its last output
        assert await asyncio.to_thread(router.dispatcher.loop("colocated-0").wait_idle, 10)
        return before, outs, Scrape(router.metrics_text()[0])

    try:
        before, outs, after = asyncio.run(main())
    finally:
        asyncio.run(router.close())

    def moved(name, **labels):
        return after.get(name, **labels) - before.get(name, **labels)

    returned = [sum(len(o.token_ids) for o in out) for out in outs]
    assert returned == max_tokens  # ignore_eos: each runs to its length
    assert moved("tandem:time_to_first_token_seconds_count") == 3
    assert moved("tandem:e2e_request_latency_seconds_count") == 3
    assert moved("tandem:request_time_per_output_token_seconds_count") == 3
    assert moved("tandem:generation_tokens_total") == sum(returned)
    assert moved("tandem:prompt_tokens_total") == sum(map(len, prompts))
    assert moved("tandem:request_success_total", finished_reason="length") == 3
    assert moved("tandem:requests_total", code="OK") == 3
    # one gap per output after the first: a speculative round streams as one output
    assert moved("tandem:inter_token_latency_seconds_count") == sum(len(o) - 1 for o in outs)
    # the engine's own numbers, labelled by its worker
    who = {"worker": "colocated-0", "role": "colocated"}
    alloc = engine.allocator
    assert after.get("tandem:kv_pages_free", **who) == alloc.num_free == alloc.num_usable
    assert after.get("tandem:kv_pages_used", **who) == 0
    assert after.get("tandem:worker_healthy", **who) == 1
    assert after.get("tandem:num_requests_running") == 0
    stats = engine.spec_stats  # the scrape's acceptance counts are the engine's, exactly
    assert after.get("tandem:spec_decode_num_drafts_total", **who) == stats.num_rounds > 0
    assert after.get("tandem:spec_decode_acceptance_length_count", **who) == stats.num_rounds
    assert after.get("tandem:spec_decode_acceptance_length_sum", **who) == stats.num_tokens
    for j, n in enumerate(stats.accepted_at):
        assert after.get("tandem:spec_decode_num_accepted_tokens_per_pos_total", position=str(j),
                         **who) == n
    assert not after.labels("tandem:kv_transfer_bytes_total")  # no transfers in one engine


@pytest.mark.slow
def test_disaggregated_scrape_has_worker_numbers_and_survives_a_restart(dirs):
    ray = pytest.importorskip("ray")
    from grpc_system import SHORT, System
    from tandem.deploy.config import DeployConfig, GroupConfig
    from tandem.deploy.launcher import init_ray

    model_dir, head_dir = dirs
    cfg = DeployConfig(
        engine=EngineConfig(model=str(model_dir), dtype="float32", page_size=4, num_pages=256),
        spec=SpecConfig(draft_model=str(head_dir), num_steps=3),
        transfer_backend="mooncake", transfer_timeout_s=4.0, endpoint=SHORT,
        prefill=GroupConfig(replicas=1, num_cpus=0.5), decode=GroupConfig(replicas=1, num_cpus=0.5))
    if ray.is_initialized():
        ray.shutdown()
    init_ray(num_cpus=8)
    system = System(cfg)

    async def render():
        return system.router.metrics_text()[0]

    def scrape() -> Scrape:  # on the router's loop, as a front serving /metrics would
        return Scrape(system.server.call(render))

    def scrape_when(ready, timeout_s: float = 30.0) -> Scrape:
        """The first scrape `ready` accepts (worker numbers arrive with the next health poll)."""
        end = time.monotonic() + timeout_s
        while True:
            s = scrape()
            if ready(s) or time.monotonic() > end:
                return s
            time.sleep(0.2)

    pre = {"worker": "prefill-0", "role": "prefill", "backend": "mooncake"}
    dec = {"worker": "decode-0", "role": "decode", "backend": "mooncake"}
    try:
        before = scrape()
        prompts = _prompts(3, seed=2)
        returned = [len(system.tokens(p, 6)) for p in prompts]
        assert returned == [6, 6, 6]
        after = scrape_when(lambda s: s.get("tandem:kv_transfer_latency_seconds_count", **dec)
                            >= 3 and s.get("tandem:kv_pages_used", worker="decode-0") == 0)

        def moved(name, **labels):
            return after.get(name, **labels) - before.get(name, **labels)

        assert moved("tandem:time_to_first_token_seconds_count") == 3
        assert moved("tandem:generation_tokens_total") == sum(returned)
        assert moved("tandem:request_success_total", finished_reason="length") == 3
        assert moved("tandem:requests_total", code="OK") == 3
        assert moved("tandem:request_queue_time_seconds_count") == 3  # the router's admission
        # Pages and transfers from the workers' health answers, labelled by worker and backend:
        # every transfer that landed was sent by prefill-0 and received by decode-0.
        for name in ("prefill-0", "decode-0"):
            assert after.get("tandem:kv_pages_free", worker=name) > 0
            assert after.get("tandem:worker_healthy", worker=name) == 1
        sent = after.get("tandem:kv_transfer_bytes_total", **pre)
        received = after.get("tandem:kv_transfer_bytes_total", **dec)
        assert sent > 0 and received > 0
        assert after.get("tandem:kv_transfer_latency_seconds_count", **pre) == 3
        assert after.get("tandem:kv_transfer_latency_seconds_count", **dec) == 3
        drafts = after.get("tandem:spec_decode_num_drafts_total", worker="decode-0")
        assert drafts > 0
        assert after.get("tandem:spec_decode_acceptance_length_count", worker="decode-0") == drafts

        # Ray restarts decode-0 (kill -9): its new process counts from 0, the router's
        # counters carry on from where they were.
        old = system.health("decode-0")
        os.kill(old.pid, signal.SIGKILL)
        end = time.monotonic() + 60
        while system.outcome([7, 8, 9], 4, timeout=10) != "OK":
            assert time.monotonic() < end, "decode-0 did not serve again within 60 s"
            time.sleep(0.25)
        assert system.health("decode-0").incarnation != old.incarnation
        # Wait for a health answer taken after the new request's rounds (one taken between its
        # transfer and its rounds already shows the transfer).
        later = scrape_when(lambda s: s.get("tandem:worker_restarts_total", worker="decode-0")
                            == 1 and s.get("tandem:kv_transfer_latency_seconds_count", **dec) > 3
                            and s.get("tandem:spec_decode_num_drafts_total", worker="decode-0")
                            > drafts)
        assert later.get("tandem:worker_restarts_total", worker="decode-0") == 1
        assert later.get("tandem:worker_restarts_total", worker="prefill-0") == 0
        for name, labels in [("tandem:kv_transfer_bytes_total", dec),
                             ("tandem:kv_transfer_latency_seconds_count", dec),
                             ("tandem:spec_decode_num_drafts_total", {"worker": "decode-0"}),
                             ("tandem:kv_transfer_bytes_total", pre)]:
            assert later.get(name, **labels) > after.get(name, **labels), name
    finally:
        system.close()
        ray.shutdown()
