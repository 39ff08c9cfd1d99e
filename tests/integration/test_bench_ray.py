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


@pytest.mark.timeout(240)
def test_bench_traces_a_disaggregated_deployment_whose_router_runs_in_its_own_actor(
        local_ray, tmp_path):
    """The bundled CPU disaggregated config: prefill, decode and router actors (the router in a
    `RouterActor`, not in the bench's process); `--trace` marks each request's stages in every
    one of those processes (they inherit TANDEM_TRACE) and the level's JSON has their medians,
    in request order; every actor is gone afterwards."""
    import time

    import ray

    from tandem.cli import main

    out = tmp_path / "disagg.json"
    rc = main(["bench", "--config", "cpu-disagg", "--concurrency", "1", "--num-requests", "2",
               "--num-warmup", "1", "--output-len", "4", "--trace", "--out", str(out),
               "--no-plot", "--no-progress"])
    assert rc == 0
    doc = json.loads(out.read_text())
    validate(doc)
    (run,) = doc["runs"]
    assert run["error"] is None and run["deployment"]["mode"] == "disaggregated"
    (lv,) = run["levels"]
    assert lv["num_completed"] == 2
    stages = lv["trace_stages_ms"]
    # router, prefill, prefill actor, router processes: the first token comes from prefill ...
    first = ["router.submit", "prefill.submit", "prefill.forward_end", "prefill.first",
             "router.first"]
    # ... while the KV lands at decode, which admits the request afterwards
    kv = ["prefill.forward_end", "decode.landed", "decode.admitted"]
    for order in (first, kv):
        assert [stages[s] for s in order] == sorted(stages[s] for s in order), stages
    assert out.with_suffix(".trace.jsonl").is_file()
    deadline = time.monotonic() + 20
    while ray.available_resources().get("CPU", 0) < ray.cluster_resources()["CPU"]:
        assert time.monotonic() < deadline, "a worker or the router actor still holds its CPU"
        time.sleep(0.2)
