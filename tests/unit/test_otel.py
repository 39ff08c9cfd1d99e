"""Request tracing's own pieces (tandem/otel.py): where spans go (flag, YAML, the standard
environment; errors name the key), the no-op while off, parent links through traceparent strings
to a real OTLP/HTTP receiver on 127.0.0.1, and what a worker process inherits."""

from __future__ import annotations

import pytest
from otlp_receiver import OtlpReceiver

from tandem import otel


@pytest.fixture
def receiver():
    r = OtlpReceiver()
    otel.configure(otel.traces_url(r.url, "test"), "tandem-test", instance="t0")
    yield r
    otel.shutdown()
    r.close()


def test_where_spans_go():
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"}
    assert otel.endpoint_from(None, None, {}) is None
    assert otel.endpoint_from("http://a:4318", "http://b:4318", env) == "http://a:4318/v1/traces"
    assert otel.endpoint_from(None, "https://b:4318/", env) == "https://b:4318/v1/traces"
    assert otel.endpoint_from(None, None, env) == "http://collector:4318/v1/traces"
    # A traces URL is taken as it is, whatever its path (the standard variable's meaning)
    assert otel.endpoint_from(None, None, {**env, "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT":
                                           "http://c:4318/custom"}) == "http://c:4318/custom"
    assert otel.endpoint_from("http://a:1/v1/traces", None, {}) == "http://a:1/v1/traces"
    for off in ({"OTEL_SDK_DISABLED": "true"}, {"OTEL_TRACES_EXPORTER": "none"}):
        assert otel.endpoint_from(None, None, {**env, **off}) is None
        assert otel.endpoint_from("http://a:1", None, {**env, **off}) == "http://a:1/v1/traces"
    for flag, configured, start in [("localhost:4318", None, "--otlp-endpoint: must be"),
                                    ("ftp://h:1", None, "--otlp-endpoint: must be"),
                                    (None, "http://", "observability.otlp_endpoint: must be")]:
        with pytest.raises(ValueError) as e:
            otel.endpoint_from(flag, configured, {})
        assert str(e.value).startswith(start)
    with pytest.raises(ValueError, match="^OTEL_EXPORTER_OTLP_ENDPOINT: must be"):
        otel.endpoint_from(None, None, {"OTEL_EXPORTER_OTLP_ENDPOINT": "collector"})


def test_off_builds_nothing():
    assert not otel.enabled()
    span = otel.start("x", "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01")
    assert span is otel.NOOP and span.traceparent == ""
    span.set("k", 1), span.event("e"), span.fail("no"), span.end()
    assert otel.env_vars() == {} and otel.flush()


def test_spans_link_through_traceparents(receiver, monkeypatch):
    client = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    root = otel.start("root", client, kind=otel.SERVER, attrs={"tandem.request_id": "r1"})
    remote = otel.start("remote", root.traceparent)  # as a worker starts under a command's
    local = otel.start("local", root)
    remote.fail(ValueError("boom"))
    for span in (remote, local, root):
        span.end()
    remote.end()  # a second end does nothing
    fresh = otel.start("fresh", "not a traceparent")
    fresh.end()
    otel.flush()
    got = {s.name: s for s in receiver.wait_for(lambda s: len(s) == 4, 10)}
    assert set(got) == {"root", "remote", "local", "fresh"} and receiver.paths[0] == "/v1/traces"
    assert {s.trace_id for n, s in got.items() if n != "fresh"} == {client[3:35]}
    assert got["root"].parent_id == client[36:52] and got["root"].attrs == {
        "tandem.request_id": "r1"}
    assert got["remote"].parent_id == got["local"].parent_id == got["root"].span_id
    assert (got["remote"].status, got["remote"].status_message) == (2, "boom")
    assert got["remote"].attrs["error.type"] == "ValueError"
    assert got["fresh"].parent_id == "" and got["fresh"].trace_id != got["root"].trace_id
    assert got["root"].service == "tandem-test"
    # A worker started from this process traces to the same place, with the same settings
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")
    env = otel.env_vars()
    assert env[otel.ENDPOINT_ENV] == receiver.url + "/v1/traces"
    assert env["OTEL_BSP_SCHEDULE_DELAY"] == "100"


def test_the_yaml_section_and_the_serve_flag(monkeypatch):
    from tandem.cli.app import build_parser
    from tandem.cli.serve import _tracing
    from tandem.deploy.config import ObservabilityConfig, parse_deploy
    from tandem.engine.config import ConfigError

    assert parse_deploy({}).observability == ObservabilityConfig()  # off unless asked
    cfg = parse_deploy({"observability": {"otlp_endpoint": "http://jaeger:4318"}})
    assert cfg.observability.otlp_endpoint == "http://jaeger:4318"
    for raw, start in [({"otlp_endpoint": "jaeger:4318"}, "observability.otlp_endpoint: must be"),
                       ({"otlp_endpoint": 4318}, "observability.otlp_endpoint: must be"),
                       ({"otlp_endpont": "http://j:1"}, "observability.otlp_endpont: unknown key"),
                       ("http://j:1", "observability: expected a mapping")]:
        with pytest.raises(ConfigError) as e:
            parse_deploy({"observability": raw})
        assert str(e.value).startswith(start), (raw, str(e.value))

    for key in ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
        monkeypatch.delenv(key, raising=False)
    parse = build_parser().parse_args
    try:
        assert _tracing(parse(["serve"]), None) == "" and not otel.enabled()
        assert _tracing(parse(["serve"]), "http://127.0.0.1:9/") == (
            "; traces to http://127.0.0.1:9/v1/traces")
        assert otel.env_vars()[otel.ENDPOINT_ENV] == "http://127.0.0.1:9/v1/traces"
        note = _tracing(parse(["serve", "--otlp-endpoint", "http://127.0.0.1:8"]),
                        "http://127.0.0.1:9")  # the flag over the config
        assert note == "; traces to http://127.0.0.1:8/v1/traces"
        with pytest.raises(ValueError, match="^--otlp-endpoint: must be"):
            _tracing(parse(["serve", "--otlp-endpoint", "127.0.0.1:8"]), None)
    finally:
        otel.shutdown()


def test_a_worker_s_room_spans(receiver):
    from tandem.messages import DecodeOutput, PrefillResult
    from tandem.worker import RoomSpans

    parent = otel.start("decode")
    spans = RoomSpans(page_bytes=100)
    spans.open(1, "", "kv.receive")  # untraced request: nothing kept
    RoomSpans(reporting=False).open(2, parent.traceparent, "kv.receive")  # another rank reports
    assert not spans
    spans.open(3, parent.traceparent, "kv.receive")
    spans.open(4, parent.traceparent, "kv.receive")
    spans.open(5, parent.traceparent, "prefill.queue")
    assert spans and spans.in_phase("kv.receive") == [3, 4]
    spans.pages(3, 2)
    spans.phase(3, "decode.generate")
    spans.outputs([DecodeOutput(room=3, token_ids=(7, 8), text_delta="", finished=False),
                   DecodeOutput(room=9, token_ids=(1,), text_delta="", finished=True),
                   DecodeOutput(room=3, token_ids=(9,), text_delta="", finished=True,
                                finish_reason="length")])
    spans.aborted(4)
    spans.results([PrefillResult(room=5, ok=False, error="transfer timed out",
                                 error_kind="timeout")])
    assert not spans
    parent.end()
    otel.flush()
    got = receiver.wait_for(lambda s: len(s) == 5, 10)
    by = {(s.name, s.attrs.get("tandem.aborted", False)): s for s in got}
    receive = by["kv.receive", False]
    assert receive.attrs == {"tandem.kv.pages": 2, "tandem.kv.bytes": 200}
    generate = by["decode.generate", False]
    assert generate.attrs == {"gen_ai.usage.output_tokens": 3,
                              "gen_ai.response.finish_reasons": "length"}
    assert receive.end_ns <= generate.start_ns and generate.status == 0
    assert by["kv.receive", True].status == 0  # an abort is no failure
    queue = by["prefill.queue", False]
    assert (queue.status, queue.status_message) == (2, "transfer timed out")
    assert queue.attrs["tandem.error_kind"] == "timeout"
    assert {s.parent_id for s in got if s.name != "decode"} == {by["decode", False].span_id}
