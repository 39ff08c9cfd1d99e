"""Load and faults as normal operation (docs/reliability.md), through the public gRPC API on
127.0.0.1 with real Ray actors and Mooncake, on the tiny model:
- kill -9 of the decode worker, then of the prefill worker, under load: the requests in flight
  end within a second (UNAVAILABLE, or OK), Ray restarts the worker, it serves again, and every
  KV page comes back;
- SIGSTOP of a decode worker: it is marked down within 3 s, new requests go to the other one
  and none waits on it, and it is back after SIGCONT;
- over the router's admission bound, requests wait in its queue or are refused at once with
  RESOURCE_EXHAUSTED; none fails otherwise and nothing leaks.
The longer soak with the real model is tests/integration/test_soak.py."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from grpc_system import SHORT, System, dirs, local_ray  # noqa: F401 -- module fixtures
from tandem.deploy.config import DeployConfig, GroupConfig
from tandem.engine import EngineConfig
from tandem.router.admission import AdmissionConfig
from tandem.spec import SpecConfig

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]
ray = pytest.importorskip("ray")


def _cfg(dirs, decode=1, router=None, num_pages=256) -> DeployConfig:
    model_dir, head_dir = dirs
    return DeployConfig(
        engine=EngineConfig(model=str(model_dir), dtype="float32", page_size=4,
                            num_pages=num_pages),
        spec=SpecConfig(draft_model=str(head_dir), num_steps=3),
        transfer_backend="mooncake", transfer_timeout_s=4.0, endpoint=SHORT,
        prefill=GroupConfig(num_cpus=0.5), decode=GroupConfig(replicas=decode, num_cpus=0.5),
        router=router or AdmissionConfig())


class Load:
    """`n` client threads sending long streaming requests until stopped; each records when and
    how its requests ended."""

    def __init__(self, system: System, n: int, max_tokens: int = 200) -> None:
        self.system, self.stop = system, threading.Event()
        self.ends: list[tuple[float, float, str]] = []  # (start, end, status), monotonic
        self._threads = [threading.Thread(target=self._client, args=(i, max_tokens))
                         for i in range(n)]
        for t in self._threads:
            t.start()

    def _client(self, i: int, max_tokens: int) -> None:
        while not self.stop.is_set():
            t0 = time.monotonic()
            status = self.system.outcome([1 + i, 2, 3, 4 + i], max_tokens, timeout=60)
            self.ends.append((t0, time.monotonic(), status))
            if status != "OK":
                time.sleep(0.2)  # a worker is down: do not spin

    def close(self) -> None:
        self.stop.set()
        for t in self._threads:
            t.join(timeout=90)


def _serves_again(system: System, within_s: float) -> float:
    """Seconds until a new request succeeds (fails the test after `within_s`)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < within_s:
        if system.outcome([7, 8, 9], 4, timeout=10) == "OK":
            return time.monotonic() - t0
        time.sleep(0.25)
    raise AssertionError(f"not serving again within {within_s} s")


def test_kill9_of_decode_then_prefill_under_load_restarts_and_leaks_nothing(local_ray, dirs):
    system = System(_cfg(dirs))
    try:
        assert system.outcome([1, 2, 3], 4) == "OK"
        for role in ("decode-0", "prefill-0"):
            before = system.health(role)
            load = Load(system, 4)
            time.sleep(1.5)  # requests in flight on both workers
            t_kill = time.monotonic()
            os.kill(before.pid, signal.SIGKILL)
            waited = _serves_again(system, 30.0)
            load.close()
            after = system.health(role)
            assert after.incarnation != before.incarnation and after.pid != before.pid
            # Requests in flight at the kill ended within a second with UNAVAILABLE, or went on
            # to OK (their KV had already left the prefill worker: decode finishes them).
            in_flight = [(end - t_kill, status) for start, end, status in load.ends
                         if start < t_kill < end]
            assert in_flight, f"no request was in flight on {role} at its kill: {load.ends}"
            late = [x for x in in_flight if x[1] != "OK" and x[0] >= 1.0]
            assert not late, (role, in_flight)
            assert {s for _, _, s in load.ends} <= {"OK", "UNAVAILABLE"}, load.ends
            failed = [dt for dt, status in in_flight if status != "OK"]
            print(f"{role}: {len(in_flight)} requests in flight at kill -9, {len(failed)} ended "
                  f"UNAVAILABLE after {max(failed, default=0):.2f} s at most; serving again "
                  f"after {waited:.1f} s")
            assert system.all_free(), f"pages leaked after the kill of {role}"
    finally:
        system.close()


def test_sigstop_marks_a_decode_worker_down_fast_and_new_requests_avoid_it(local_ray, dirs):
    system = System(_cfg(dirs, decode=2))
    try:
        for name in ("decode-0", "decode-1"):
            assert system.outcome([1, 2, 3], 4, decode_worker=name) == "OK"
        pid = system.health("decode-1").pid
        os.kill(pid, signal.SIGSTOP)
        t0 = time.monotonic()
        try:
            while system.workers()["decode-1"].healthy:
                assert time.monotonic() - t0 < 3.0, "a frozen worker was not marked down in 3 s"
                time.sleep(0.05)
            marked = time.monotonic() - t0
            # New requests all go to decode-0 and none waits on the frozen worker.
            for i in range(6):
                t1 = time.monotonic()
                assert system.outcome([i + 1, 5, 6], 6, timeout=20) == "OK"
                assert time.monotonic() - t1 < 5.0
            time.sleep(max(0.0, 20.0 - (time.monotonic() - t0)))  # frozen for 20 s in all
        finally:
            os.kill(pid, signal.SIGCONT)
        t2 = time.monotonic()
        while not system.workers()["decode-1"].healthy:
            assert time.monotonic() - t2 < 5.0, "the worker did not come back after SIGCONT"
            time.sleep(0.05)
        assert system.outcome([1, 2, 3], 4, decode_worker="decode-1") == "OK"
        print(f"SIGSTOP: marked down after {marked:.2f} s; back {time.monotonic() - t2:.2f} s "
              "after SIGCONT")
        assert system.all_free()
    finally:
        system.close()


def test_over_the_admission_bound_requests_queue_or_get_resource_exhausted(local_ray, dirs):
    system = System(_cfg(dirs, router=AdmissionConfig(max_running=4, max_queued=8)))
    try:
        statuses: list[str] = []

        def client(i: int) -> None:
            statuses.append(system.outcome([i % 200 + 1, 2, 3], 24, timeout=120))

        threads = [threading.Thread(target=client, args=(i,)) for i in range(40)]
        [t.start() for t in threads]
        [t.join() for t in threads]
        assert len(statuses) == 40
        assert set(statuses) <= {"OK", "RESOURCE_EXHAUSTED"}, statuses
        assert statuses.count("OK") >= 12  # the running and queued ones all finish
        assert "RESOURCE_EXHAUSTED" in statuses
        assert system.all_free()
    finally:
        system.close()


def test_a_full_decode_pool_queues_requests_instead_of_failing_them(local_ray, dirs):
    """With too few KV pages for every request at once, the router keeps the others waiting
    for pages (no RESOURCE_EXHAUSTED while the queue has room, no prefill forward wasted on a
    request that cannot be placed) and every request ends OK."""
    system = System(_cfg(dirs, num_pages=64))  # ~16 requests of 30 tokens fit at once
    try:
        statuses: list[str] = []

        def client(i: int) -> None:
            statuses.append(system.outcome([i + 1, 2, 3, 4, 5, 6], 24, timeout=120))

        threads = [threading.Thread(target=client, args=(i,)) for i in range(40)]
        [t.start() for t in threads]
        [t.join() for t in threads]
        assert statuses == ["OK"] * 40, statuses
        assert system.all_free()
    finally:
        system.close()


def test_a_request_whose_prefill_worker_dies_before_its_first_token_is_retried(local_ray, dirs):
    """Requests placed on a frozen prefill worker (before the router notices) have no first
    token yet when it is killed: each is tried once more, on the restarted worker, and ends OK
    -- the client sees only a delay."""
    system = System(_cfg(dirs))
    try:
        assert system.outcome([1, 2, 3], 4) == "OK"
        before = system.health("prefill-0")
        os.kill(before.pid, signal.SIGSTOP)
        statuses: list[str] = []
        threads = [threading.Thread(target=lambda i=i: statuses.append(
            system.outcome([i + 1, 2, 3], 8, timeout=60))) for i in range(3)]
        [t.start() for t in threads]
        time.sleep(0.5)  # placed on the frozen worker: it is not marked down yet
        os.kill(before.pid, signal.SIGKILL)
        [t.join() for t in threads]
        assert statuses == ["OK"] * 3, statuses
        assert system.health("prefill-0").incarnation != before.incarnation
        assert system.all_free()
    finally:
        system.close()
