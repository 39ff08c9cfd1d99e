"""The OpenAI-compatible HTTP front: /v1/chat/completions and /v1/completions (streamed as SSE or
whole), /v1/models and /health, on FastAPI and uvicorn, over the same `Router` as the gRPC front
and on the same event loop (`tandem serve --http-port N`).

Torch-free like the router: it imports the router, the request vocabulary and the tokenizer's
message type, never the engine, spec or kvtransfer (pyproject.toml [tool.importlinter]).

Public API: `HttpConfig`, `HttpServer` (start/stop on the running loop), `build_app` (the ASGI
app alone), and the hook for metrics and tracing, `Observer` with its `RequestRecord`.
"""

from tandem.http_api.app import build_app
from tandem.http_api.config import HttpConfig
from tandem.http_api.hooks import Observer, RequestRecord
from tandem.http_api.server import HttpServer

__all__ = ["HttpConfig", "HttpServer", "Observer", "RequestRecord", "build_app"]
