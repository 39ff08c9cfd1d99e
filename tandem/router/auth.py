"""Optional shared-secret auth: every call carries `authorization: Bearer <token>` metadata.

`check_bearer` is the rule (pure); `BearerAuthInterceptor` applies it to every method except
the health service (load balancers probe it without credentials) and answers a failure with
UNAUTHENTICATED before the request is read.

Where the token comes from (`resolve_auth_token`, for `tandem serve` and `tandem generate`):
`--auth-token-file PATH` (its first line), or `--auth-token VALUE`, which still works but warns
(a command line is readable by every user of the machine: `ps`, /proc/PID/cmdline), else
`$TANDEM_AUTH_TOKEN`. `edge_warnings` says what is open about a server's address: a token sent
over plaintext to a non-loopback address can be read and replayed by anyone on the path, and a
non-loopback address without a token serves anyone who reaches it.
"""

from __future__ import annotations

import hmac
import ipaddress
import logging
import os
from collections.abc import Iterable, Mapping
from pathlib import Path

import grpc

log = logging.getLogger(__name__)

EXEMPT_PREFIXES = ("/grpc.health.v1.Health/",)
TOKEN_ENV = "TANDEM_AUTH_TOKEN"


def check_listener(*, port: int, tls_cert: Path | None, tls_key: Path | None,
                   auth_token: str | None) -> None:
    """What every front's config (gRPC ServerConfig, HTTP HttpConfig) checks alike; ValueError
    naming the field."""
    if not 0 <= port <= 65535:
        raise ValueError(f"port: must be in [0, 65535], got {port}")
    if (tls_cert is None) != (tls_key is None):
        raise ValueError("tls_cert, tls_key: give both or neither")
    for name, path in (("tls_cert", tls_cert), ("tls_key", tls_key)):
        if path is not None and not Path(path).is_file():
            raise ValueError(f"{name}: no such file '{path}'")
    if auth_token is not None and not auth_token:
        raise ValueError("auth_token: must not be empty")


def resolve_auth_token(*, value: str | None = None, file: str | Path | None = None,
                       environ: Mapping[str, str] = os.environ) -> str | None:
    """The bearer token from `file`, `$TANDEM_AUTH_TOKEN` or `value` (None: no auth).

    At most one of `value` and `file`; both outrank the environment. A file holds the token on
    its first line (surrounding whitespace ignored; an empty file is an error, not "no auth")."""
    if value is not None and file is not None:
        raise ValueError("--auth-token, --auth-token-file: give only one")
    if file is not None:
        path = Path(file)
        if not path.is_file():
            raise ValueError(f"--auth-token-file: no such file '{path}'")
        token = path.read_text(encoding="utf-8").strip().partition("\n")[0].strip()
        if not token:
            raise ValueError(f"--auth-token-file: '{path}' holds no token")
        return token
    if value is not None:
        log.warning("--auth-token: the token shows in the process list (ps, /proc/PID/cmdline) "
                    "to every user of this machine; use --auth-token-file PATH or $%s",
                    TOKEN_ENV)
        if not value:
            raise ValueError("--auth-token: must not be empty")
        return value
    return environ.get(TOKEN_ENV) or None


def is_loopback(host: str) -> bool:
    """Whether binding `host` serves only this machine ("" and 0.0.0.0 serve every interface;
    a host name other than localhost may resolve anywhere)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def edge_warnings(host: str, *, auth: bool, tls: bool) -> list[str]:
    """What is open about serving on `host` (empty when nothing is)."""
    if is_loopback(host):
        return []
    if auth and not tls:
        return [f"host {host}: the auth token is sent in plaintext (no TLS) and anyone on the "
                f"network path can read and replay it; serve TLS (--tls-cert/--tls-key) or bind "
                f"127.0.0.1 behind a TLS proxy"]
    if not auth:
        return [f"host {host}: no auth token; anyone who can reach this address can generate "
                f"(set --auth-token-file or ${TOKEN_ENV})"]
    return []


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
