"""Where `tandem serve` gets its HTTP front from: the deployment YAML's `http:` (errors name the
key), the --http-port/--http-host flags over it, and the gRPC front's token, TLS and size limit
shared by both fronts."""

from __future__ import annotations

from pathlib import Path

import pytest

from tandem.cli.app import build_parser
from tandem.cli.serve import _http_config
from tandem.deploy.config import HttpFrontConfig, parse_deploy
from tandem.engine.config import ConfigError
from tandem.router.server import ServerConfig


def test_the_yaml_http_field():
    assert parse_deploy({}).http == HttpFrontConfig()  # no front unless asked
    assert parse_deploy({"http": {"port": 8000}}).http == HttpFrontConfig(port=8000)
    assert parse_deploy({"http": {"port": 0, "host": "0.0.0.0"}}).http == HttpFrontConfig(
        port=0, host="0.0.0.0")
    for raw, start in [({"port": "80"}, "http.port: must be an integer"),
                       ({"port": 70000}, "http.port: must be an integer"),
                       ({"port": True}, "http.port: must be an integer"),
                       ({}, "http.port: required"),
                       ({"host": "h"}, "http.port: required"),
                       ({"port": 1, "host": ""}, "http.host: must be a non-empty string"),
                       ({"port": 1, "prot": 2}, "http.prot: unknown key"),
                       (8000, "http: expected a mapping")]:
        with pytest.raises(ConfigError) as e:
            parse_deploy({"http": raw})
        assert str(e.value).startswith(start), (raw, str(e.value))


def _args(*flags: str):
    return build_parser().parse_args(["serve", *flags])


def test_flags_over_the_yaml_and_the_grpc_front_s_security(tmp_path):
    cert, key = tmp_path / "c.pem", tmp_path / "k.pem"
    cert.write_text("c")
    key.write_text("k")
    grpc = ServerConfig(host="10.0.0.5", port=50051, auth_token="t", tls_cert=cert, tls_key=key,
                        max_message_bytes=1 << 20)
    assert _http_config(_args(), grpc) is None
    assert _http_config(_args(), grpc, HttpFrontConfig()) is None
    cfg = _http_config(_args("--http-port", "8000"), grpc)
    assert (cfg.host, cfg.port, cfg.auth_token, cfg.tls_cert, cfg.tls_key, cfg.max_body_bytes) == (
        "10.0.0.5", 8000, "t", Path(cert), Path(key), 1 << 20)
    yaml = HttpFrontConfig(port=9000, host="127.0.0.1")
    assert (_http_config(_args(), grpc, yaml).host, _http_config(_args(), grpc, yaml).port) == (
        "127.0.0.1", 9000)
    cfg = _http_config(_args("--http-port", "9100", "--http-host", "::1"), grpc, yaml)
    assert (cfg.host, cfg.port) == ("::1", 9100)
    with pytest.raises(ValueError, match="--http-port: must be in"):
        _http_config(_args("--http-port", "-1"), grpc)
    with pytest.raises(ValueError, match="--http-host: needs --http-port"):
        _http_config(_args("--http-host", "0.0.0.0"), grpc)
