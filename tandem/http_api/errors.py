"""Errors in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}` with the HTTP
status that says what the client can do about it.

A router error's message starts with the field at fault as the gRPC API spells it
(`sampling.temperature: must be ...`, see router/validate.py); `from_router_error` renames that
field to the one the HTTP client sent (`temperature`), in the message and as `param`.

Status by router code: INVALID_ARGUMENT and FAILED_PRECONDITION 400, NOT_FOUND 404 (an unknown
model), ALREADY_EXISTS 409, RESOURCE_EXHAUSTED 429 (the router is full now: retry later),
UNAUTHENTICATED 401, UNAVAILABLE 503, DEADLINE_EXCEEDED 504, INTERNAL 500. One exception:
RESOURCE_EXHAUSTED that names a field of the request (`max_tokens: prompt + max_tokens needs more
KV cache than a worker has`) can never succeed, however long the client waits, so it is 400 --
a 429 would make OpenAI's SDK retry it.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence

from starlette.types import Send

from tandem.http_api.schemas import ErrorBody, ErrorInfo
from tandem.router import Code, RouterError

# "field: text", the field a path such as `messages[2].content` or `sampling.stop[0]`.
_FIELD = re.compile(r"^([A-Za-z_][\w.\[\]]*): ")


class ApiError(Exception):
    """An answer other than 200: the status and OpenAI's error fields."""

    def __init__(self, *, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = (status, message, type,
                                                                       param, code)

    def body(self) -> bytes:
        return ErrorBody(error=ErrorInfo(message=self.message, type=self.type, param=self.param,
                                         code=self.code)).model_dump_json().encode()

    def headers(self) -> dict[str, str]:
        # OpenAI's SDK waits this long before its retry (it retries 429 and 5xx).
        return {"retry-after": "1"} if self.status in (429, 503) else {}


def invalid(param: str | None, text: str) -> ApiError:
    """400 naming `param` (the message starts with it, as the router's do)."""
    return ApiError(status=400, message=f"{param}: {text}" if param else text, param=param)


def unauthorized(reason: str) -> ApiError:
    return ApiError(status=401, message=reason, type="authentication_error",
                    code="invalid_api_key")


_STATUS: dict[Code, tuple[int, str]] = {
    Code.INVALID_ARGUMENT: (400, "invalid_request_error"),
    Code.FAILED_PRECONDITION: (400, "invalid_request_error"),
    Code.NOT_FOUND: (404, "invalid_request_error"),
    Code.ALREADY_EXISTS: (409, "invalid_request_error"),
    Code.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    Code.UNAUTHENTICATED: (401, "authentication_error"),
    Code.UNAVAILABLE: (503, "service_unavailable"),
    Code.DEADLINE_EXCEEDED: (504, "timeout"),
    Code.CANCELLED: (499, "cancelled"),
    Code.INTERNAL: (500, "server_error"),
}


def from_router_error(exc: RouterError, rename: Callable[[str], str | None]) -> ApiError:
    """`exc` for an HTTP client. `rename` maps a router field path to the request's own
    (None: not a field of this request, e.g. `queue` or `deadline`)."""
    status, kind = _STATUS.get(exc.code, (500, "server_error"))
    message, param = exc.message, None
    m = _FIELD.match(message)
    if m is not None:
        param = rename(m.group(1))
        if param is not None:
            message = f"{param}: {message[m.end():]}"
    code = None
    if exc.code is Code.NOT_FOUND and param == "model":
        code = "model_not_found"
    elif exc.code is Code.RESOURCE_EXHAUSTED:
        if param is not None:  # this request can never fit (see the module docstring)
            status, kind, code = 400, "invalid_request_error", "context_length_exceeded"
        else:
            code = "rate_limit_exceeded"
    return ApiError(status=status, message=message, type=kind, param=param, code=code)


def from_validation_errors(errors: Sequence[dict]) -> ApiError:
    """pydantic's errors for a request body (FastAPI's `loc` starts with "body") as a 400
    naming the first bad field; for a union (`stop: str | list[str]`) pydantic reports one error
    per member, whose common path is the field."""
    first = errors[0]
    if first.get("type") == "json_invalid":
        return invalid(None, f"body: not valid JSON ({first.get('msg', '')})")
    loc = [p for p in first.get("loc", ()) if p != "body"]
    if not loc:
        return invalid(None, f"body: {first.get('msg', 'invalid')}")
    same = [[p for p in e.get("loc", ()) if p != "body"] for e in errors]
    same = [s for s in same if s and s[0] == loc[0]]
    common = loc[:next((i for i in range(len(loc)) if any(len(s) <= i or s[i] != loc[i]
                                                          for s in same)), len(loc))]
    return invalid(_path(common or loc[:1]), first.get("msg", "invalid value"))


def _path(loc: Sequence[str | int]) -> str:
    """("messages", 0, "content") -> "messages[0].content"."""
    out = ""
    for p in loc:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out


async def send_error(send: Send, err: ApiError,
                     extra: list[tuple[bytes, bytes]] | None = None) -> None:
    """Answer with `err` (ASGI); nothing may have been sent before."""
    body = err.body()
    headers = [(b"content-type", b"application/json"),
               (b"content-length", str(len(body)).encode()),
               *[(k.encode(), v.encode()) for k, v in err.headers().items()], *(extra or [])]
    await send({"type": "http.response.start", "status": err.status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})
