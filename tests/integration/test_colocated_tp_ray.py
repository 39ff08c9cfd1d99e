"""A colocated deployment of TP = 2 on a local Ray instance, as `tandem bench` starts it
(bench/deployments.py): two `ColocatedServer` actors in one placement group, rank 0 serving the
gRPC API and driving rank 1 in lockstep. Greedy float32 output through the API equals one
engine's, speculative and plain; the deployment's CPUs come back when it stops. A config that
asks a colocated server for DP attention is refused, naming the field."""

from __future__ import annotations

import time

import grpc
import pytest
import yaml
from grpc_system import dirs, local_ray  # noqa: F401 (module fixtures: the tiny model, Ray)

from tandem.engine import EngineConfig, LLMEngine, SamplingParams

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.timeout(300)

PROMPTS = [[5, 9, 14, 3], [7, 7, 21, 40, 2, 8], [100, 3]]


def _config(path, dirs, speculative: bool, **decode) -> str:
    model_dir, head_dir = dirs
    path.write_text(yaml.safe_dump({
        "name": "tiny-colocated-tp2", "mode": "colocated", "speculative": speculative,
        "model_name": "tiny",
        "engine": {"model": str(model_dir), "dtype": "float32", "page_size": 4,
                   "num_pages": 256},
        "spec": {"draft_model": str(head_dir), "num_steps": 3},
        "decode": {"tp": 2, "num_cpus": 1, **decode}}))
    return str(path)


def _tokens(address: str, prompt: list[int], n: int) -> list[int]:
    from tandem.proto import router_pb2 as pb
    from tandem.proto import router_pb2_grpc as pb_grpc

    with grpc.insecure_channel(address) as ch:
        stub = pb_grpc.RouterStub(ch)
        req = pb.GenerateRequest(model="tiny", prompt_token_ids=prompt,
                                 sampling=pb.SamplingParams(max_tokens=n, ignore_eos=True))
        return [t for msg in stub.Generate(req, timeout=60) for t in msg.token_ids]


@pytest.mark.parametrize("speculative", [True, False], ids=["spec", "plain"])
def test_colocated_tp2_on_ray_equals_one_engine(local_ray, dirs, tmp_path, speculative):
    from tandem.bench import deployments
    from tandem.bench.config import load_bench_file

    run, _ = load_bench_file(_config(tmp_path / "c.yaml", dirs, speculative))
    started = deployments.start(run.deployment, startup_timeout_s=120)
    try:
        got = [_tokens(started.address, p, 9) for p in PROMPTS]
    finally:
        started.close()
    one = LLMEngine.from_config(EngineConfig(model=str(dirs[0]), dtype="float32", page_size=4,
                                             num_pages=256))
    want = [list(c.output_ids) for c in one.generate(
        PROMPTS, SamplingParams(max_new_tokens=9, ignore_eos=True))]
    assert got == want
    deadline = time.monotonic() + 20  # both ranks' CPUs back (released asynchronously)
    while ray.available_resources().get("CPU", 0) < ray.cluster_resources()["CPU"]:
        assert time.monotonic() < deadline, "a colocated rank still holds its CPU"
        time.sleep(0.2)


def test_colocated_dp_is_refused(dirs, tmp_path):
    from tandem.bench.config import load_bench_file
    from tandem.engine.config import ConfigError

    with pytest.raises(ConfigError, match="decode.dp"):
        load_bench_file(_config(tmp_path / "c.yaml", dirs, True, dp=2))
