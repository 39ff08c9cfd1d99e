"""Tracing off costs nothing: a router process that serves requests -- a client's `traceparent`
included -- without tracing on loads no OpenTelemetry module at all (`tandem serve`'s own check of
the flag, the config and the environment included). Run in a fresh interpreter: this test process
may have loaded OpenTelemetry for other tests.

The HTTP front is the one exception, and not ours: FastAPI imports the OpenTelemetry API for its
own (off unless a global provider is installed, which tandem never does); there the check is that
nothing loads the SDK or the exporter."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

SERVE = textwrap.dedent("""
    import asyncio, sys
    from tandem.messages import FinishReason
    from tandem.router import (DispatcherStats, ModelInfo, Router, TokenChunk, WorkerInfo,
                               WorkerRole)
    import tandem.router.disagg  # the disaggregated dispatcher's module too

    class OneToken:
        def models(self):
            return (ModelInfo(name="m", vocab_size=8, max_model_len=16, max_request_tokens=16),)
        def workers(self):
            return [WorkerInfo(name="w", role=WorkerRole.COLOCATED, model="m")]
        async def submit(self, request):
            assert request.traceparent == ""  # an untraced request carries no context
            yield TokenChunk(request_id=request.request_id, token_ids=(3,), text_delta="x",
                             finish_reason=FinishReason.LENGTH)
        async def abort(self, request_id):
            return False
        def stats(self):
            return DispatcherStats(spec=None)
        async def close(self):
            pass

    PARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    router = Router(OneToken(), {"m": None})
""")

GRPC = SERVE + textwrap.dedent("""
    import grpc
    from tandem.cli.app import build_parser
    from tandem.cli.serve import _tracing
    from tandem.proto import router_pb2 as pb, router_pb2_grpc as pb_grpc
    from tandem.router.app import BackgroundServer
    from tandem.router.server import ServerConfig

    assert _tracing(build_parser().parse_args(["serve"]), None) == ""
    server = BackgroundServer(router, ServerConfig(port=0)).start()
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        req = pb.GenerateRequest(prompt_token_ids=[1, 2])
        out = list(pb_grpc.RouterStub(channel).Generate(req, timeout=30,
                                                        metadata=(("traceparent", PARENT),)))
    server.stop()
    assert [list(m.token_ids) for m in out] == [[3]], out
    loaded = sorted(m for m in sys.modules if m.split(".")[0] == "opentelemetry")
    assert not loaded, loaded[:5]
""")

HTTP = SERVE + textwrap.dedent("""
    import http.client, json
    from tandem.http_api import HttpConfig, HttpServer

    def post(port):
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        conn.request("POST", "/v1/completions", json.dumps({"prompt": [1, 2]}),
                     {"content-type": "application/json", "traceparent": PARENT})
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read())

    async def main():
        server = HttpServer(router, HttpConfig(port=0))
        port = await server.start()
        status, body = await asyncio.to_thread(post, port)
        await server.stop()
        assert status == 200 and body["choices"][0]["text"] == "x", body

    asyncio.run(main())
    loaded = sorted(m for m in sys.modules
                    if m.startswith(("opentelemetry.sdk", "opentelemetry.exporter")))
    assert not loaded, loaded[:5]
""")


def _run(code: str) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, env=env)
    assert out.returncode == 0, out.stderr[-3000:]


def test_a_grpc_router_loads_no_opentelemetry_module():
    _run(GRPC)


def test_the_http_front_loads_no_opentelemetry_sdk():
    _run(HTTP)
