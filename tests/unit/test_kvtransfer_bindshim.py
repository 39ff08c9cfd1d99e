"""The bind() shim (tandem/kvtransfer/bindshim.c): preloaded into a fresh interpreter, it binds
TCP wildcard listeners to TANDEM_BIND_HOST - and only those, and only while the variable is set
(bind.listeners_on). The shim inside real workers: tests/integration/test_bound_addresses.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from tandem.kvtransfer import bindshim

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux only")

_PROBE = textwrap.dedent("""
    import json, socket
    from tandem.kvtransfer import bind, bindshim

    def bound(family, kind, addr, v6only=None):
        s = socket.socket(family, kind)
        if v6only is not None:
            s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, v6only)
        s.bind((addr, 0))
        return s.getsockname()[0]

    T, U, V4, V6 = socket.SOCK_STREAM, socket.SOCK_DGRAM, socket.AF_INET, socket.AF_INET6
    out = {"preloaded": bindshim.preloaded(), "off": bound(V4, T, "0.0.0.0")}
    with bind.listeners_on("localhost") as ip:
        out.update(ip=ip, tcp4=bound(V4, T, "0.0.0.0"), tcp6=bound(V6, T, "::", 0),
                   v6only=bound(V6, T, "::", 1), udp=bound(V4, U, "0.0.0.0"),
                   given=bound(V4, T, "127.0.0.2"))
    out["after"] = bound(V4, T, "0.0.0.0")
    print(json.dumps(out))
""")


def probe(preload: bool) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "TANDEM_BIND_HOST",
                                                            "TANDEM_KV_LISTEN_ANY")}
    if preload:
        path = bindshim.build()
        assert path is not None, "this machine has a C compiler: the shim must build"
        env["LD_PRELOAD"] = str(path)
    r = subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout.splitlines()[-1])


def test_the_shim_binds_tcp_wildcards_to_the_host_while_switched_on():
    out = probe(preload=True)
    assert out["preloaded"] and out["ip"] == "127.0.0.1"
    assert out["tcp4"] == "127.0.0.1"
    assert out["tcp6"] == "::ffff:127.0.0.1"  # dual-stack socket: the IPv4-mapped host
    assert out["v6only"] == "::"  # an IPv6-only socket cannot take an IPv4 host: left alone
    assert out["udp"] == "0.0.0.0"  # not a listener
    assert out["given"] == "127.0.0.2"  # an address asked for is kept
    assert out["off"] == out["after"] == "0.0.0.0"  # nothing changes outside listeners_on


def test_without_the_shim_listeners_on_changes_nothing():
    out = probe(preload=False)
    assert not out["preloaded"]
    assert out["tcp4"] == "0.0.0.0" and out["tcp6"] == "::"  # bind.py then filters


def test_the_build_is_cached_by_source_hash(tmp_path, monkeypatch):
    monkeypatch.setenv("TANDEM_CACHE", str(tmp_path))
    path = bindshim.build()
    assert path == bindshim.shim_path() and path.parent == tmp_path / "bindshim"
    mtime = path.stat().st_mtime_ns
    assert bindshim.build() == path and path.stat().st_mtime_ns == mtime  # not rebuilt
    assert bindshim.preload_value(path) == f"{path} ${{LD_PRELOAD}}"


def test_no_compiler_means_no_shim(tmp_path, monkeypatch):
    monkeypatch.setenv("TANDEM_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setattr(bindshim.shutil, "which", lambda _name: None)
    assert bindshim.build() is None  # a $CC that does not run: a warning, no shim
    monkeypatch.delenv("CC")
    assert bindshim.build() is None


@pytest.mark.parametrize("name", ["cluster-gpu.yaml", "cluster-local.yaml"])
def test_every_node_of_a_ray_up_cluster_builds_the_shim(name):
    """init_ray builds the shim on the driver's machine only; the other nodes' workers find it at
    the same path because each node's setup builds it (`~/.cache/tandem/bindshim/...`)."""
    from pathlib import Path

    import yaml

    doc = yaml.safe_load((Path(__file__).parents[2] / "deploy" / name).read_text())
    assert "python3 -m tandem.kvtransfer.bindshim" in doc["setup_commands"]
