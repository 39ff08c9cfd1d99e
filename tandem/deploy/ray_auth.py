"""Ray token authentication for every Ray instance tandem starts or joins (`init_ray`).

Ray (>= 2.52) authenticates its control plane - GCS, raylets, every worker's gRPC server, the
dashboard - with one shared token when `RAY_AUTH_MODE=token`, read (highest precedence first)
from `RAY_AUTH_TOKEN`, the file at `RAY_AUTH_TOKEN_PATH`, or `~/.ray/auth_token`. Ray's servers
listen on every interface whatever address they are given (docs/reliability.md), so the token
is what keeps other hosts from running code on the cluster.

tandem's choice, first match wins (`resolve_ray_auth`):
1. `RAY_AUTH_MODE=disabled` in the environment: no authentication, as the user asked.
2. `RAY_AUTH_TOKEN` set: Ray uses it.
3. `RAY_AUTH_TOKEN_PATH` set: Ray uses that file (it must exist and not be empty).
4. `<tandem cache>/ray_auth_token` (`$TANDEM_CACHE` or ~/.cache/tandem) exists: that file.
5. `~/.ray/auth_token` exists: Ray reads it itself.
6. Starting a local instance: a new random token (256 bits) written to the file of 4 with mode
   0600. Joining a cluster (an address): an error that says where the token should be.
The mode is then `token` - exported, with the token file, so that the Ray processes started
from this one (GCS, raylet, workers) inherit it.
"""

from __future__ import annotations

import logging
import os
import secrets
import stat
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from tandem.engine.cache_root import default_cache_root

log = logging.getLogger(__name__)

MODE_ENV = "RAY_AUTH_MODE"
TOKEN_ENV = "RAY_AUTH_TOKEN"
TOKEN_PATH_ENV = "RAY_AUTH_TOKEN_PATH"
TOKEN_FILE_NAME = "ray_auth_token"


class RayAuthError(ValueError):
    """Token authentication is on but no usable token was found (the message says where); a
    ValueError, as any other bad setting the CLI reports in one line."""


@dataclass(frozen=True, slots=True, kw_only=True)
class RayAuth:
    mode: str  # "token" | "disabled"
    source: str  # where the token comes from (an env var name or a file), or why auth is off
    token_path: Path | None  # what RAY_AUTH_TOKEN_PATH must name; None: Ray finds it itself


def token_file(cache_root: Path | None = None) -> Path:
    """tandem's token file: `<cache root>/ray_auth_token`."""
    return (cache_root or default_cache_root()) / TOKEN_FILE_NAME


def _too_open(path: Path) -> bool:
    return bool(path.stat().st_mode & (stat.S_IRWXG | stat.S_IRWXO))


def ensure_token_file(path: Path) -> Path:
    """`path`, holding a token: a new random one (mode 0600) if the file does not exist; an
    existing file readable by others is narrowed to 0600."""
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        # O_EXCL: two processes starting at once never overwrite each other's token.
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        if _too_open(path):
            log.warning("%s was readable by other users: narrowed to 0600", path)
            path.chmod(0o600)
        return path
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32))
    log.info("new Ray authentication token in %s", path)
    return path


def _readable_token(path: Path, what: str) -> Path:
    try:
        if path.read_text().strip():
            return path
    except OSError as e:
        raise RayAuthError(f"{what} = {path}: cannot read it ({e})") from e
    raise RayAuthError(f"{what} = {path}: the file is empty")


def resolve_ray_auth(*, joining: bool, env: Mapping[str, str], cache_root: Path | None = None,
                     home: Path | None = None) -> RayAuth:
    """The authentication to use (see the module doc for the order). `joining`: connecting to
    an existing cluster, which never gets a new token. Creates the token file only when
    starting a local instance without any token."""
    mode = env.get(MODE_ENV, "").strip().lower()
    if mode == "disabled":
        return RayAuth(mode="disabled", source=f"{MODE_ENV}=disabled", token_path=None)
    if mode not in ("", "token"):
        raise RayAuthError(f"{MODE_ENV}={env[MODE_ENV]!r}: expected 'token' or 'disabled'")
    if env.get(TOKEN_ENV, "").strip():
        return RayAuth(mode="token", source=TOKEN_ENV, token_path=None)
    if env.get(TOKEN_PATH_ENV, "").strip():
        path = _readable_token(Path(env[TOKEN_PATH_ENV]).expanduser(), TOKEN_PATH_ENV)
        return RayAuth(mode="token", source=str(path), token_path=path)
    own = token_file(cache_root)
    if own.is_file():
        ensure_token_file(own)  # narrows its mode if it was readable by others
        return RayAuth(mode="token", source=str(own), token_path=_readable_token(own, "token"))
    ray_default = (home or Path.home()) / ".ray" / "auth_token"
    if ray_default.is_file():
        if _too_open(ray_default):
            log.warning("%s is readable by other users (chmod 600 it)", ray_default)
        return RayAuth(mode="token", source=str(ray_default), token_path=None)
    if joining:
        raise RayAuthError(
            f"Ray token authentication is on but there is no token for the cluster: put the "
            f"cluster's token in {own} (or {ray_default}), or set {TOKEN_ENV} or "
            f"{TOKEN_PATH_ENV}; for a cluster started without authentication set "
            f"{MODE_ENV}=disabled")
    return RayAuth(mode="token", source=str(own), token_path=ensure_token_file(own))


def apply_ray_auth(auth: RayAuth) -> None:
    """Export `auth` to this process (and the Ray processes it will start) and make an already
    imported Ray see it: Ray caches its config and token when first loaded."""
    os.environ[MODE_ENV] = auth.mode
    if auth.token_path is not None:
        os.environ[TOKEN_PATH_ENV] = str(auth.token_path)
    try:
        from ray._raylet import AuthenticationTokenLoader, Config
    except ImportError as e:  # Ray < 2.52: RAY_AUTH_MODE means nothing to it
        if auth.mode == "token":
            raise RayAuthError(f"this Ray has no token authentication (Ray 2.52+ has): upgrade "
                               f"Ray, or set {MODE_ENV}=disabled to run without it") from e
        return
    # The same refresh Ray itself does when it turns token mode on (authentication_token_setup).
    Config.initialize("")
    AuthenticationTokenLoader.instance().reset_cache()


def cluster_to_join(address: str | None) -> str | None:
    """The running cluster `ray.init(address=address)` would connect to, or None if it would
    start a new local instance: `address`, else $RAY_ADDRESS, else the cluster `ray start`
    left on this machine (Ray looks for one even without an address)."""
    try:
        from ray._private.services import canonicalize_bootstrap_address
    except ImportError:  # moved in some Ray version: Ray's documented rules, minus the lookup
        return address or os.environ.get("RAY_ADDRESS") or None
    return canonicalize_bootstrap_address(address)


def configure_ray_auth(*, joining: bool) -> RayAuth:
    """Resolve and apply the authentication of the Ray instance this process starts or joins."""
    auth = resolve_ray_auth(joining=joining, env=os.environ)
    apply_ray_auth(auth)
    if auth.mode == "disabled":
        log.warning("Ray authentication is off (%s): any host that reaches this cluster's ports "
                    "can run code in it", auth.source)
    else:
        log.info("Ray token authentication on (token from %s)", auth.source)
    return auth
