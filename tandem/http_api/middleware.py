"""ASGI middleware of the HTTP front, outermost first: `BearerAuth` (401 before a byte of the body
is read) and `BodyLimit` (413 for a body over the limit, which is never held in memory).

Both are plain ASGI wrappers, not Starlette's BaseHTTPMiddleware: that one runs the app in a
task of its own and breaks a streaming response's view of the client's disconnect, which the
generation endpoints need (http_api/generation.py).
"""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tandem.http_api.errors import ApiError, send_error, unauthorized
from tandem.router.auth import check_bearer

# A body over the limit is still read (and dropped) up to this many bytes before the 413 goes
# out: a client that is still sending when the server answers and closes gets a connection
# reset instead of the answer. Beyond it (or with `Expect: 100-continue`, where the client
# waits for a go-ahead that never comes) the answer goes at once.
DRAIN_BYTES = 64 << 20


class BearerAuth:
    """Every request but those to `public_paths` (health probes) carries
    `authorization: Bearer <token>`; the same rule as the gRPC front (router/auth.py)."""

    def __init__(self, app: ASGIApp, *, token: str, public_paths: tuple[str, ...]) -> None:
        if not token:
            raise ValueError("auth_token: must not be empty")
        self.app, self._token, self._public = app, token, frozenset(public_paths)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in self._public:
            await self.app(scope, receive, send)
            return
        headers = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in scope["headers"]]
        reason = check_bearer(headers, self._token)
        if reason is None:
            await self.app(scope, receive, send)
            return
        await send_error(send, unauthorized(reason), [(b"www-authenticate", b"Bearer")])


class BodyLimit:
    """Reads the whole request body (every endpoint takes one JSON document) and hands it to the
    app in one message; a body over `max_bytes` is answered 413 instead."""

    def __init__(self, app: ASGIApp, *, max_bytes: int) -> None:
        if max_bytes <= 0:
            raise ValueError(f"max_body_bytes: must be > 0, got {max_bytes}")
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        declared = _int(headers.get(b"content-length"))
        if declared is not None and declared > self.max_bytes:
            if headers.get(b"expect", b"").lower() != b"100-continue" and (
                    declared <= DRAIN_BYTES):
                await _drain(receive, declared)
            await send_error(send, self._too_large(declared))
            return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return  # the client left before it finished sending
            body = message.get("body", b"")
            size += len(body)
            if size > self.max_bytes:
                if message.get("more_body", False):
                    size += await _drain(receive, DRAIN_BYTES - size)
                await send_error(send, self._too_large(size))
                return
            chunks.append(body)
            if not message.get("more_body", False):
                break
        whole: Message = {"type": "http.request", "body": b"".join(chunks), "more_body": False}
        delivered = False

        async def replay() -> Message:
            # The body once, then the server's own channel (the disconnect the generation
            # endpoints watch for).
            nonlocal delivered
            if delivered:
                return await receive()
            delivered = True
            return whole

        await self.app(scope, replay, send)

    def _too_large(self, size: int) -> ApiError:
        return ApiError(status=413, message=f"body: {size} bytes or more, over the limit of "
                                            f"{self.max_bytes} bytes", code="request_too_large")


async def _drain(receive: Receive, budget: int) -> int:
    """Read and drop body bytes until the body ends or `budget` bytes were read."""
    num = 0
    while num < budget:
        message = await receive()
        if message["type"] != "http.request":
            break
        num += len(message.get("body", b""))
        if not message.get("more_body", False):
            break
    return num


def _int(raw: bytes | None) -> int | None:
    try:
        return None if raw is None else int(raw)
    except ValueError:
        return None
