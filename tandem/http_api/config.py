"""`HttpConfig`: where and how the HTTP front listens. Validated here; errors name the field."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tandem.router.auth import check_listener


@dataclass(frozen=True, slots=True, kw_only=True)
class HttpConfig:
    host: str = "127.0.0.1"
    port: int = 8000  # 0: any free port (see HttpServer.port)
    auth_token: str | None = None  # require `authorization: Bearer <token>` when set
    tls_cert: Path | None = None  # PEM certificate chain; with tls_key, serve HTTPS only
    tls_key: Path | None = None
    max_body_bytes: int = 4 << 20  # larger request bodies are answered 413
    # Paths served without the token: load balancers probe health without credentials.
    public_paths: tuple[str, ...] = ("/health",)

    def __post_init__(self) -> None:
        check_listener(port=self.port, tls_cert=self.tls_cert, tls_key=self.tls_key,
                       auth_token=self.auth_token)
        if self.max_body_bytes <= 0:
            raise ValueError(f"max_body_bytes: must be > 0, got {self.max_body_bytes}")
        for path in self.public_paths:
            if not path.startswith("/"):
                raise ValueError(f"public_paths: '{path}' must start with '/'")

    @property
    def tls(self) -> bool:
        return self.tls_cert is not None
