"""A disaggregated deployment of the tiny model behind the gRPC router on 127.0.0.1 (Ray
actors, Mooncake by default), and the module fixtures its tests share."""

from __future__ import annotations

import time

import grpc
import pytest

from disagg_helpers import tiny_model_and_head
from tandem.deploy.config import DeployConfig
from tandem.kvtransfer import EndpointConfig

ray = pytest.importorskip("ray")

# Short transfer deadlines and leases: a fault shows in seconds, not in the production 75 s.
SHORT = EndpointConfig(handshake_timeout_s=5.0, timeout_s=4.0, drain_timeout_s=3.0,
                       lease_margin_s=4.0)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    return tiny_model_and_head(tmp_path_factory.mktemp("m"))


@pytest.fixture(scope="module")
def local_ray():
    from tandem.deploy.launcher import init_ray

    if ray.is_initialized():
        ray.shutdown()
    init_ray(num_cpus=8)
    yield
    ray.shutdown()


class System:
    """A deployment behind a gRPC server on 127.0.0.1 (random port)."""

    def __init__(self, cfg: DeployConfig) -> None:
        from tandem.deploy.serve import launch_and_build
        from tandem.proto import router_pb2_grpc as pb_grpc
        from tandem.router.app import BackgroundServer
        from tandem.router.server import ServerConfig

        self.dep, self.router = launch_and_build(cfg)
        self.server = BackgroundServer(self.router, ServerConfig(host="127.0.0.1", port=0)).start()
        self.channel = grpc.insecure_channel(f"127.0.0.1:{self.server.port}")
        self.stub = pb_grpc.RouterStub(self.channel)

    def generate(self, prompt, max_tokens, timeout=60, **pins):
        from tandem.proto import router_pb2 as pb

        req = pb.GenerateRequest(prompt_token_ids=prompt,
                                 sampling=pb.SamplingParams(max_tokens=max_tokens,
                                                            ignore_eos=True), **pins)
        return self.stub.Generate(req, timeout=timeout)

    def tokens(self, prompt, max_tokens, **pins) -> list[int]:
        out = []
        for msg in self.generate(prompt, max_tokens, **pins):
            out.extend(msg.token_ids)
        return out

    def outcome(self, prompt, max_tokens, timeout=60, **pins) -> str:
        """The status name the request ended with."""
        try:
            for _ in self.generate(prompt, max_tokens, timeout=timeout, **pins):
                pass
        except grpc.RpcError as exc:
            return exc.code().name
        return "OK"

    def workers(self) -> dict[str, object]:
        """The router's view (ListWorkers), by worker name."""
        from tandem.proto import router_pb2 as pb

        return {w.name: w for w in self.stub.ListWorkers(pb.ListWorkersRequest(),
                                                         timeout=10).workers}

    def health(self, name: str):
        """The worker's own health answer (WorkerHealth)."""
        handle = {**self.dep.prefill, **self.dep.decode}[name]
        return ray.get(handle.health.remote(), timeout=30)

    def all_free(self, timeout_s=30.0, skip=()) -> bool:
        """Whether every worker (but `skip`) has all its pages free and nothing running
        within `timeout_s` (a restarting worker is waited for)."""
        end = time.monotonic() + timeout_s
        names = [n for n in [*self.dep.prefill, *self.dep.decode] if n not in skip]
        while time.monotonic() < end:
            try:
                hs = [self.health(n) for n in names]
                if all(h.num_free_pages == h.num_pages and h.num_running == 0 for h in hs):
                    return True
            except Exception:  # noqa: BLE001 -- restarting
                pass
            time.sleep(0.2)
        return False

    def close(self) -> None:
        self.channel.close()
        self.server.stop()
        self.dep.shutdown()
