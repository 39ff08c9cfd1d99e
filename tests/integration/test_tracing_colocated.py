"""OpenTelemetry tracing, colocated and in-process: a tiny llama behind the router with its gRPC and
HTTP fronts on 127.0.0.1, exporting to a test OTLP/HTTP receiver on 127.0.0.1.

Checks: one request is one trace -- the root span `tandem.request` with `router.prepare` and
`router.dispatch` as its children, their attributes (request id, model, token counts, finish
reason, worker, first-token event); a client's `traceparent` (HTTP header, gRPC metadata)
becomes the root span's parent; a refused request's spans end failed; `tandem serve
--otlp-endpoint` exports the spans of the requests it served (by its exit at the latest)."""

from __future__ import annotations

import os
import subprocess
import sys

import grpc
import httpx2
import pytest
from hf_tiny import save_tiny
from http_helpers import write_word_tokenizer
from otlp_receiver import OtlpReceiver
from process_helpers import reap, stop_cleanly, wait_for_line

from tandem import otel
from tandem.colocated_node import build_colocated_router
from tandem.engine import EngineConfig, LLMEngine
from tandem.http_api import HttpConfig, HttpServer
from tandem.proto import router_pb2 as pb
from tandem.proto import router_pb2_grpc as pb_grpc
from tandem.router.app import BackgroundServer
from tandem.router.server import ServerConfig

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

N = 5
# A client's trace per request (the trace ids differ, so no test sees another's spans)
CLIENT_TRACES = {"http": "4bf92f3577b34da6a3ce929d0e0e4736",
                 "grpc": "4bf92f3577b34da6a3ce929d0e0e4737",
                 "refused": "4bf92f3577b34da6a3ce929d0e0e4738"}
CLIENT_SPAN = "00f067aa0ba902b7"
ERROR = 2  # the OTLP status code of a failed span


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    model_dir, _ = save_tiny("llama", tmp_path_factory.mktemp("otel"))
    write_word_tokenizer(model_dir)
    return model_dir


@pytest.fixture(scope="module")
def system(tiny_dir):
    receiver = OtlpReceiver()
    otel.configure(otel.traces_url(receiver.url, "test"), "tandem-router")
    engine = LLMEngine.from_config(EngineConfig(model=str(tiny_dir), dtype="float32",
                                                page_size=4, num_pages=64))
    router = build_colocated_router(engine, model="tiny", worker="colocated-0")
    http = HttpServer(router, HttpConfig(port=0))
    server = BackgroundServer(router, ServerConfig(port=0), fronts=[http]).start()
    channel = grpc.insecure_channel(f"127.0.0.1:{server.port}")
    yield receiver, http.port, pb_grpc.RouterStub(channel)
    channel.close()
    server.stop()
    otel.shutdown()
    receiver.close()


def _trace(receiver: OtlpReceiver, root_of, names: set[str]) -> dict[str, object]:
    """The spans (by name) of the trace whose root span `root_of(span)` picks, once every name
    in `names` arrived."""
    otel.flush()

    def complete(spans) -> bool:
        roots = [s for s in spans if s.name == "tandem.request" and root_of(s)]
        return bool(roots) and names <= {s.name for s in spans
                                         if s.trace_id == roots[0].trace_id}

    spans = receiver.wait_for(complete, 10)
    (root,) = [s for s in spans if s.name == "tandem.request" and root_of(s)]
    got = {s.name: s for s in spans if s.trace_id == root.trace_id}
    assert names <= set(got), (names, sorted(got))
    return got


def _post(port: int, body: dict, headers: dict | None = None) -> httpx2.Response:
    return httpx2.post(f"http://127.0.0.1:{port}/v1/completions", json=body,
                       headers=headers or {}, timeout=60)


def test_one_request_is_one_trace_with_its_stages(system):
    receiver, port, _ = system
    out = _post(port, {"model": "tiny", "prompt": "w3 w1 w4 w1", "max_tokens": N,
                       "ignore_eos": True, "user": "tracing"})
    assert out.status_code == 200, out.text
    got = _trace(receiver, lambda s: s.attrs.get("tandem.api") == "/v1/completions"
                 and s.parent_id == "",
                 {"tandem.request", "router.prepare", "router.dispatch"})
    root, prepare, dispatch = got["tandem.request"], got["router.prepare"], got["router.dispatch"]
    assert root.parent_id == ""  # no client context: the request starts the trace
    assert prepare.parent_id == dispatch.parent_id == root.span_id
    assert root.service == "tandem-router" and root.kind == 2  # SERVER
    assert root.attrs["tandem.request_id"]
    assert root.attrs["gen_ai.request.model"] == "tiny"
    assert root.attrs["gen_ai.usage.input_tokens"] == 4
    assert root.attrs["gen_ai.usage.output_tokens"] == N
    assert root.attrs["gen_ai.response.finish_reasons"] == "length"
    assert root.attrs["tandem.status"] == "OK"
    assert root.attrs["tandem.prefill_worker"] == root.attrs["tandem.decode_worker"] == (
        "colocated-0")
    assert "first_token" in root.events and "first_token" in dispatch.events
    assert dispatch.attrs["tandem.worker"] == "colocated-0"
    assert dispatch.attrs["gen_ai.usage.output_tokens"] == N
    # The stages nest in time: prepare, then dispatch, inside the root
    assert root.start_ns <= prepare.start_ns <= prepare.end_ns <= dispatch.start_ns
    assert dispatch.end_ns <= root.end_ns
    assert root.status == prepare.status == dispatch.status == 0


def test_a_client_traceparent_becomes_the_parent(system):
    receiver, port, stub = system
    for api in ("http", "grpc"):
        parent = f"00-{CLIENT_TRACES[api]}-{CLIENT_SPAN}-01"
        if api == "http":
            out = _post(port, {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": N,
                               "ignore_eos": True}, {"traceparent": parent})
            assert out.status_code == 200, out.text
        else:
            req = pb.GenerateRequest(prompt_token_ids=[5, 6, 7],
                                     sampling=pb.SamplingParams(max_tokens=N, ignore_eos=True))
            assert sum(len(m.token_ids) for m in stub.Generate(
                req, timeout=60, metadata=(("traceparent", parent),))) == N
        got = _trace(receiver, lambda s, t=CLIENT_TRACES[api]: s.trace_id == t,
                     {"tandem.request", "router.prepare", "router.dispatch"})
        root = got["tandem.request"]
        assert root.parent_id == CLIENT_SPAN, api
        assert root.attrs["tandem.api"] == ("grpc" if api == "grpc" else "/v1/completions")
        assert got["router.dispatch"].parent_id == root.span_id


def test_a_refused_request_ends_its_spans_failed(system):
    receiver, _, stub = system
    parent = f"00-{CLIENT_TRACES['refused']}-{CLIENT_SPAN}-01"
    req = pb.GenerateRequest(prompt_token_ids=[5, 100000],  # beyond the vocabulary
                             sampling=pb.SamplingParams(max_tokens=N))
    with pytest.raises(grpc.RpcError) as e:
        list(stub.Generate(req, timeout=60, metadata=(("traceparent", parent),)))
    assert e.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    got = _trace(receiver, lambda s: s.trace_id == CLIENT_TRACES["refused"],
                 {"tandem.request", "router.prepare"})
    root, prepare = got["tandem.request"], got["router.prepare"]
    assert "router.dispatch" not in got
    assert root.status == prepare.status == ERROR
    assert root.attrs["tandem.status"] == "INVALID_ARGUMENT"
    assert root.attrs["tandem.outcome"] == "rejected"
    assert root.status_message.startswith("prompt_token_ids")


def test_tandem_serve_exports_to_the_otlp_endpoint(tiny_dir):
    receiver = OtlpReceiver()
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "tandem.cli", "serve", "--model", str(tiny_dir), "--dtype",
         "float32", "--served-model-name", "tiny", "--port", "0", "--http-port", "0",
         "--otlp-endpoint", receiver.url],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**env, "PYTHONUNBUFFERED": "1"})
    trace_id = "6bf92f3577b34da6a3ce929d0e0e4736"
    try:
        m, lines = wait_for_line(proc, r"HTTP API on 127\.0\.0\.1:(\d+)", timeout_s=90)
        port = int(m.group(1))
        assert f"traces to {receiver.url}/v1/traces" in lines[-1]
        out = _post(port, {"model": "tiny", "prompt": "w3 w1 w4", "max_tokens": 3,
                           "ignore_eos": True}, {"traceparent": f"00-{trace_id}-{CLIENT_SPAN}-01"})
        assert out.status_code == 200, out.text
        stop_cleanly(proc, lines)  # the spans leave by the exit at the latest
    finally:
        reap(proc)
    spans = receiver.wait_for(lambda s: len([x for x in s if x.trace_id == trace_id]) >= 3, 10)
    receiver.close()
    got = {s.name: s for s in spans if s.trace_id == trace_id}
    assert {"tandem.request", "router.prepare", "router.dispatch"} <= set(got)
    assert got["tandem.request"].parent_id == CLIENT_SPAN
    assert got["tandem.request"].service == "tandem-router"
    assert got["tandem.request"].attrs["gen_ai.usage.output_tokens"] == 3
