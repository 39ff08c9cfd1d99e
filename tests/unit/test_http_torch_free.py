"""The HTTP front stands without torch, like the router it fronts (a router machine needs no GPU
libraries): importing it loads neither torch nor the engine, spec or kvtransfer packages, and
neither does answering a request through it. Run in a fresh interpreter: this test process has
torch."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

HEAVY = "('torch', 'tandem.engine', 'tandem.spec', 'tandem.kvtransfer')"
CHECK = (f"loaded = sorted({{m for m in sys.modules for h in {HEAVY} "
         "if m == h or m.startswith(h + '.')}); assert not loaded, loaded[:5]")


def _run(code: str) -> None:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]


@pytest.mark.parametrize("module", ["tandem.http_api", "tandem.http_api.app",
                                    "tandem.http_api.server", "tandem.http_api.generation"])
def test_importing_it_loads_no_torch(module):
    _run(f"import sys, {module}\n{CHECK}")


@pytest.mark.timeout(120)
def test_answering_a_request_loads_no_torch():
    code = textwrap.dedent("""
        import asyncio, http.client, json, sys
        from tandem.http_api import HttpConfig, HttpServer
        from tandem.messages import FinishReason
        from tandem.router import (DispatcherStats, ModelInfo, Router, TokenChunk, WorkerInfo,
                                   WorkerRole)

        class OneToken:
            def models(self):
                return (ModelInfo(name="m", vocab_size=8, max_model_len=16,
                                  max_request_tokens=16),)
            def workers(self):
                return [WorkerInfo(name="w", role=WorkerRole.COLOCATED, model="m")]
            async def submit(self, request):
                yield TokenChunk(request_id=request.request_id, token_ids=(3,),
                                 text_delta="x", finish_reason=FinishReason.LENGTH)
            async def abort(self, request_id):
                return False
            def stats(self):
                return DispatcherStats(spec=None)
            async def close(self):
                pass

        def post(port):
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
            conn.request("POST", "/v1/completions", json.dumps({"prompt": [1, 2]}),
                         {"content-type": "application/json"})
            resp = conn.getresponse()
            return resp.status, json.loads(resp.read())

        async def main():
            router = Router(OneToken(), {"m": None})
            server = HttpServer(router, HttpConfig(port=0))
            port = await server.start()
            status, body = await asyncio.to_thread(post, port)
            await server.stop()
            await router.close()
            assert status == 200 and body["choices"][0]["text"] == "x", body

        asyncio.run(main())
    """)
    _run(code + "\n" + CHECK)
