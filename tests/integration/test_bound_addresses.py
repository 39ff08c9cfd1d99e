"""What listens where once tandem is up, and who may talk to it (docs/reliability.md, "Bound
addresses and authentication"):

- a Mooncake endpoint for 127.0.0.1 cannot be reached at another address of the machine - a
  peer there can neither connect nor read its registered memory - and still moves KV locally;
- a NIXL endpoint for 127.0.0.1 listens on 127.0.0.1 only;
- a local deployment started as `tandem serve --config local` starts it (`init_ray` + `launch`,
  the bundled config on the tiny model): every listener of the process tree that is not Ray's
  own is BOUND to loopback (the workers run with the bind() shim preloaded, so Mooncake's
  listeners bind 127.0.0.1 / ::ffff:127.0.0.1, not the wildcard) and accepts loopback
  connections only; Ray's own listen everywhere (Ray has no bind knob) and
  refuse a client without the token - `ray.init` with a wrong or no token fails, and the GCS,
  a raylet and an actor's worker answer a token-less gRPC call with UNAUTHENTICATED.

"Another address" is this machine's non-loopback IPv4 address: what a remote host would use."""

from __future__ import annotations

import ctypes
import dataclasses
import ipaddress
import os
import subprocess
import sys
import textwrap

import psutil
import pytest

from disagg_helpers import tiny_model_and_head
from net_probe import other_local_ipv4, reaches
from tandem.kvtransfer import BackendOptions, bind, create_backend

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

ray = pytest.importorskip("ray")
OTHER = other_local_ipv4()
needs_other = pytest.mark.skipif(OTHER is None, reason="no non-loopback IPv4 address here")

LOOPBACK = ipaddress.ip_address("127.0.0.1")


def new_listeners(before: dict[int, bind.Listener]) -> list[bind.Listener]:
    return [lst for fd, lst in bind.tcp_listeners().items() if before.get(fd) != lst]


# -- the transfer libraries, in this process ------------------------------------------------------
_ATTACK = textwrap.dedent("""
    import ctypes, sys
    from mooncake.engine import TransferEngine
    host, target, addr, n = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    e = TransferEngine()
    assert e.initialize(host, "P2PHANDSHAKE", "tcp", "") == 0
    buf = ctypes.create_string_buffer(n)
    assert e.register_memory(ctypes.addressof(buf), n, "cpu:0") == 0
    rc = e.transfer_sync_read(target, ctypes.addressof(buf), addr, n)
    print("RC", rc, buf.raw.hex())
""")


def mooncake_read(host: str, target: str, addr: int, n: int) -> tuple[int, bytes]:
    """A Mooncake peer on `host` reads n bytes at `addr` of the engine at `target` (a separate
    process, as an attacker would be)."""
    env = {**os.environ, "MC_TRANSFER_TIMEOUT": "5", "MC_LOG_LEVEL": "ERROR"}
    r = subprocess.run([sys.executable, "-c", _ATTACK, host, target, str(addr), str(n)],
                       env=env, capture_output=True, text=True, timeout=60)
    line = next(x for x in r.stdout.splitlines() if x.startswith("RC"))
    _, rc, data = (line.split() + [""])[:3]
    return int(rc), bytes.fromhex(data)


@needs_other
def test_mooncake_endpoint_is_unreachable_at_another_address(monkeypatch):
    monkeypatch.delenv(bind.LISTEN_ANY_ENV, raising=False)
    before = bind.tcp_listeners()
    backend = create_backend("mooncake", BackendOptions(host="127.0.0.1"))
    secret = ctypes.create_string_buffer(b"another request's KV page", 64)
    backend.register(ctypes.addressof(secret), 64, "cpu")
    opened = new_listeners(before)
    assert opened, "Mooncake opened no listener?"
    for lst in opened:
        assert lst.ip == LOOPBACK or lst.wildcard
        assert reaches("127.0.0.1", lst.port), lst
        assert not reaches(OTHER, lst.port), f"{lst} accepts connections to {OTHER}"
    peer = backend.local_id  # "127.0.0.1:<handshake port>"
    port = peer.rsplit(":", 1)[1]
    # A peer elsewhere, at the address the handshake port also listens on, gets nothing ...
    rc, data = mooncake_read(OTHER, f"{OTHER}:{port}", ctypes.addressof(secret), 64)
    assert rc != 0 and secret.raw[:24] not in data
    # ... while a local peer still moves bytes (the filter lets the endpoint's own traffic by).
    rc, data = mooncake_read("127.0.0.1", peer, ctypes.addressof(secret), 64)
    assert rc == 0 and data == secret.raw
    assert new_listeners(before) == opened  # transfers opened no further listener


def test_nixl_endpoint_listens_on_its_host_only(monkeypatch):
    monkeypatch.delenv(bind.LISTEN_ANY_ENV, raising=False)
    monkeypatch.delenv("UCX_NET_DEVICES", raising=False)
    before = bind.tcp_listeners()
    backend = create_backend("nixl", BackendOptions(host="127.0.0.1", nixl_progress_thread=True))
    opened = new_listeners(before)
    assert opened and all(lst.ip == LOOPBACK for lst in opened), opened
    backend.close()


# -- a local deployment ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    return tiny_model_and_head(tmp_path_factory.mktemp("m"))


@pytest.fixture(scope="module")
def local_ray():
    """Ray as `tandem serve` starts it; yields the driver's listeners Ray opened."""
    from tandem.deploy.launcher import init_ray

    if ray.is_initialized():
        ray.shutdown()
    me = psutil.Process()
    before = {c.laddr for c in me.net_connections(kind="inet") if c.status == psutil.CONN_LISTEN}
    init_ray(num_cpus=4)
    after = {c.laddr for c in me.net_connections(kind="inet") if c.status == psutil.CONN_LISTEN}
    yield after - before
    ray.shutdown()


def local_config(dirs, backend: str):
    from tandem.deploy.config import load_deploy
    from tandem.engine import EngineConfig
    from tandem.spec import SpecConfig

    model_dir, head_dir = dirs
    cfg = load_deploy("local")  # the bundled config, on the tiny model
    small = dataclasses.replace(cfg.prefill, num_cpus=0.5)
    return dataclasses.replace(
        cfg, engine=EngineConfig(model=str(model_dir), dtype="float32", page_size=4,
                                 num_pages=256),
        spec=SpecConfig(draft_model=str(head_dir), num_steps=3), transfer_backend=backend,
        prefill=small, decode=dataclasses.replace(cfg.decode, num_cpus=0.5))


def ray_actor_ports() -> dict[int, int]:
    """pid -> the gRPC port of the Ray core worker in that (live) actor process."""
    from ray._private import state

    return {a["Pid"]: a["Address"]["Port"] for a in state.actors().values()
            if a["State"] == "ALIVE"}


@needs_other
@pytest.mark.parametrize("backend", ["mooncake", "nixl"])
def test_a_local_deployment_listens_on_loopback_only(local_ray, dirs, backend):
    from tandem.deploy.launcher import launch

    dep = launch(local_config(dirs, backend))
    try:
        actors = ray_actor_ports()
        me = psutil.Process()
        ours = []  # (pid, address) of every listener that is not Ray's own
        for proc in [me, *me.children(recursive=True)]:
            if proc.pid == me.pid:
                rays = local_ray  # the driver's core worker server
            elif proc.pid in actors:
                rays = {a for a in _listening(proc) if a.port == actors[proc.pid]}
                # Ray's own listener is open to other hosts (the probe can see that) ...
                assert rays and all(reaches(OTHER, a.port) for a in rays)
            else:
                continue  # a Ray process (GCS, raylet, agents, idle workers): token-checked
            ours += [(proc.pid, a) for a in _listening(proc) if a not in rays]
        assert len([p for p, _ in ours if p in actors]) >= 2, ours  # both workers' endpoints
        for pid, a in ours:  # ... ours are not
            assert is_loopback(a.ip), f"pid {pid} listens on {a.ip}:{a.port}"
            assert reaches("127.0.0.1", a.port), (pid, a)
            assert not reaches(OTHER, a.port), f"pid {pid} accepts connections at {OTHER}:{a.port}"
    finally:
        dep.shutdown()


def is_loopback(address: str) -> bool:
    ip = ipaddress.ip_address(address)
    mapped = getattr(ip, "ipv4_mapped", None)  # a dual-stack socket bound to 127.0.0.1
    return ip.is_loopback or (mapped is not None and mapped.is_loopback)


def _listening(proc: psutil.Process) -> set:
    return {c.laddr for c in proc.net_connections(kind="inet") if c.status == psutil.CONN_LISTEN}


_CLIENT = "import ray; ray.init(address={!r}, log_to_driver=False); print('CONNECTED')"


def test_ray_refuses_clients_without_the_token(local_ray, tmp_path):
    address = ray.get_runtime_context().gcs_address
    wrong = tmp_path / "wrong_token"
    wrong.write_text("0" * 64)
    base = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH_TOKEN")}
    clients = [  # run side by side: each spends ~20 s retrying before it gives up
        subprocess.Popen([sys.executable, "-c", _CLIENT.format(address)], env=env, text=True,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        for env in ({**base, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(wrong)},
                    {**base, "RAY_AUTH_MODE": "disabled", "HOME": str(tmp_path)})]
    for client in clients:
        out, _ = client.communicate(timeout=120)
        assert client.returncode != 0 and "CONNECTED" not in out, out[-2000:]
        assert "InvalidAuthToken" in out, out[-2000:]
    _grpc_calls_need_the_token(address)


def _grpc_calls_need_the_token(gcs_address: str) -> None:
    import grpc
    from ray._private.test_utils import auth_token_grpc_metadata
    from ray.core.generated import (core_worker_pb2, core_worker_pb2_grpc, gcs_service_pb2,
                                    gcs_service_pb2_grpc, node_manager_pb2,
                                    node_manager_pb2_grpc)

    @ray.remote(num_cpus=0)
    class Probe:
        def actor_id(self) -> str:
            return ray.get_runtime_context().get_actor_id()

    from ray._private import state

    probe = Probe.remote()
    actor_port = state.actors(actor_id=ray.get(probe.actor_id.remote()))["Address"]["Port"]
    raylet_port = ray.nodes()[0]["NodeManagerPort"]
    calls = {
        "gcs": (gcs_address, lambda ch, **kw: gcs_service_pb2_grpc.NodeInfoGcsServiceStub(
            ch).GetClusterId(gcs_service_pb2.GetClusterIdRequest(), timeout=10, **kw)),
        "raylet": (f"127.0.0.1:{raylet_port}", lambda ch, **kw: (
            node_manager_pb2_grpc.NodeManagerServiceStub(ch).GetNodeStats(
                node_manager_pb2.GetNodeStatsRequest(), timeout=10, **kw))),
        "actor": (f"127.0.0.1:{actor_port}", lambda ch, **kw: (
            core_worker_pb2_grpc.CoreWorkerServiceStub(ch).NumPendingTasks(
                core_worker_pb2.NumPendingTasksRequest(), timeout=10, **kw))),
    }
    try:
        for who, (target, call) in calls.items():
            with grpc.insecure_channel(target) as ch:
                with pytest.raises(grpc.RpcError) as err:
                    call(ch)
                assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED, who
        # The same call with the token goes through: the refusal is about the token alone.
        with grpc.insecure_channel(calls["gcs"][0]) as ch:
            calls["gcs"][1](ch, metadata=auth_token_grpc_metadata())
    finally:
        ray.kill(probe)
