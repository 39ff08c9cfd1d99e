"""Request stage marks (tandem/trace.py): off by default, one line per mark when on, a report of
the median time to each stage that leaves out warm-up and rooms outside the window."""

from __future__ import annotations

import json

from tandem import trace


def test_marks_are_off_unless_the_environment_names_a_file(tmp_path, monkeypatch):
    path = tmp_path / "t.jsonl"
    monkeypatch.setenv(trace.ENV, str(path))
    trace.mark(1, "router.submit")
    monkeypatch.delenv(trace.ENV)  # the process's open file must not keep taking marks
    trace.mark(1, "router.first")
    assert not trace.enabled()
    assert [json.loads(x)["stage"] for x in path.read_text().splitlines()] == ["router.submit"]


def test_stage_report_orders_stages_by_median_and_skips_warmup(tmp_path, monkeypatch):
    path = tmp_path / "t.jsonl"
    lines = []
    for room, (t0, gaps) in enumerate([(100.0, (9.0, 9.0)),  # warm-up: slow, left out
                                       (200.0, (0.002, 0.010)), (300.0, (0.004, 0.012)),
                                       (400.0, (0.003, 0.011)), (900.0, (5.0, 5.0))]):
        lines += [{"room": room, "stage": "router.submit", "t": t0},
                  {"room": room, "stage": "prefill.call", "t": t0 + gaps[0]},
                  {"room": room, "stage": "router.first", "t": t0 + gaps[1]}]
    path.write_text("".join(json.dumps(m) + "\n" for m in lines) + '{"room": 9, "sta')
    rows = trace.stage_report(path, skip=1, window=(50.0, 500.0))
    assert [r[0] for r in rows] == ["router.submit", "prefill.call", "router.first"]
    assert [round(r[1], 3) for r in rows] == [0.0, 3.0, 11.0] and rows[-1][2] == 3
    assert "prefill.call" in trace.format_report(rows)
    monkeypatch.setenv(trace.ENV, str(tmp_path / "live.jsonl"))
    trace.mark(5, "decode.yield")
    assert json.loads((tmp_path / "live.jsonl").read_text())["stage"] == "decode.yield"


def test_an_unwritable_trace_file_turns_tracing_off_instead_of_failing(tmp_path, monkeypatch):
    monkeypatch.setenv(trace.ENV, str(tmp_path / "missing-dir" / "t.jsonl"))
    trace.mark(1, "router.submit")  # must not raise
    assert not trace.enabled()
