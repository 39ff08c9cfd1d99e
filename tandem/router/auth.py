"""Optional shared-secret auth: every call carries `authorization: Bearer <token>` metadata.

`check_bearer` is the rule (pure); `BearerAuthInterceptor` applies it to every method except
the health service (load balancers probe it without credentials) and answers a failure with
UNAUTHENTICATED before the request is read.
"""

from __future__ import annotations

import hmac
from collections.abc import Iterable

import grpc

EXEMPT_PREFIXES = ("/grpc.health.v1.Health/",)


def check_bearer(metadata: Iterable[tuple[str, str | bytes]] | None, token: str) -> str | None:
    """None when the metadata carries the token; otherwise why not (names the metadata key)."""
    values = [v for k, v in (metadata or ()) if k.lower() == "authorization"]
    if not values:
        return "authorization: missing (send metadata 'authorization: Bearer <token>')"
    value = values[0].decode("utf-8", "replace") if isinstance(values[0], bytes) else values[0]
    scheme, _, presented = value.partition(" ")
    if scheme.lower() != "bearer" or not presented.strip():
        return "authorization: expected 'Bearer <token>'"
    if not hmac.compare_digest(presented.strip().encode(), token.encode()):
        return "authorization: invalid token"
    return None


class BearerAuthInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, token: str) -> None:
        if not token:
            raise ValueError("auth_token: must not be empty")
        self._token = token

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or handler_call_details.method.startswith(EXEMPT_PREFIXES):
            return handler
        reason = check_bearer(handler_call_details.invocation_metadata, self._token)
        return handler if reason is None else _deny(handler, reason)


def _deny(handler: grpc.RpcMethodHandler, reason: str) -> grpc.RpcMethodHandler:
    """A handler of the same streaming kind as `handler` that only refuses."""

    async def refuse(request_or_iterator, context: grpc.aio.ServicerContext):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, reason)

    kind = {
        (False, False): grpc.unary_unary_rpc_method_handler,
        (False, True): grpc.unary_stream_rpc_method_handler,
        (True, False): grpc.stream_unary_rpc_method_handler,
        (True, True): grpc.stream_stream_rpc_method_handler,
    }[(handler.request_streaming, handler.response_streaming)]
    return kind(refuse, request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer)
