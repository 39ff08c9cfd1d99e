"""The router's Prometheus metrics without a model: request metrics move by known amounts after
known requests (scripted dispatcher), every family is in the scrape, two routers in one process
keep apart, worker counters reported cumulatively stay monotonic across a worker's restart, and
the worker families render those counts (pages, acceptance, transfer bytes / latency / failures
per worker and backend)."""

from __future__ import annotations

import asyncio
from contextlib import aclosing
from types import SimpleNamespace

import pytest
from prometheus_client.parser import text_string_to_metric_families
from test_router_lifecycle import FakeDispatcher, _collect, _inp, run

from tandem.messages import TransferTotals, WorkerHealth
from tandem.router import Router, RouterError, SamplingInput
from tandem.router.dispatch import DispatcherStats, SpecCounts, WorkerCounts, WorkerTotals
from tandem.router.metrics import RouterMetrics, render
from tandem.router.worker_health import WorkerHealthTable

FAMILIES = {
    # requests (router)
    "tandem:request_success": "counter", "tandem:requests": "counter",
    "tandem:prompt_tokens": "counter", "tandem:generation_tokens": "counter",
    "tandem:time_to_first_token_seconds": "histogram",
    "tandem:inter_token_latency_seconds": "histogram",
    "tandem:request_time_per_output_token_seconds": "histogram",
    "tandem:e2e_request_latency_seconds": "histogram",
    "tandem:request_queue_time_seconds": "histogram",
    "tandem:num_requests_running": "gauge", "tandem:num_requests_waiting": "gauge",
    # workers (dispatcher)
    "tandem:kv_pages_free": "gauge", "tandem:kv_pages_used": "gauge",
    "tandem:kv_cache_usage_perc": "gauge", "tandem:worker_healthy": "gauge",
    "tandem:worker_restarts": "counter",
    "tandem:spec_decode_acceptance_length": "histogram",
    "tandem:spec_decode_num_drafts": "counter",
    "tandem:spec_decode_num_accepted_tokens": "counter",
    "tandem:spec_decode_num_accepted_tokens_per_pos": "counter",
    "tandem:kv_transfer_bytes": "counter", "tandem:kv_transfer_latency_seconds": "histogram",
    "tandem:kv_transfer_failures": "counter",
}


def scrape(text: bytes) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """{(sample name, sorted labels): value} of a scrape; checks every family is there with its
    type."""
    families = {f.name: f for f in text_string_to_metric_families(text.decode())}
    for name, kind in FAMILIES.items():
        assert name in families, f"family {name} missing"
        assert families[name].type == kind, name
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in families.values() for s in f.samples}


def value(samples, name: str, **labels) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


@pytest.mark.timeout(30)
def test_request_metrics_move_by_known_amounts():
    async def main():
        router = Router(FakeDispatcher(num_tokens=3), {"m": None})
        before = scrape(router.metrics_text()[0])
        outs = [await _collect(router, _inp(prompt_token_ids=(1, 2, 3, 4))) for _ in range(3)]
        with pytest.raises(RouterError):  # refused: a token id outside the vocabulary
            await _collect(router, _inp(prompt_token_ids=(1, 999)))
        async with aclosing(router.generate(_inp(sampling=SamplingInput(max_tokens=3)))) as gen:
            await anext(gen)  # the client goes away after the first token
        after = scrape(router.metrics_text()[0])
        return before, outs, after

    before, outs, after = run(main())

    def moved(name, **labels):
        return value(after, name, **labels) - value(before, name, **labels)

    streamed = sum(len(o.token_ids) for out in outs for o in out)
    assert streamed == 9
    assert moved("tandem:generation_tokens_total") == streamed + 1  # + the cancelled one's
    assert moved("tandem:prompt_tokens_total") == 3 * 4 + 3  # refused prompts are not counted
    assert moved("tandem:time_to_first_token_seconds_count") == 4
    assert moved("tandem:inter_token_latency_seconds_count") == 3 * 2  # 3 chunks: 2 gaps each
    assert moved("tandem:request_time_per_output_token_seconds_count") == 3
    assert moved("tandem:e2e_request_latency_seconds_count") == 3
    assert moved("tandem:request_success_total", finished_reason="length") == 3
    assert moved("tandem:request_success_total", finished_reason="stop") == 0
    assert moved("tandem:requests_total", code="OK") == 3
    assert moved("tandem:requests_total", code="INVALID_ARGUMENT") == 1
    assert moved("tandem:requests_total", code="CANCELLED") == 1
    # The scripted dispatcher queues nothing itself: no queue time is observed.
    assert moved("tandem:request_queue_time_seconds_count") == 0


@pytest.mark.timeout(30)
def test_two_routers_in_one_process_keep_their_own_metrics():
    async def main():
        a = Router(FakeDispatcher(num_tokens=2), {"m": None})
        b = Router(FakeDispatcher(num_tokens=2), {"m": None})
        await _collect(a, _inp())
        return scrape(a.metrics_text()[0]), scrape(b.metrics_text()[0])

    sa, sb = run(main())
    assert value(sa, "tandem:generation_tokens_total") == 2
    assert value(sb, "tandem:generation_tokens_total") == 0


@pytest.mark.timeout(60)
def test_the_http_front_serves_the_scrape_behind_its_token():
    import http.client
    import json

    from tandem.http_api import HttpConfig, HttpServer
    from tandem.router.app import BackgroundServer
    from tandem.router.server import ServerConfig

    router = Router(FakeDispatcher(num_tokens=3), {"m": None})
    front = HttpServer(router, HttpConfig(port=0, auth_token="t0ken"))
    server = BackgroundServer(router, ServerConfig(port=0), fronts=[front]).start()

    def call(method: str, path: str, body: dict | None = None, token: str | None = "t0ken"):
        conn = http.client.HTTPConnection("127.0.0.1", front.port, timeout=20)
        headers = {"content-type": "application/json"}
        if token:
            headers["authorization"] = f"Bearer {token}"
        try:
            conn.request(method, path, body=json.dumps(body) if body else None, headers=headers)
            resp = conn.getresponse()
            return resp.status, resp.getheader("content-type"), resp.read()
        finally:
            conn.close()

    try:
        assert call("GET", "/metrics", token=None)[0] == 401
        status, content_type, text = call("GET", "/metrics")
        assert status == 200 and content_type.startswith("text/plain")
        before = scrape(text)
        for _ in range(2):
            status, _, _ = call("POST", "/v1/completions",
                                {"model": "m", "prompt": [1, 2, 3], "max_tokens": 3})
            assert status == 200
        after = scrape(call("GET", "/metrics")[2])
    finally:
        server.stop()
    for name, labels, amount in [("tandem:generation_tokens_total", {}, 6),
                                 ("tandem:prompt_tokens_total", {}, 6),
                                 ("tandem:requests_total", {"code": "OK"}, 2),
                                 ("tandem:time_to_first_token_seconds_count", {}, 2)]:
        assert value(after, name, **labels) - value(before, name, **labels) == amount, name


def _transfer(done: int, nbytes: int, slow: int = 0, failed: int = 0) -> TransferTotals:
    """`done` transfers, `slow` of them in the 0.5 s bucket, the rest in the 5 ms one."""
    bounds = (0.005, 0.5)
    return TransferTotals(backend="fake", num_done=done, num_bytes=nbytes,
                          latency_bounds_s=bounds, latency_counts=(done - slow, slow, 0),
                          latency_sum_s=0.001 * (done - slow) + 0.3 * slow,
                          failures=(("timeout", failed),) if failed else ())


class Worker:
    """What the health poll uses of an actor handle: `health.remote()` answers `answer`."""

    def __init__(self, h: WorkerHealth) -> None:
        self.answer = h
        self.health = SimpleNamespace(remote=self._remote)

    def _remote(self):
        async def answer():
            return self.answer
        return answer()


def _health(incarnation: str, transfer: TransferTotals, rounds: int = 0, tokens: int = 0,
            accepted_at: tuple[int, ...] = ()) -> WorkerHealth:
    return WorkerHealth(
        name="decode-0", role="decode", healthy=True, error="", num_running=0, num_waiting=0,
        num_free_pages=30, num_pages=40, node="n0", num_rounds=rounds,
        mean_acceptance_length=tokens / rounds if rounds else 0.0,
        per_position=tuple(a / rounds for a in accepted_at) if rounds else (),
        incarnation=incarnation, transfer=transfer)


@pytest.mark.timeout(30)
def test_worker_counters_never_go_back_when_a_worker_restarts(monkeypatch):
    # decode-0 reports cumulative counts; Ray restarts it (new incarnation, counts from 0)
    worker = Worker(_health("a", _transfer(3, 3000, slow=1), rounds=10, tokens=23,
                            accepted_at=(8, 5)))
    table = WorkerHealthTable({}, {"decode-0": worker}, {"decode-0": b""}, "m", lambda n: 0.0)
    monkeypatch.setattr(table, "_refresh_endpoint", _endpoint_ok)

    def totals() -> WorkerTotals:
        (w,) = table.totals()
        return w

    async def main():
        await table.check("decode-0")
        first = totals()
        worker.answer = _health("a", _transfer(5, 5000, slow=1, failed=1), rounds=20,
                                tokens=47, accepted_at=(15, 12))
        await table.check("decode-0")
        grown = totals()
        worker.answer = _health("b", _transfer(1, 700), rounds=4, tokens=6, accepted_at=(2, 0))
        await table.check("decode-0")
        return first, grown, totals()

    first, grown, restarted = asyncio.run(main())
    assert first.num_restarts == grown.num_restarts == 0 and restarted.num_restarts == 1
    assert first.counts.transfer.num_bytes == 3000 and grown.counts.transfer.num_bytes == 5000
    # after the restart: the old process's last counts plus the new one's
    t = restarted.counts.transfer
    assert (t.num_done, t.num_bytes, t.latency_counts, t.failures) == (
        6, 5700, (5, 1, 0), (("timeout", 1),))
    assert restarted.counts.spec == SpecCounts(num_rounds=24, num_tokens=53,
                                               accepted_at=(17, 12))

    # ... and the scrape shows them, labelled by worker and backend
    stats = DispatcherStats(spec=None, num_running=2, num_waiting=1,
                            workers=(grown, restarted))
    s = scrape(render(RouterMetrics(lambda: stats).registry)[0])
    who = {"worker": "decode-0", "role": "decode"}
    assert value(s, "tandem:num_requests_running") == 2
    assert value(s, "tandem:num_requests_waiting") == 1
    assert value(s, "tandem:kv_pages_free", **who) == 30
    assert value(s, "tandem:kv_pages_used", **who) == 10
    assert value(s, "tandem:kv_cache_usage_perc", **who) == 0.25
    assert value(s, "tandem:worker_healthy", **who) == 1
    assert value(s, "tandem:worker_restarts_total", **who) == 1
    fake = {**who, "backend": "fake"}
    assert value(s, "tandem:kv_transfer_bytes_total", **fake) == 5700
    assert value(s, "tandem:kv_transfer_latency_seconds_count", **fake) == 6
    assert value(s, "tandem:kv_transfer_latency_seconds_bucket", le="0.005", **fake) == 5
    assert value(s, "tandem:kv_transfer_latency_seconds_bucket", le="0.5", **fake) == 6
    assert value(s, "tandem:kv_transfer_failures_total", kind="timeout", **fake) == 1
    assert value(s, "tandem:spec_decode_num_drafts_total", **who) == 24
    assert value(s, "tandem:spec_decode_num_accepted_tokens_total", **who) == 53 - 24
    assert value(s, "tandem:spec_decode_num_accepted_tokens_per_pos_total", position="0",
                 **who) == 17
    assert value(s, "tandem:spec_decode_num_accepted_tokens_per_pos_total", position="1",
                 **who) == 12
    # tokens per round: <= 1 when no draft was accepted (24 - 17), <= 2 (24 - 12), <= 3 (all)
    assert [value(s, "tandem:spec_decode_acceptance_length_bucket", le=le, **who)
            for le in ("1.0", "2.0", "3.0", "+Inf")] == [7, 12, 24, 24]
    assert value(s, "tandem:spec_decode_acceptance_length_sum", **who) == 53


async def _endpoint_ok(name: str) -> bool:
    return True


def test_counts_behind_reported_means_are_exact():
    # the health answer carries means; the counts come back exactly, even for large ones
    for rounds, tokens, accepted in [(3, 7, (2, 1)), (10**9 + 7, 3 * 10**9 + 1, (10**9, 77))]:
        got = SpecCounts.from_means(tokens / rounds, tuple(a / rounds for a in accepted), rounds)
        assert got == SpecCounts(num_rounds=rounds, num_tokens=tokens, accepted_at=accepted)


def test_counts_add_up_and_a_missing_transfer_side_is_kept():
    a = WorkerCounts(spec=SpecCounts(num_rounds=1, num_tokens=2, accepted_at=(1,)))
    b = WorkerCounts(spec=SpecCounts(num_rounds=2, num_tokens=5, accepted_at=(2, 1)),
                     transfer=_transfer(2, 10))
    total = a + b
    assert total.spec == SpecCounts(num_rounds=3, num_tokens=7, accepted_at=(3, 1))
    assert total.transfer == b.transfer
    assert (b + b).transfer.num_bytes == 20


def test_a_worker_reports_its_endpoints_transfers_as_cumulative_buckets():
    from tandem.kvtransfer import ErrorKind
    from tandem.kvtransfer.metrics import LATENCY_BUCKETS_S, MetricsRecorder
    from tandem.worker.front import transfer_totals

    rec = MetricsRecorder()
    for latency in (0.001, 0.0011, 0.3, 1000.0):  # on a bound counts in that bound's bucket
        rec.record_done(100, latency)
    rec.record_failure(ErrorKind.TIMEOUT)
    t = transfer_totals("nixl", rec.snapshot())
    assert (t.backend, t.num_done, t.num_bytes) == ("nixl", 4, 400)
    assert t.latency_bounds_s == LATENCY_BUCKETS_S
    expected = [0] * (len(LATENCY_BUCKETS_S) + 1)
    expected[0] = expected[1] = 1  # 1 ms; 1.1 ms in the 2.5 ms bucket
    expected[LATENCY_BUCKETS_S.index(0.5)] = 1
    expected[-1] = 1  # above every bound
    assert list(t.latency_counts) == expected
    assert t.latency_sum_s == pytest.approx(1000.3021)
    assert t.failures == ((ErrorKind.TIMEOUT.value, 1),)
