"""The router's request lifecycle against a scripted dispatcher (no model, no gRPC): streaming,
usage and TTFT, Abort, client cancel and deadlines reaching the dispatcher, worker failure ->
UNAVAILABLE and quarantine, request ids and rooms, counters. Also the pure helpers: bearer-auth
check and the invalid-UTF-8 field finder.

`FakeDispatcher` is imported by test_router_validation.py too."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Sequence
from contextlib import aclosing

import pytest

from tandem.engine.request import FinishReason
from tandem.proto import router_pb2 as pb
from tandem.router import (
    Code,
    DispatcherStats,
    GenerateInput,
    ModelInfo,
    RoutedRequest,
    Router,
    RouterConfig,
    RouterError,
    SamplingInput,
    TokenChunk,
    WorkerInfo,
    WorkerRole,
    WorkerUnavailable,
)
from tandem.router.auth import check_bearer
from tandem.router.wire import Undecodable, find_invalid_utf8, safe_deserializer

MODEL = ModelInfo(name="m", vocab_size=100, max_model_len=64, max_request_tokens=48)


class FakeDispatcher:
    """Streams `num_tokens` tokens (ids 10, 11, ...) per request, `delay_s` apart; records what
    the router asked for. `fail_after`: raise WorkerUnavailable after that many tokens."""

    def __init__(self, workers: Sequence[WorkerInfo] | None = None, models=(MODEL,),
                 num_tokens: int = 3, delay_s: float = 0.0, fail_after: int | None = None):
        self._workers = list(workers or [WorkerInfo(name="w0", role=WorkerRole.COLOCATED,
                                                    model="m", num_pages=8, num_free_pages=8)])
        self._models = tuple(models)
        self.num_tokens, self.delay_s, self.fail_after = num_tokens, delay_s, fail_after
        self.submitted: list[RoutedRequest] = []
        self.closed_early: list[str] = []  # streams closed before their final chunk
        self.live: set[str] = set()
        self._abort: dict[str, asyncio.Event] = {}

    def models(self):
        return self._models

    def workers(self):
        return list(self._workers)

    def set_workers(self, workers: Sequence[WorkerInfo]) -> None:
        self._workers = list(workers)

    async def submit(self, request: RoutedRequest) -> AsyncGenerator[TokenChunk, None]:
        self.submitted.append(request)
        rid = request.request_id
        self.live.add(rid)
        self._abort[rid] = abort = asyncio.Event()
        finished = False
        try:
            n = min(self.num_tokens, request.params.max_new_tokens)
            for i in range(n):
                if self.fail_after is not None and i == self.fail_after:
                    raise WorkerUnavailable(request.placement.decode_worker,
                                            f"worker '{request.placement.decode_worker}' died")
                try:
                    await asyncio.wait_for(abort.wait(), self.delay_s) if self.delay_s else None
                except TimeoutError:
                    pass
                if abort.is_set():
                    finished = True
                    yield TokenChunk(request_id=rid, token_ids=(), text_delta="",
                                     finish_reason=FinishReason.ABORT)
                    return
                last = i == n - 1
                finished = last
                yield TokenChunk(request_id=rid, token_ids=(10 + i,), text_delta=f"t{i} ",
                                 finish_reason=FinishReason.LENGTH if last else None)
        finally:
            self.live.discard(rid)
            self._abort.pop(rid, None)
            if not finished:
                self.closed_early.append(rid)

    async def abort(self, request_id: str) -> bool:
        event = self._abort.get(request_id)
        if event is None:
            return False
        event.set()
        return True

    def stats(self):
        return DispatcherStats(spec=None)

    async def close(self):
        pass


def _inp(**kw) -> GenerateInput:
    sampling = kw.pop("sampling", SamplingInput(max_tokens=4))
    kw.setdefault("prompt_token_ids", (1, 2, 3))
    return GenerateInput(sampling=sampling, **kw)


async def _collect(router: Router, inp: GenerateInput, timeout_s: float | None = None):
    return [o async for o in router.generate(inp, timeout_s)]


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 10))


@pytest.mark.timeout(30)
def test_stream_order_usage_and_final_fields():
    async def main():
        d = FakeDispatcher(num_tokens=3)
        router = Router(d, {"m": None})
        outs = await _collect(router, _inp(request_id="abc"))
        assert [o.token_ids for o in outs] == [(10,), (11,), (12,)]
        assert "".join(o.text_delta for o in outs) == "t0 t1 t2 "
        assert [o.finish_reason for o in outs] == [None, None, FinishReason.LENGTH]
        final = outs[-1]
        assert final.usage.prompt_tokens == 3 and final.usage.completion_tokens == 3
        assert final.ttft_s is not None and final.latency_s >= final.ttft_s
        assert all(o.request_id == "abc" for o in outs)
        req = d.submitted[0]
        assert 0 < req.room < 2**64 and req.prompt_ids == (1, 2, 3)
        assert req.placement.prefill_worker == req.placement.decode_worker == "w0"
        s = router.stats()
        assert (s.num_requests, s.num_finished, s.num_in_flight, s.num_completion_tokens) == (
            1, 1, 0, 3)
    run(main())


@pytest.mark.timeout(30)
def test_rejected_request_is_counted_and_never_dispatched():
    async def main():
        d = FakeDispatcher()
        router = Router(d, {"m": None})
        with pytest.raises(RouterError) as e:
            await _collect(router, _inp(sampling=SamplingInput(max_tokens=0)))
        assert e.value.code is Code.INVALID_ARGUMENT
        assert e.value.message.startswith("sampling.max_tokens")
        assert not d.submitted and router.stats().num_rejected == 1
    run(main())


@pytest.mark.timeout(30)
def test_abort_ends_stream_with_abort_reason():
    async def main():
        d = FakeDispatcher(num_tokens=40, delay_s=0.05)
        router = Router(d, {"m": None})
        outs = []
        async for o in router.generate(_inp(request_id="r1", sampling=SamplingInput(
                max_tokens=40))):
            outs.append(o)
            if len(outs) == 2:
                assert await router.abort("r1") is True
        assert outs[-1].finish_reason is FinishReason.ABORT
        assert len(outs) < 40 and not d.live
        assert await router.abort("r1") is False  # no longer in flight
        assert router.stats().num_aborted == 1
    run(main())


@pytest.mark.timeout(30)
def test_consumer_cancel_closes_the_dispatch_stream():
    async def main():
        d = FakeDispatcher(num_tokens=100, delay_s=0.02)
        router = Router(d, {"m": None})

        async def consume():
            async with aclosing(router.generate(_inp(request_id="c1", sampling=SamplingInput(
                    max_tokens=40)))) as outs:
                async for _ in outs:
                    pass

        task = asyncio.create_task(consume())
        while not d.live:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert d.closed_early == ["c1"] and not d.live
        s = router.stats()
        assert s.num_in_flight == 0 and s.num_aborted == 1
    run(main())


@pytest.mark.timeout(30)
def test_deadline_stops_generation_and_closes_stream():
    async def main():
        d = FakeDispatcher(num_tokens=100, delay_s=0.05)
        router = Router(d, {"m": None})
        with pytest.raises(RouterError) as e:
            await _collect(router, _inp(request_id="d1", sampling=SamplingInput(max_tokens=40)),
                           timeout_s=0.2)
        assert e.value.code is Code.DEADLINE_EXCEEDED and "deadline" in e.value.message
        assert d.closed_early == ["d1"] and not d.live
        assert d.submitted[0].deadline is not None  # the dispatcher got the deadline too
    run(main())


@pytest.mark.timeout(30)
def test_router_max_request_s_applies_without_client_deadline():
    async def main():
        d = FakeDispatcher(num_tokens=100, delay_s=0.05)
        router = Router(d, {"m": None}, RouterConfig(max_request_s=0.15))
        with pytest.raises(RouterError) as e:
            await _collect(router, _inp(sampling=SamplingInput(max_tokens=40)))
        assert e.value.code is Code.DEADLINE_EXCEEDED
    run(main())


@pytest.mark.timeout(30)
def test_worker_failure_is_unavailable_and_quarantines_the_worker():
    async def main():
        workers = [WorkerInfo(name=n, role=WorkerRole.COLOCATED, model="m", num_pages=8,
                              num_free_pages=8) for n in ("w0", "w1")]
        d = FakeDispatcher(workers, num_tokens=5, fail_after=1)
        router = Router(d, {"m": None})
        with pytest.raises(RouterError) as e:
            await _collect(router, _inp(prefill_worker="w0"))
        assert e.value.code is Code.UNAVAILABLE and "w0" in e.value.message
        assert router.stats().num_failed == 1
        d.fail_after = None
        for _ in range(3):  # w0 is quarantined: everything goes to w1
            outs = await _collect(router, _inp())
            assert outs[-1].finish_reason is FinishReason.LENGTH
        assert [r.placement.prefill_worker for r in d.submitted[1:]] == ["w1"] * 3
        with pytest.raises(RouterError) as e:
            await _collect(router, _inp(prefill_worker="w0"))
        assert e.value.code is Code.UNAVAILABLE and e.value.message.startswith("prefill_worker")
    run(main())


@pytest.mark.timeout(30)
def test_dead_worker_in_report_gets_no_requests_and_none_left_is_unavailable():
    async def main():
        d = FakeDispatcher([WorkerInfo(name="w0", role=WorkerRole.COLOCATED, model="m",
                                       healthy=False, error="engine crashed")])
        router = Router(d, {"m": None})
        assert not router.serving()
        with pytest.raises(RouterError) as e:
            await _collect(router, _inp())
        assert e.value.code is Code.UNAVAILABLE and "no healthy prefill worker" in e.value.message
        assert not d.submitted
    run(main())


@pytest.mark.timeout(30)
def test_request_ids_unique_in_flight_and_rooms_distinct():
    async def main():
        d = FakeDispatcher(num_tokens=20, delay_s=0.02)
        router = Router(d, {"m": None})
        gen = router.generate(_inp(request_id="same", sampling=SamplingInput(max_tokens=20)))
        first = await anext(gen)
        with pytest.raises(RouterError) as e:
            await _collect(router, _inp(request_id="same"))
        assert e.value.code is Code.ALREADY_EXISTS and e.value.message.startswith("request_id")
        await gen.aclose()
        assert first.request_id == "same" and d.closed_early == ["same"]
        ids = set()
        for _ in range(5):
            outs = await _collect(router, _inp())
            ids.add(outs[0].request_id)
        assert len(ids) == 5  # assigned ids are unique
        rooms = [r.room for r in d.submitted]
        assert len(set(rooms)) == len(rooms)
    run(main())


def test_check_bearer():
    assert check_bearer([("authorization", "Bearer s3cret")], "s3cret") is None
    assert check_bearer([("authorization", "bearer s3cret")], "s3cret") is None
    assert check_bearer([], "s3cret").startswith("authorization: missing")
    assert check_bearer(None, "s3cret").startswith("authorization: missing")
    assert check_bearer([("authorization", "Basic abc")], "s3cret").startswith(
        "authorization: expected")
    assert check_bearer([("authorization", "Bearer nope")], "s3cret") == (
        "authorization: invalid token")


def test_invalid_utf8_is_located_by_field_path():
    good = pb.GenerateRequest(messages=[pb.ChatMessage(role="user", content="ok"),
                                        pb.ChatMessage(role="user", content="XY")],
                              sampling=pb.SamplingParams(stop=["a", "b"]))
    data = good.SerializeToString()
    bad = data.replace(b"XY", b"\xff\xfe")
    assert find_invalid_utf8(pb.GenerateRequest.DESCRIPTOR, bad) == "messages[1].content"
    bad_stop = good.SerializeToString().replace(b"\x3a\x01b", b"\x3a\x01\xc3")
    assert find_invalid_utf8(pb.GenerateRequest.DESCRIPTOR, bad_stop) == "sampling.stop[1]"
    assert find_invalid_utf8(pb.GenerateRequest.DESCRIPTOR, data) is None
    decode = safe_deserializer(pb.GenerateRequest)
    assert isinstance(decode(data), pb.GenerateRequest)
    assert decode(bad) == Undecodable("messages[1].content: invalid UTF-8 (string fields must "
                                      "be UTF-8 text)")
    assert decode(b"\xff\xff\xff").message.startswith("request: not a valid")


def test_final_message_conversion_carries_usage_timing_and_spec_stats():
    from tandem.router import SpecAcceptance, Usage
    from tandem.router.convert import generate_response
    from tandem.router.router import GenerateOutput

    msg = generate_response(GenerateOutput(
        request_id="r", token_ids=(5, 6), text_delta="ab", finish_reason=FinishReason.STOP,
        usage=Usage(prompt_tokens=3, completion_tokens=7), ttft_s=0.25, latency_s=1.5,
        spec=SpecAcceptance(mean_acceptance_length=2.5, per_position=(0.9, 0.6),
                            num_rounds=4)))
    assert msg.finish_reason == pb.FINISH_REASON_STOP and list(msg.token_ids) == [5, 6]
    assert (msg.usage.prompt_tokens, msg.usage.completion_tokens) == (3, 7)
    assert (msg.ttft_s, msg.latency_s) == (0.25, 1.5)
    assert msg.spec_stats.mean_acceptance_length == 2.5 and msg.spec_stats.num_rounds == 4
    assert list(msg.spec_stats.per_position_acceptance) == pytest.approx([0.9, 0.6])
    partial = generate_response(GenerateOutput(request_id="r", token_ids=(1,), text_delta="x"))
    assert partial.finish_reason == pb.FINISH_REASON_UNSPECIFIED
    assert not partial.HasField("usage") and not partial.HasField("spec_stats")
