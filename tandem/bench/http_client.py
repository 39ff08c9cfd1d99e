"""`HttpClient`: the benchmark's requests over an OpenAI-compatible HTTP front (`tandem serve
--http-port`, or another server that speaks the same API), with httpx2 on one connection pool.

What is sent. Random and fixed prompts go to POST /v1/completions with `prompt` as the list of
token ids (OpenAI's API allows an array of integers; tandem's front passes it on as the gRPC
API's `prompt_token_ids`, so both drivers send the same tokens), plus `ignore_eos` (an
extension, named as vLLM names it) when the workload forces the length. Chat questions go to
POST /v1/chat/completions as one user message. Every request streams with
`stream_options.include_usage` and, given a token, carries `authorization: Bearer <token>`.

What is measured, next to the gRPC driver:
- A chunk is an SSE event whose choice carries text (`text`, or a chat delta's `content`) or a
  finish reason; a chat stream's role-only opening is not one. TTFT is the first chunk, the
  answer's end (latency) the last.
- Output tokens are the usage the server reports in its last event. OpenAI's chunks do not say
  how many tokens each carries (a speculative server streams a round's tokens as one chunk), so
  the first chunk counts one token (the prefill's) and the rest of the count is spread evenly
  over the other chunks (`spread`). TPOT and the mean ITL come out exactly as over gRPC; ITL
  percentiles are per chunk (its gap divided by its share). A server that sends no usage is
  counted one token per chunk, with a warning.
- Acceptance (tau) and the router's own TTFT: the OpenAI API carries neither, so both are
  n/a (`spec` and `server_ttft_s` None).
- Status (the record's error starts with the gRPC name the report counts it under): an answer
  other than 200 by `STATUS_NAMES` (the inverse of the front's table in
  tandem/http_api/errors.py); an error event mid-stream by its numeric `code` when it has one,
  else its `type` (`ERROR_TYPES`); a connection that cannot be made or breaks, UNAVAILABLE (what
  a gRPC channel says); the request's deadline, DEADLINE_EXCEEDED. HTTP has no deadline field,
  so the client enforces it: at the deadline it closes the connection, and the front aborts the
  request on the disconnect, as the router aborts a gRPC call whose deadline passed.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import httpx2

from tandem.bench.client import READY_TIMEOUT_S, DriverConfig
from tandem.bench.metrics import RequestRecord
from tandem.bench.workload import BenchRequest

log = logging.getLogger(__name__)

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"

# HTTP status -> the gRPC status name the report uses. The front's own mapping inverted
# (FAILED_PRECONDITION shares 400 with INVALID_ARGUMENT and reads as the latter), plus what other
# OpenAI-compatible servers answer: 422 for a body that does not validate, 502 from a proxy.
STATUS_NAMES: dict[int, str] = {
    400: "INVALID_ARGUMENT", 401: "UNAUTHENTICATED", 403: "PERMISSION_DENIED", 404: "NOT_FOUND",
    408: "DEADLINE_EXCEEDED", 409: "ALREADY_EXISTS", 413: "RESOURCE_EXHAUSTED",
    422: "INVALID_ARGUMENT", 429: "RESOURCE_EXHAUSTED", 499: "CANCELLED", 500: "INTERNAL",
    501: "UNIMPLEMENTED", 502: "UNAVAILABLE", 503: "UNAVAILABLE", 504: "DEADLINE_EXCEEDED",
}
# An error event's `type` (OpenAI's names, and the front's) -> the gRPC status name.
ERROR_TYPES: dict[str, str] = {
    "invalid_request_error": "INVALID_ARGUMENT", "not_found_error": "NOT_FOUND",
    "authentication_error": "UNAUTHENTICATED", "permission_error": "PERMISSION_DENIED",
    "rate_limit_error": "RESOURCE_EXHAUSTED", "service_unavailable": "UNAVAILABLE",
    "timeout": "DEADLINE_EXCEEDED", "cancelled": "CANCELLED", "server_error": "INTERNAL",
}


def status_name(http_status: int) -> str:
    return STATUS_NAMES.get(http_status, "UNKNOWN")


@dataclass(frozen=True, slots=True, kw_only=True)
class HttpWire:
    """One request, ready to send."""

    path: str  # COMPLETIONS or CHAT
    body: bytes  # JSON
    num_prompt_ids: int  # the prompt's length when sent as ids (0 for chat), if no usage comes


def request_body(req: BenchRequest, cfg: DriverConfig, model: str) -> HttpWire:
    body: dict[str, Any] = {"model": model, "max_tokens": req.max_tokens,
                            "temperature": cfg.temperature, "stream": True,
                            "stream_options": {"include_usage": True}}
    if req.ignore_eos:
        body["ignore_eos"] = True
    if req.question is not None:
        body["messages"] = [{"role": "user", "content": req.question}]
        return HttpWire(path=CHAT, body=json.dumps(body).encode(), num_prompt_ids=0)
    body["prompt"] = list(req.prompt_token_ids)
    return HttpWire(path=COMPLETIONS, body=json.dumps(body).encode(),
                    num_prompt_ids=len(req.prompt_token_ids))


def spread(num_tokens: int, num_chunks: int) -> tuple[int, ...]:
    """`num_tokens` over `num_chunks` chunks whose own counts are unknown: the first chunk one
    token (the prefill's), the others an even share of the rest, the earlier ones taking the
    remainder (so a trailing finish-only chunk of a server that sends one gets none)."""
    if num_chunks <= 1:
        return (num_tokens,) * num_chunks
    first = min(1, num_tokens)
    share, extra = divmod(num_tokens - first, num_chunks - 1)
    return (first, *(share + (i < extra) for i in range(num_chunks - 1)))


@dataclass(slots=True)
class _Answer:
    """What one answer showed so far; written only by its own request's coroutine (so a
    deadline that cancels the reading keeps what arrived)."""

    t0: float  # perf_counter when the request was sent
    times: list[float] = field(default_factory=list)  # [num_chunks] seconds since t0
    finish_reason: str | None = None
    prompt_tokens: int | None = None  # from the usage
    completion_tokens: int | None = None
    error: str | None = None

    def take(self, event: Any, t: float) -> bool:
        """One event's JSON, received `t` s after sending; False when it ends the answer."""
        if not isinstance(event, dict):
            self.error = f"unexpected event: {str(event)[:200]}"
            return False
        if event.get("error") is not None:
            self.error = _stream_error(event["error"])
            return False
        usage = event.get("usage")
        if isinstance(usage, dict):
            self.prompt_tokens = usage.get("prompt_tokens")
            self.completion_tokens = usage.get("completion_tokens")
        choices = event.get("choices") or []
        if not isinstance(choices, list) or not all(isinstance(c, dict) for c in choices):
            self.error = f"unexpected event: {str(event)[:200]}"
            return False
        for choice in choices:
            delta = choice.get("delta")
            text = choice.get("text") if "text" in choice else (
                delta.get("content") if isinstance(delta, dict) else None)
            reason = choice.get("finish_reason")
            if text or reason is not None:
                self.times.append(t)
            if reason is not None:
                self.finish_reason = reason
        return True


class HttpClient:
    """Owns nothing: the connection pool belongs to `connect`'s context."""

    def __init__(self, http: httpx2.AsyncClient, cfg: DriverConfig, model: str) -> None:
        self._http, self._cfg, self._model = http, cfg, model
        self._warned_no_usage = False

    @staticmethod
    @asynccontextmanager
    async def connect(cfg: DriverConfig) -> AsyncIterator[HttpClient]:
        headers = {"authorization": f"Bearer {cfg.auth_token}"} if cfg.auth_token else {}
        # No pool limit (the level's concurrency is the limit) and no per-read timeout (the
        # request's deadline is the limit). No proxy from the environment: the benchmark
        # measures the server, not a proxy in between.
        async with httpx2.AsyncClient(
                base_url=cfg.target.address, headers=headers, timeout=httpx2.Timeout(None),
                limits=httpx2.Limits(max_connections=None, max_keepalive_connections=None),
                trust_env=False) as http:
            model = await _served_model(http, cfg)
            yield HttpClient(http, cfg, model)

    def prepare(self, req: BenchRequest) -> HttpWire:
        return request_body(req, self._cfg, self._model)

    async def send(self, wire: HttpWire, t_level: float) -> RequestRecord:
        answer = _Answer(t0=time.perf_counter())
        timeout = self._cfg.request_timeout_s
        try:
            await asyncio.wait_for(self._exchange(wire, answer), timeout)
        except asyncio.TimeoutError:
            answer.error = (f"DEADLINE_EXCEEDED: no whole answer within {timeout:g} s (the "
                            "client closed the connection)")
        except httpx2.SSEError as exc:  # before TransportError, its base: the server's fault
            answer.error = f"not an event stream: {exc}"
        except httpx2.TransportError as exc:
            answer.error = f"UNAVAILABLE: {type(exc).__name__}: {exc}"
        return self._record(wire, answer, t_level)

    async def _exchange(self, wire: HttpWire, answer: _Answer) -> None:
        async with self._http.stream("POST", wire.path, content=wire.body,
                                     headers={"content-type": "application/json"}) as resp:
            if resp.status_code != 200:
                answer.error = _refusal(resp.status_code, await resp.aread())
                return
            async for sse in httpx2.EventSource(resp):
                t = time.perf_counter() - answer.t0
                if sse.data == "[DONE]":
                    return
                try:
                    event = json.loads(sse.data)
                except ValueError:
                    answer.error = f"event is not JSON: {sse.data[:200]}"
                    return
                if not answer.take(event, t):
                    return

    def _record(self, wire: HttpWire, answer: _Answer, t_level: float) -> RequestRecord:
        error = answer.error
        if error is None and answer.finish_reason is None:
            error = "stream ended without a final message"
        if error is None and answer.finish_reason == "abort":
            error = "aborted"
        num_tokens = answer.completion_tokens
        if num_tokens is None:
            if error is None and not self._warned_no_usage:
                log.warning("%s sends no usage with stream_options.include_usage: counting one "
                            "token per chunk", self._cfg.target)
                self._warned_no_usage = True
            num_tokens = len(answer.times)
        if error is None and (not answer.times or num_tokens < 1):
            error = "no tokens"
        prompt_tokens = answer.prompt_tokens
        return RequestRecord(
            chunk_times_s=tuple(answer.times),
            chunk_tokens=spread(max(num_tokens, 0), len(answer.times)),
            prompt_tokens=wire.num_prompt_ids if prompt_tokens is None else prompt_tokens,
            start_s=answer.t0 - t_level, error=error)


async def _served_model(http: httpx2.AsyncClient, cfg: DriverConfig) -> str:
    """Waits (up to READY_TIMEOUT_S) until the server answers GET /v1/models; the model to name
    in requests: `cfg.model`, else the first one listed, else "" (a server that would not list
    them, e.g. to a wrong token, then refuses or serves each request on its own)."""
    deadline = time.monotonic() + READY_TIMEOUT_S
    while True:
        try:
            resp = await http.get("/v1/models", timeout=5.0)
            break
        except httpx2.TransportError as exc:
            if time.monotonic() > deadline:
                raise ConnectionError(f"target: {cfg.target} did not answer within "
                                      f"{READY_TIMEOUT_S:g} s ({type(exc).__name__}: {exc})"
                                      ) from exc
            await asyncio.sleep(0.2)
    if cfg.model:
        return cfg.model
    try:
        return str(resp.json()["data"][0]["id"]) if resp.status_code == 200 else ""
    except (ValueError, KeyError, IndexError, TypeError):
        return ""


def _refusal(status: int, body: bytes) -> str:
    """The record's error for an answer other than 200: OpenAI's error message when the body
    has one, else the body's start."""
    try:
        message = str(json.loads(body)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        message = body[:200].decode("utf-8", "replace")
    return f"{status_name(status)}: HTTP {status}: {message}"


def _stream_error(err: Any) -> str:
    if not isinstance(err, dict):
        return f"UNKNOWN: error event: {str(err)[:200]}"
    code = err.get("code")
    if isinstance(code, int) and not isinstance(code, bool):
        name = status_name(code)
    else:
        name = ERROR_TYPES.get(str(err.get("type")), "UNKNOWN")
    return f"{name}: error event mid-stream: {err.get('message', '')}"
