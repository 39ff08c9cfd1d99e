"""Which Ray authentication `init_ray` uses (tandem/deploy/ray_auth.py): token auth unless
RAY_AUTH_MODE=disabled, the token taken from the environment, the tandem cache or Ray's default
file, a new private one for a local instance, an error naming the remedies when joining a
cluster without one. No Ray is started here (tests/integration/test_bound_addresses.py does)."""

from __future__ import annotations

import stat

import pytest

from tandem.deploy.ray_auth import (RayAuthError, ensure_token_file, resolve_ray_auth,
                                    token_file)


@pytest.fixture
def dirs(tmp_path):
    cache, home = tmp_path / "cache", tmp_path / "home"
    home.mkdir()
    return cache, home


def resolve(dirs, env, joining=False):
    cache, home = dirs
    return resolve_ray_auth(joining=joining, env=env, cache_root=cache, home=home)


def mode_of(path):
    return stat.S_IMODE(path.stat().st_mode)


def test_a_local_instance_gets_a_new_private_random_token(dirs):
    auth = resolve(dirs, {})
    path = token_file(dirs[0])
    assert auth.mode == "token" and auth.token_path == path
    token = path.read_text()
    assert len(token) == 64 and int(token, 16) >= 0  # 256 random bits, hex
    assert mode_of(path) == 0o600
    # The next start reuses it (never overwritten): a cluster keeps its token across restarts.
    assert resolve(dirs, {}).token_path == path and path.read_text() == token


def test_two_local_tokens_differ(tmp_path):
    a, b = ensure_token_file(tmp_path / "a"), ensure_token_file(tmp_path / "b")
    assert a.read_text() != b.read_text()


def test_disabled_is_respected_and_creates_nothing(dirs):
    auth = resolve(dirs, {"RAY_AUTH_MODE": "disabled"})
    assert auth.mode == "disabled" and auth.token_path is None
    assert not token_file(dirs[0]).exists()


def test_an_unknown_mode_is_an_error(dirs):
    with pytest.raises(RayAuthError, match="RAY_AUTH_MODE"):
        resolve(dirs, {"RAY_AUTH_MODE": "tokn"})


def test_the_environment_token_wins(dirs):
    token_file(dirs[0]).parent.mkdir(parents=True)
    ensure_token_file(token_file(dirs[0]))
    auth = resolve(dirs, {"RAY_AUTH_TOKEN": "abc", "RAY_AUTH_MODE": "token"})
    assert auth.mode == "token" and auth.source == "RAY_AUTH_TOKEN" and auth.token_path is None


def test_a_token_path_is_used_and_must_hold_a_token(dirs, tmp_path):
    path = tmp_path / "tok"
    path.write_text("secret\n")
    auth = resolve(dirs, {"RAY_AUTH_TOKEN_PATH": str(path)}, joining=True)
    assert auth.token_path == path
    path.write_text("")
    with pytest.raises(RayAuthError, match="empty"):
        resolve(dirs, {"RAY_AUTH_TOKEN_PATH": str(path)})
    with pytest.raises(RayAuthError, match="cannot read"):
        resolve(dirs, {"RAY_AUTH_TOKEN_PATH": str(tmp_path / "missing")})


def test_a_cached_token_readable_by_others_is_narrowed(dirs):
    path = token_file(dirs[0])
    path.parent.mkdir(parents=True)
    path.write_text("f" * 64)
    path.chmod(0o644)
    assert resolve(dirs, {}, joining=True).token_path == path
    assert mode_of(path) == 0o600 and path.read_text() == "f" * 64


def test_rays_default_file_serves_when_tandem_has_none(dirs):
    cache, home = dirs
    (home / ".ray").mkdir()
    (home / ".ray" / "auth_token").write_text("t" * 64)
    auth = resolve(dirs, {}, joining=True)
    assert auth.mode == "token" and auth.token_path is None  # Ray reads its own default
    assert not token_file(cache).exists()


def test_joining_without_any_token_says_where_to_put_it(dirs):
    with pytest.raises(RayAuthError) as err:
        resolve(dirs, {}, joining=True)
    msg = str(err.value)
    assert str(token_file(dirs[0])) in msg and "RAY_AUTH_MODE=disabled" in msg
    assert not token_file(dirs[0]).exists()  # a joining client never invents a token


def test_the_cli_prints_the_token_file_it_made(tmp_path, monkeypatch, capsys):
    from tandem.cli import main

    monkeypatch.setenv("TANDEM_CACHE", str(tmp_path))
    assert main(["ray-token"]) == 0
    path = tmp_path / "ray_auth_token"
    assert capsys.readouterr().out.strip() == str(path) and mode_of(path) == 0o600


def test_an_address_or_ray_address_means_joining(monkeypatch):
    from tandem.deploy.ray_auth import cluster_to_join

    monkeypatch.setenv("RAY_ADDRESS", "192.0.2.9:6379")
    assert cluster_to_join(None) == "192.0.2.9:6379"
    assert cluster_to_join("192.0.2.8:6379") == "192.0.2.8:6379"


@pytest.mark.parametrize("name", ["cluster-gpu.yaml", "cluster-local.yaml"])
def test_every_node_of_a_ray_up_cluster_starts_with_the_token(name):
    """deploy/*.yaml: the token file goes to every node as Ray's default token file, and every
    `ray start` runs in token mode (a node started without it would accept anyone)."""
    from pathlib import Path

    import yaml

    doc = yaml.safe_load((Path(__file__).parents[2] / "deploy" / name).read_text())
    assert doc["file_mounts"]["~/.ray/auth_token"].endswith("ray_auth_token")
    starts = [c for key in ("head_start_ray_commands", "worker_start_ray_commands")
              for c in doc[key] if "ray start" in c]
    assert len(starts) == 2
    assert all("RAY_AUTH_MODE=token ray start" in c for c in starts), starts
