"""The result JSON: a document built from hand-made records follows the schema, NaN becomes
null, the schema check names a broken field, and the plot is a real PNG."""

from __future__ import annotations

import copy
import json

import pytest

from tandem.bench import results
from tandem.bench.floors import Bandwidth, ModelFloors
from tandem.bench.load import LoadLevel
from tandem.bench.metrics import SLO, RequestRecord, SpecRecord, summarize
from tandem.engine.config import ModelConfig
from tandem.engine.presets import PRESETS

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _records(spec: bool) -> list[RequestRecord]:
    s = SpecRecord(mean_acceptance_length=2.0, per_position=(0.7, 0.3), num_rounds=4) if spec \
        else None
    return [RequestRecord(chunk_times_s=(0.1, 0.3, 0.4), chunk_tokens=(1, 2, 1), prompt_tokens=50,
                          start_s=0.05 * i, spec=s) for i in range(4)]


def make_doc() -> dict:
    model = ModelConfig.from_hf(PRESETS["smollm2-135m"])
    floors = ModelFloors(model=model, dtype_bytes=2,
                         memory=Bandwidth(bytes_per_s=20e9, method="CPU memcpy"),
                         link=Bandwidth(bytes_per_s=None, method="n/a"))
    slo = SLO(ttft_s=1.0, tpot_s=0.2)
    runs = []
    for name, spec in (("plain", False), ("eagle", True)):
        levels = []
        for c in (1, 4):
            recs = _records(spec)
            level = LoadLevel(concurrency=c)
            levels.append(results.level_json(level, summarize(recs, slo), floors, recs))
        runs.append({"name": name, "target": "127.0.0.1:1", "error": None, "levels": levels,
                     "floors": floors.to_json(),
                     "deployment": {"mode": "colocated", "speculative": spec,
                                    "model": "smollm2-135m", "load_format": "dummy",
                                    "dtype": "bfloat16", "device": "cpu",
                                    "transfer_backend": None, "num_prefill": 0, "num_decode": 1,
                                    "num_draft_steps": 2 if spec else None,
                                    "draft_topk": 1 if spec else None, "source": "x.yaml"}})
    return {"schema": results.SCHEMA, "date": results.now_iso(), "command": ["tandem", "bench"],
            "machine": results.machine_info(),
            "config": {"workload": {"kind": "random", "input_len": [50, 50],
                                    "output_len": [4, 4]},
                       "levels": [{"concurrency": 1, "request_rate": None,
                                   "max_concurrency": None},
                                  {"concurrency": 4, "request_rate": None,
                                   "max_concurrency": None}],
                       "num_requests": [4, 4], "num_warmup": 0,
                       "slo": {"ttft_s": 1.0, "tpot_s": 0.2}},
            "runs": runs}


def test_written_document_follows_the_schema(tmp_path):
    path = results.write(make_doc(), tmp_path / "r.json")
    doc = json.loads(path.read_text())
    results.validate(doc)
    lv = doc["runs"][1]["levels"][0]
    assert lv["acceptance"] == {"mean_length": 2.0, "per_position": [0.7, 0.3], "num_rounds": 16}
    assert lv["tpot_s"]["p50"] == pytest.approx(0.1)  # (0.4 - 0.1) / 3
    f = lv["floors"]
    assert f["tpot_floor_s"] > 0 and f["tpot_floor_spec_s"] == pytest.approx(
        f["tpot_floor_s"] / 2)
    assert f["transfer_floor_s"] is None  # no link measured
    assert doc["runs"][0]["levels"][0]["acceptance"] is None


def test_nan_is_written_as_null(tmp_path):
    doc = make_doc()
    failed = [RequestRecord(chunk_times_s=(), chunk_tokens=(), prompt_tokens=5,
                            error="UNAVAILABLE: gone")]
    floors = ModelFloors(model=None, dtype_bytes=2, memory=Bandwidth(bytes_per_s=None, method="-"),
                         link=Bandwidth(bytes_per_s=None, method="-"))
    doc["runs"][0]["levels"][0] = results.level_json(
        LoadLevel(concurrency=1), summarize(failed, SLO(ttft_s=1, tpot_s=1)), floors, failed)
    text = results.write(doc, tmp_path / "r.json").read_text()
    assert "NaN" not in text
    loaded = json.loads(text)
    results.validate(loaded)
    lv = loaded["runs"][0]["levels"][0]
    assert lv["ttft_s"]["p50"] is None and lv["errors"] == ["UNAVAILABLE: gone"]


@pytest.mark.parametrize("mutate, where", [
    (lambda d: d.pop("machine"), "$.machine: missing"),
    (lambda d: d.update(schema="other/1"), "$.schema"),
    (lambda d: d["runs"][0]["levels"][0].pop("goodput"), "levels[0].goodput"),
    (lambda d: d["runs"][1]["levels"][1]["ttft_s"].update(p99="x"), "levels[1].ttft_s.p99"),
    (lambda d: d["config"]["levels"][0].update(request_rate=2.0), "exactly one"),
    (lambda d: d["runs"][0]["deployment"].update(mode="both"), "deployment.mode"),
    (lambda d: d["runs"][0].update(error=3), "runs[0].error"),
])
def test_schema_check_names_the_field(mutate, where):
    doc = json.loads(json.dumps(results._clean(make_doc())))
    bad = copy.deepcopy(doc)
    mutate(bad)
    with pytest.raises(results.SchemaError, match=__import__("re").escape(where)):
        results.validate(bad)


def test_plot_is_a_real_png(tmp_path):
    from tandem.bench.plot import plot

    path = results.write(make_doc(), tmp_path / "r.json")
    png = plot(json.loads(path.read_text()), tmp_path / "r.png")
    data = png.read_bytes()
    assert data[:8] == PNG_MAGIC
    assert len(data) > 20_000  # four panels with lines and text, not an empty canvas


def test_request_rate_levels_with_an_infinite_rate(tmp_path):
    from tandem.bench.plot import plot

    doc = make_doc()
    rates = [LoadLevel(request_rate=2.0), LoadLevel(request_rate=float("inf"), max_concurrency=4)]
    doc["config"]["levels"] = [lv.to_json() for lv in rates]
    for run in doc["runs"]:
        for level, lv in zip(rates, run["levels"]):
            lv["load"] = level.to_json()
    path = results.write(doc, tmp_path / "r.json")
    loaded = json.loads(path.read_text())
    results.validate(loaded)
    assert loaded["config"]["levels"][1]["request_rate"] == "inf"
    assert plot(loaded, tmp_path / "r.png").read_bytes()[:8] == PNG_MAGIC
