"""`tandem bench` as a Ray job, as the README's multi-node benchmark runs it, on a real Ray
cluster of two nodes: two `ray start`s on this machine (a head and a second node, 2 CPUs each,
the custom resources `tandem_a` / `tandem_b` telling them apart; token authentication on;
stopped by pid), jobs submitted with Ray's job SDK:

- the CPU benchmark, colocated (`cpu-colocated`) and disaggregated (`cpu-disagg` with prefill
  pinned to the head and decode to the second node), lands in a valid result JSON with every
  request completed;
- a config needing more CPUs than the cluster has fails the job within 60 s with a message
  naming the resource and the field, and leaves nothing reserved.

Output equality across nodes (prefill and decode on different nodes == colocated):
tests/integration/test_ray_disagg.py::test_two_node_cluster_places_prefill_and_decode_apart."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest
import yaml

from tandem.bench.results import validate

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
pytest.importorskip("ray.job_submission")

BUNDLED = Path(__file__).parents[2] / "tandem" / "deploy" / "bench"

# The job SDK runs in a subprocess of its own: its token comes from that environment alone
# (this test process may hold Ray state and another token from earlier tests).
_SUBMIT = textwrap.dedent("""
    import json, sys, time
    from ray.job_submission import JobSubmissionClient
    url, entrypoint, timeout_s = sys.argv[1], sys.argv[2], float(sys.argv[3])
    client = JobSubmissionClient(url)
    t0 = time.monotonic()
    while True:  # the job agents come up a few seconds after `ray start` returns
        try:
            job = client.submit_job(entrypoint=entrypoint)
            break
        except RuntimeError as exc:
            if "No available agent" not in str(exc) or time.monotonic() - t0 > 120:
                raise
            time.sleep(1)
    while not client.get_job_status(job).is_terminal():
        if time.monotonic() - t0 > timeout_s:
            client.stop_job(job)
            break
        time.sleep(0.5)
    print(json.dumps({"status": client.get_job_status(job).value,
                      "seconds": time.monotonic() - t0, "logs": client.get_job_logs(job)}))
""")


@dataclass(frozen=True)
class RayCluster:
    root: Path  # the cluster's --temp-dir lives under it
    env: dict[str, str]  # what a client of this cluster runs with (its token)
    dashboard: str  # the job server's URL

    def submit(self, entrypoint: str, timeout_s: float = 600.0) -> dict:
        r = subprocess.run([sys.executable, "-c", _SUBMIT, self.dashboard, entrypoint,
                            str(timeout_s)], env=self.env, capture_output=True, text=True,
                           timeout=timeout_s + 60)
        assert r.returncode == 0, r.stderr[-3000:]
        return json.loads(r.stdout.splitlines()[-1])


def _free_ports(n: int) -> list[int]:
    """`n` distinct free loopback ports: every socket is held open until all are bound, so
    the kernel cannot hand the same port out twice (one port released and taken again gave
    two of Ray's agents the same port once)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _stop_by_pid(root: Path) -> None:
    """Every process of this cluster (its command line names the cluster's temp dir), with
    their children (the workers): SIGTERM, then SIGKILL what is left after 10 s."""
    procs = {p.pid: p for p in psutil.process_iter(["cmdline"])
             if str(root) in " ".join(p.info["cmdline"] or [])}
    for p in list(procs.values()):
        try:
            procs.update({c.pid: c for c in p.children(recursive=True)})
        except psutil.NoSuchProcess:
            pass
    procs.pop(os.getpid(), None)
    for p in procs.values():
        try:
            p.send_signal(signal.SIGTERM)
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(list(procs.values()), timeout=10)
    for p in alive:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(alive, timeout=10)


@pytest.fixture(scope="module")
def cluster(smollm2_dir):  # the bundled model imported before the jobs need it
    root = Path(tempfile.mkdtemp(prefix="tj", dir="/tmp"))  # short: Ray's socket paths
    token = root / "token"
    token.write_text(secrets.token_hex(32))
    token.chmod(0o600)
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("RAY_ADDRESS", "RAY_AUTH", "TANDEM_KV_"))}
    # Every process of the cluster (and so every worker and job) gets the token and keeps
    # KV traffic on loopback (Ray turns the node address 127.0.0.1 into the machine's IP).
    env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(token),
               TANDEM_KV_HOST="127.0.0.1", RAY_USAGE_STATS_ENABLED="0")
    ray_cli = str(Path(sys.executable).with_name("ray"))
    common = ["--node-ip-address", "127.0.0.1", "--num-cpus", "2",
              "--temp-dir", str(root / "ray")]
    agents = ("--dashboard-agent-listen-port", "--dashboard-agent-grpc-port",
              "--metrics-export-port", "--runtime-env-agent-port")

    def start() -> tuple[int, int]:
        """Both nodes on fresh distinct ports (Ray's fixed default agent ports would clash
        between two nodes of one machine); the GCS and dashboard ports."""
        gcs, dash, *rest = _free_ports(2 + 2 * len(agents))
        head = [a for f, p in zip(agents, rest[:len(agents)]) for a in (f, str(p))]
        node = [a for f, p in zip(agents, rest[len(agents):]) for a in (f, str(p))]
        subprocess.run([ray_cli, "start", "--head", "--port", str(gcs), *common, *head,
                        "--resources", '{"tandem_a": 1}', "--include-dashboard", "true",
                        "--dashboard-host", "127.0.0.1", "--dashboard-port", str(dash)],
                       env=env, check=True, capture_output=True, timeout=120)
        subprocess.run([ray_cli, "start", "--address", f"127.0.0.1:{gcs}", *common, *node,
                        "--resources", '{"tandem_b": 1}'],
                       env=env, check=True, capture_output=True, timeout=120)
        return gcs, dash

    try:
        for attempt in range(3):  # a port another process took between choice and bind
            try:
                gcs, dash = start()
                break
            except subprocess.CalledProcessError as e:
                _stop_by_pid(root)
                if attempt == 2:
                    raise AssertionError(f"ray start failed: {e.cmd}\n"
                                         f"{(e.stderr or b'').decode()[-3000:]}") from e
        yield RayCluster(root=root, env=env, dashboard=f"http://127.0.0.1:{dash}")
    finally:
        _stop_by_pid(root)
        shutil.rmtree(root, ignore_errors=True)


def bench_entrypoint(configs: list[str], out: Path) -> str:
    args = [sys.executable, "-m", "tandem.cli", "bench"]
    for c in configs:
        args += ["--config", c]
    args += ["--concurrency", "1", "--num-requests", "2", "--num-warmup", "0",
             "--output-len", "4", "--out", str(out), "--no-plot", "--no-progress"]
    return " ".join(args)


def variant(name: str, root: Path, **changes) -> Path:
    """A bundled bench config with top-level sections updated."""
    doc = yaml.safe_load((BUNDLED / f"{name}.yaml").read_text())
    for key, value in changes.items():
        doc[key] = {**doc.get(key, {}), **value} if isinstance(value, dict) else value
    path = root / f"{name}-{secrets.token_hex(3)}.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def test_the_cpu_benchmark_runs_as_a_ray_job_across_two_nodes(cluster):
    apart = variant("cpu-disagg", cluster.root, prefill={"resources": {"tandem_a": 1}},
                    decode={"resources": {"tandem_b": 1}})
    out = cluster.root / "bench.json"
    job = cluster.submit(bench_entrypoint(["cpu-colocated", str(apart)], out))
    assert job["status"] == "SUCCEEDED", job["logs"][-4000:]
    doc = json.loads(out.read_text())
    validate(doc)
    runs = {r["deployment"]["mode"]: r for r in doc["runs"]}
    assert set(runs) == {"colocated", "disaggregated"}
    for run in runs.values():
        assert run["error"] is None, run["error"]
        (level,) = run["levels"]
        assert level["num_completed"] == 2 and level["mean_output_tokens"] == 4
    assert doc["machine"]["ray_address"], "the job ran on the cluster, not a local Ray"


def test_a_config_the_cluster_cannot_hold_fails_the_job_at_once(cluster):
    too_big = variant("cpu-disagg", cluster.root, decode={"num_cpus": 8})
    job = cluster.submit(bench_entrypoint([str(too_big)], cluster.root / "big.json"),
                         timeout_s=120)
    assert job["status"] == "FAILED", job["logs"][-4000:]
    assert job["seconds"] < 60, job["seconds"]
    assert "decode.num_cpus" in job["logs"] and "needs 9 CPU in all" in job["logs"]
    assert "the cluster has 4 (2 + 2 on 2 node(s))" in job["logs"]
    # Nothing stays reserved: every CPU of the cluster is free once the job is gone.
    probe = (f"{sys.executable} -c \"import json, ray; ray.init(); "
             "print('FREE', json.dumps([ray.available_resources().get('CPU'), "
             "ray.cluster_resources().get('CPU')]))\"")
    deadline = time.monotonic() + 30
    while True:
        free = cluster.submit(probe, timeout_s=60)
        line = next(x for x in free["logs"].splitlines() if x.startswith("FREE"))
        available, total = json.loads(line[5:])
        if available == total == 4 or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert available == total == 4, (available, total)
