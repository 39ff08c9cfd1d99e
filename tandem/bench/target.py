"""What `--target` names: a running server and the API the benchmark speaks to it.

    HOST:PORT, grpc://HOST:PORT        tandem's gRPC router API (tandem.v1.Router/Generate)
    http://HOST[:PORT], https://...    an OpenAI-compatible HTTP front (/v1/completions,
                                       /v1/chat/completions with SSE streaming)

The scheme alone picks the driver, so a URL copied from an OpenAI client's `base_url` works as
it is: a trailing `/v1` is dropped (the driver adds the endpoint paths itself).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from urllib.parse import urlsplit

from tandem.engine.config import ConfigError


class Api(str, Enum):
    GRPC = "grpc"
    HTTP = "http"  # OpenAI-compatible, over HTTP or HTTPS


@dataclass(frozen=True, slots=True, kw_only=True)
class Target:
    api: Api
    address: str  # gRPC: host:port; HTTP: the base URL, scheme://host[:port][/prefix], no '/'

    @staticmethod
    def parse(text: str) -> Target:
        """A `--target` value; a ConfigError naming `target` when it is not one of the forms
        in the module docstring."""
        scheme, sep, rest = text.partition("://")
        if not sep:  # no scheme: gRPC, as before the HTTP driver existed
            return Target(api=Api.GRPC, address=_host_port(text, text))
        scheme = scheme.lower()
        if scheme == "grpc":
            return Target(api=Api.GRPC, address=_host_port(rest, text))
        if scheme not in ("http", "https"):
            raise ConfigError(f"target: scheme '{scheme}' in '{text}' is not one of grpc, http, "
                              "https")
        try:
            url = urlsplit(text)
            _ = url.port  # raises on a port that is not a number
        except ValueError as exc:
            raise ConfigError(f"target: '{text}' is not a URL ({exc})") from exc
        if not url.hostname or url.query or url.fragment:
            raise ConfigError(f"target: expected {scheme}://HOST[:PORT], got '{text}'")
        path = url.path.rstrip("/")
        if path.endswith("/v1"):
            path = path[:-len("/v1")]
        return Target(api=Api.HTTP, address=f"{scheme}://{url.netloc}{path}")

    def __str__(self) -> str:
        return self.address


def _host_port(address: str, given: str) -> str:
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ConfigError(f"target: expected HOST:PORT, grpc://HOST:PORT or "
                          f"http(s)://HOST[:PORT], got '{given}'")
    return address
