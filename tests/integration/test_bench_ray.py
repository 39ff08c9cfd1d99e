"""`tandem bench --config` on a local Ray instance: the bundled CPU colocated config (SmolLM2
with its EAGLE head in one `ColocatedServer` actor) starts, is benchmarked through its gRPC
API, stops, and its run lands in a schema-valid JSON with the CPU memcpy floor."""

from __future__ import annotations

import json

import pytest

from tandem.bench.results import validate

pytestmark = pytest.mark.slow


@pytest.fixture
def local_ray(smollm2_dir):  # the bundled model imported before the actor needs it
    import ray

    from tandem.deploy.launcher import init_ray

    init_ray(num_cpus=4)
    yield
    ray.shutdown()


@pytest.mark.timeout(180)
def test_bench_starts_benchmarks_and_stops_a_colocated_deployment(local_ray, tmp_path):
    import ray

    from tandem.cli import main

    out = tmp_path / "ray.json"
    rc = main(["bench", "--config", "cpu-colocated", "--concurrency", "2", "--num-requests", "2",
               "--output-len", "4", "--out", str(out), "--no-plot", "--no-progress"])
    assert rc == 0
    doc = json.loads(out.read_text())
    validate(doc)
    (run,) = doc["runs"]
    assert run["error"] is None and run["name"] == "cpu-colocated"
    assert run["deployment"]["mode"] == "colocated" and run["deployment"]["speculative"]
    (lv,) = run["levels"]
    assert lv["num_completed"] == 2 and lv["mean_output_tokens"] == 4
    assert lv["acceptance"] is not None
    assert "CPU memcpy" in run["floors"]["memory_bandwidth"]["method"]
    assert lv["floors"]["tpot_floor_s"] > 0
    # The deployment is gone: its actor's CPU is back (released asynchronously).
    import time

    deadline = time.monotonic() + 20
    while ray.available_resources().get("CPU", 0) < ray.cluster_resources()["CPU"]:
        assert time.monotonic() < deadline, "the colocated actor still holds its CPU"
        time.sleep(0.2)
