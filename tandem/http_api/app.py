"""`build_app`: the OpenAI-compatible routes over a `Router`, as a FastAPI (ASGI) app.

Routes convert and delegate (convert.py, generation.py); every answer other than 200 is an
error in OpenAI's shape (errors.py), including FastAPI's own: a body that does not parse is a 400
naming the field (FastAPI would say 422), an unknown path a 404.

    POST /v1/chat/completions, POST /v1/completions   generation, streamed (SSE) or whole
    GET  /v1/models                                   the served models
    GET  /health                                      200 while some model can take a request,
                                                      503 otherwise (no token needed)
    GET  /metrics                                     the router's Prometheus metrics (text)
"""

from __future__ import annotations

import time

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException
from starlette.responses import Response

from tandem import otel
from tandem.http_api.config import HttpConfig
from tandem.http_api.convert import Call, chat_call, completion_call
from tandem.http_api.errors import ApiError, from_validation_errors
from tandem.http_api.generation import GenerationResponse
from tandem.http_api.hooks import Observer
from tandem.http_api.middleware import BearerAuth, BodyLimit
from tandem.http_api.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    ModelCard,
    ModelList,
)
from tandem.router import Router

JSON = "application/json"


def build_app(router: Router, cfg: HttpConfig, *, observer: Observer | None = None) -> FastAPI:
    """The app over `router` (shared with any other front); `observer` hears of every
    generation request's end (hooks.py)."""
    models = tuple(router.dispatcher.models())
    up_since = int(time.time())
    # No /docs or /openapi.json: the server exposes nothing but the API.
    app = FastAPI(title="tandem", docs_url=None, redoc_url=None, openapi_url=None)

    def generation(call: Call, request: Request, started_at: float) -> GenerationResponse:
        client = request.client
        # The router's id space for this client (as the gRPC front uses its peer address).
        caller = f"http:{client.host}:{client.port}" if client is not None else "http"
        # The client's W3C trace context, the parent of the request's span (tracing on only)
        traceparent = request.headers.get("traceparent", "") if otel.enabled() else ""
        return GenerationResponse(router, call, caller=caller, started_at=started_at,
                                  observer=observer, traceparent=traceparent)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        now = time.time()
        return generation(chat_call(body, models, int(now)), request, now)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        now = time.time()
        return generation(completion_call(body, models, int(now)), request, now)

    @app.get("/v1/models")
    async def list_models() -> Response:
        cards = [ModelCard(id=m.name, created=up_since, max_model_len=m.max_model_len)
                 for m in models]
        return Response(ModelList(data=cards).model_dump_json(), media_type=JSON)

    @app.get("/health")
    async def health() -> Response:
        if router.serving():
            return Response(b'{"status": "serving"}', media_type=JSON)
        return Response(b'{"status": "not serving"}', status_code=503, media_type=JSON)

    @app.get("/metrics")
    async def metrics() -> Response:
        body, content_type = router.metrics_text()
        return Response(body, media_type=content_type)

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError) -> Response:
        return _error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def invalid_body(request: Request, exc: RequestValidationError) -> Response:
        return _error_response(from_validation_errors(exc.errors()))

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> Response:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return _error_response(ApiError(status=exc.status_code, type=kind,
                                        message=f"{request.url.path}: {exc.detail}"))

    # Added last = outermost: the token is checked before any of the body is read.
    app.add_middleware(BodyLimit, max_bytes=cfg.max_body_bytes)
    if cfg.auth_token is not None:
        app.add_middleware(BearerAuth, token=cfg.auth_token, public_paths=cfg.public_paths)
    return app


def _error_response(err: ApiError) -> Response:
    return Response(err.body(), status_code=err.status, headers=err.headers(), media_type=JSON)
