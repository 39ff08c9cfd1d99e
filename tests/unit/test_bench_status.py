"""`tandem bench` counts requests per final status and fails when any request did not end OK."""

from __future__ import annotations

import io

from tandem.bench.command import lv_label
from tandem.bench.metrics import RequestRecord
from tandem.bench.results import status_counts, status_of


def _rec(error=None, tokens=3) -> RequestRecord:
    return RequestRecord(chunk_times_s=(0.1,), chunk_tokens=(tokens,), prompt_tokens=4,
                         error=error)


def test_status_of_reads_the_grpc_code_from_the_driver_error():
    assert status_of(_rec()) == "OK"
    assert status_of(_rec("UNAVAILABLE: decode worker 'd' became unavailable")) == "UNAVAILABLE"
    assert status_of(_rec("RESOURCE_EXHAUSTED: queue: ...")) == "RESOURCE_EXHAUSTED"
    assert status_of(_rec("stream ended without a final message")) == "OTHER"
    assert status_of(_rec("aborted")) == "OTHER"
    assert status_counts([_rec(), _rec(), _rec("DEADLINE_EXCEEDED: x"), _rec("INTERNAL: y")]) == {
        "DEADLINE_EXCEEDED": 1, "INTERNAL": 1, "OK": 2}


def test_bench_exits_nonzero_when_a_request_failed(monkeypatch, tmp_path):
    from tandem.bench import command

    doc = {"runs": [{"name": "x", "error": None, "levels": [
        {"load": {"concurrency": 4}, "status_counts": {"OK": 3, "UNAVAILABLE": 1}}]}]}
    monkeypatch.setattr(command, "run_bench", lambda *a, **k: doc)
    monkeypatch.setattr(command, "_target_floors", lambda cmd: None)
    out = io.StringIO()
    rc = command.execute(command.BenchCommand(targets=("127.0.0.1:1",), out=tmp_path / "r.json",
                                              plot=False, progress=False), out)
    assert rc == 1 and "x c=4: UNAVAILABLE 1" in out.getvalue()
    doc["runs"][0]["levels"][0]["status_counts"] = {"OK": 4}
    assert command.execute(command.BenchCommand(targets=("127.0.0.1:1",),
                                                out=tmp_path / "r.json", plot=False,
                                                progress=False), io.StringIO()) == 0
    assert lv_label({"load": {"concurrency": None, "request_rate": 2.0}}) == "rate=2.0"
