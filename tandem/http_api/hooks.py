"""What the HTTP front reports about each generation request, for metrics and tracing that plug
in through `HttpServer(..., observer=...)` (or `build_app`): one `RequestRecord` per request of
/v1/chat/completions or /v1/completions, whatever its outcome."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True, slots=True, kw_only=True)
class RequestRecord:
    endpoint: str  # "/v1/chat/completions" or "/v1/completions"
    model: str  # as the request named it ("" when it named none)
    stream: bool
    # What the client got: 200, an error status, or 499 when it went away before the end (a
    # stream that failed after its first chunk shows 200 with `error_type` set).
    status: int
    error_type: str | None  # OpenAI's error `type` ("invalid_request_error", ...), or None
    finish_reason: str | None  # "stop", "length", "abort"; None when it did not finish
    request_id: str | None  # the router's id (None when refused before it got one)
    prompt_tokens: int
    completion_tokens: int
    started_at: float  # unix seconds, when the front received the request
    ttft_s: float | None  # router receipt -> first token
    latency_s: float  # receipt by the front -> the end of its answer


class Observer(Protocol):
    def request_ended(self, record: RequestRecord) -> None:
        """Called on the server's event loop once per request: keep it short, never raise."""
