"""`tandem bench --target` against a real server: SmolLM2 with its shipped EAGLE head in one
colocated `SpecEngine` behind the gRPC router on 127.0.0.1 (what `tandem serve --speculative`
runs), in process. A short run at two concurrency levels completes, every request is measured,
the JSON follows the schema and carries acceptance stats, and the PNG is a real image."""

from __future__ import annotations

import json

import pytest

from tandem.bench.results import validate
from tandem.colocated_node import build_colocated_router
from tandem.engine import EngineConfig
from tandem.router.app import BackgroundServer
from tandem.router.server import ServerConfig
from tandem.spec import SpecConfig, SpecEngine

pytestmark = pytest.mark.slow

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
OUTPUT_LEN = 6


@pytest.fixture(scope="module")
def target(smollm2_dir):  # imports the bundled model once; "default" finds it
    engine = SpecEngine.from_config(
        EngineConfig(model="default", dtype="bfloat16", num_pages=128, max_num_seqs=4),
        SpecConfig(num_steps=3))
    router = build_colocated_router(engine, model="smollm2")
    server = BackgroundServer(router, ServerConfig(port=0)).start()
    yield f"127.0.0.1:{server.port}"
    server.stop()


@pytest.mark.timeout(120)
def test_bench_target_writes_json_and_png(target, tmp_path, capsys):
    from tandem.cli import main

    out = tmp_path / "bench.json"
    rc = main(["bench", "--target", target, "--concurrency", "1,2", "--num-requests", "3",
               "--num-warmup", "1", "--input-len", "16:32", "--output-len", str(OUTPUT_LEN),
               "--vocab-size", "49152", "--floor-model", "smollm2-135m", "--out", str(out),
               "--no-progress"])
    printed = capsys.readouterr().out
    assert rc == 0, printed
    doc = json.loads(out.read_text())
    validate(doc)
    (run,) = doc["runs"]
    assert run["error"] is None and run["target"] == target
    assert [lv["load"]["concurrency"] for lv in run["levels"]] == [1, 2]
    for lv in run["levels"]:
        assert (lv["num_completed"], lv["num_failed"]) == (3, 0), lv["errors"]
        assert lv["mean_output_tokens"] == OUTPUT_LEN  # ignore_eos: forced to length
        assert 16 <= lv["mean_prompt_tokens"] <= 32
        assert 0 < lv["ttft_s"]["p50"] <= lv["latency_s"]["p50"]
        assert lv["tpot_s"]["mean"] > 0 and lv["output_throughput"] > 0
        acc = lv["acceptance"]
        assert acc is not None and acc["num_rounds"] > 0 and len(acc["per_position"]) == 3
        assert 1.0 <= acc["mean_length"] <= 4.0
        assert lv["floors"]["tpot_floor_s"] > 0  # smollm2 shape over this CPU's memcpy
    assert "CPU memcpy" in run["floors"]["memory_bandwidth"]["method"]
    png = out.with_suffix(".png").read_bytes()
    assert png[:8] == PNG_MAGIC and len(png) > 20_000
    assert "TPOT p50/p99 (floor)" in printed and "c=2" in printed


@pytest.mark.timeout(120)
def test_bench_chat_prompts(target, tmp_path):
    from tandem.cli import main

    out = tmp_path / "chat.json"
    rc = main(["bench", "--target", target, "--dataset", "chat", "--concurrency", "2",
               "--num-requests", "2", "--num-warmup", "0", "--output-len", "4",
               "--out", str(out), "--no-plot", "--no-progress"])
    assert rc == 0
    doc = json.loads(out.read_text())
    validate(doc)
    (lv,) = doc["runs"][0]["levels"]
    assert lv["num_completed"] == 2 and 1 <= lv["mean_output_tokens"] <= 4
    assert lv["mean_prompt_tokens"] > 10  # the chat template around a question
    assert not out.with_suffix(".png").exists()
