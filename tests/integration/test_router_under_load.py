"""One client's huge prompts must not starve another's small request: the real gRPC router in
front of a colocated in-process SmolLM2 engine, four client processes sending 3.9 MB prompts
(under the 4 MiB message limit) back to back, and one client timing an 8-token request, Health
and Stats meanwhile.

The router refuses such a prompt from its byte length alone (a token covers at most the
vocabulary's longest token in bytes), answers that refusal late (`too_long_delay_s`, so a client
repeating it cannot flood the router), and tokenizes long-but-admissible prompts off its event
loop. Measured on 2 shared CPU cores: 8-token request 0.54 s unloaded, 0.56 s loaded (1.03x).
Before, every 3.9 MB prompt was tokenized whole (seconds of CPU each) before the length check
and the 8-token request did not finish within 300 s under this load; refused at once but without
the late answer, the clients' ~650 MB/s made it 6.8x slower."""

from __future__ import annotations

import statistics
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tandem.colocated_node import build_colocated_router
from tandem.engine import EngineConfig, LLMEngine
from tandem.proto import router_pb2 as pb
from tandem.proto import router_pb2_grpc as pb_grpc
from tandem.router.app import BackgroundServer
from tandem.router.server import ServerConfig

pytestmark = pytest.mark.slow

CLIENT = Path(__file__).with_name("router_load_client.py")
NUM_CLIENTS = 4
HUGE_BYTES = 3_900_000  # under the 4 MiB gRPC receive limit
SMALL = pb.GenerateRequest(prompt="The three primary colors are",
                           sampling=pb.SamplingParams(max_tokens=8, ignore_eos=True))


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


@pytest.fixture(scope="module")
def server(smollm2_dir):
    engine = LLMEngine.from_config(EngineConfig(model=str(smollm2_dir), dtype="bfloat16",
                                                num_pages=160))
    srv = BackgroundServer(build_colocated_router(engine, model="smollm2"),
                           ServerConfig(port=0)).start()
    yield srv
    srv.stop()


@pytest.mark.timeout(300)
def test_small_request_keeps_its_latency_while_others_send_huge_prompts(server):
    target = f"127.0.0.1:{server.port}"
    with grpc.insecure_channel(target) as channel:
        stub = pb_grpc.RouterStub(channel)
        health = health_pb2_grpc.HealthStub(channel)

        def small() -> None:
            msgs = list(stub.Generate(SMALL, timeout=120))
            assert msgs[-1].usage.completion_tokens == 8

        small()  # warm-up
        unloaded = statistics.median(_timed(small) for _ in range(5))
        clients = [subprocess.Popen([sys.executable, str(CLIENT), target, str(seed),
                                     str(HUGE_BYTES)], stdout=subprocess.PIPE, text=True)
                   for seed in range(NUM_CLIENTS)]
        try:
            # Each client's first answer is in, so all of them are sending.
            answers = [c.stdout.readline().strip() for c in clients]
            loaded = statistics.median(_timed(small) for _ in range(5))
            health_s = max(_timed(lambda: health.Check(health_pb2.HealthCheckRequest(),
                                                       timeout=60)) for _ in range(5))
            stats_s = max(_timed(lambda: stub.Stats(pb.StatsRequest(), timeout=60))
                          for _ in range(5))
        finally:
            for c in clients:
                c.kill()
            for c in clients:
                c.wait(30)
    print(f"\n8-token request: unloaded {unloaded:.3f} s, loaded {loaded:.3f} s "
          f"({loaded / unloaded:.2f}x); Health max {health_s * 1e3:.1f} ms, Stats max "
          f"{stats_s * 1e3:.1f} ms")
    for answer in answers:
        assert answer.startswith("INVALID_ARGUMENT prompt: the prompt has 3900000 bytes"), answer
    # 2x is the goal (1.03x measured); 3x leaves room for a machine shared with other work and
    # still fails without the size bound (>300 s) or without the late refusal (6.8x).
    assert loaded < 3 * unloaded, (unloaded, loaded)
    assert health_s < 0.5 and stats_s < 0.5, (health_s, stats_s)
