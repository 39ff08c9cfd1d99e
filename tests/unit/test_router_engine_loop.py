"""`EngineLoop` + `ColocatedDispatcher` on a tiny in-process model (float32, no tokenizer):
streamed tokens equal `LLMEngine.generate`; abort, consumer close, deadline, engine failure and
shutdown each end the request with the right outcome and return every KV page; a speculative
engine's final chunk carries per-request acceptance stats consistent with its tokens."""

from __future__ import annotations

import asyncio
import time

import pytest
from spec_helpers import (
    assert_pages_free,
    engine_cfg,
    one_thread,  # noqa: F401 (autouse fixture)
    prompts,
    tiny_head,
    tiny_target,
)

from tandem.colocated_node import ColocatedDispatcher
from tandem.engine import LLMEngine, SamplingParams
from tandem.engine.request import FinishReason
from tandem.router import (
    CapacityExceeded,
    DeadlineExceeded,
    GenerateInput,
    Placement,
    RequestRejected,
    RoutedRequest,
    Router,
    SamplingInput,
    WorkerUnavailable,
)
from tandem.spec import SpecConfig, SpecEngine

W = "colocated-0"


@pytest.fixture(scope="module")
def model():
    return tiny_target("llama")


def _engine(model, **kw) -> LLMEngine:
    return LLMEngine(engine_cfg(**kw), model)


def _req(rid: str, prompt, n: int, deadline: float | None = None, **params) -> RoutedRequest:
    params.setdefault("ignore_eos", True)
    return RoutedRequest(request_id=rid, room=1, model="default", prompt_ids=tuple(prompt),
                         params=SamplingParams(max_new_tokens=n, **params),
                         placement=Placement(prefill_worker=W, decode_worker=W),
                         deadline=deadline)


async def _tokens(dispatcher, req: RoutedRequest):
    chunks = [c async for c in dispatcher.submit(req)]
    return [t for c in chunks for t in c.token_ids], chunks


def _wait_free(dispatcher: ColocatedDispatcher, engine) -> None:
    assert dispatcher.loop(W).wait_idle(10), "engine loop did not go idle"
    assert_pages_free(engine)


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 60))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("overlap", [False, True])  # engine/overlap.py: tokens a step late
def test_stream_equals_generate_concurrently(model, overlap):
    ps = prompts(4, seed=3)
    ns = [5, 9, 1, 12]
    ref = _engine(model).generate(ps, [SamplingParams(max_new_tokens=n, ignore_eos=True)
                                       for n in ns])
    engine = _engine(model, overlap_schedule=overlap)
    d = ColocatedDispatcher.from_engine(engine)

    async def main():
        return await asyncio.gather(*(_tokens(d, _req(f"r{i}", p, n))
                                      for i, (p, n) in enumerate(zip(ps, ns))))

    try:
        results = run(main())
        for (tokens, chunks), want, n in zip(results, ref, ns):
            assert tokens == list(want.output_ids)
            assert [c.finished for c in chunks] == [False] * (n - 1) + [True]
            assert chunks[-1].finish_reason is FinishReason.LENGTH and chunks[-1].spec is None
        _wait_free(d, engine)
    finally:
        run(d.close())


@pytest.mark.timeout(60)
def test_router_over_colocated_dispatcher(model):
    """The router's path (validation, placement, accounting) in front of a real engine."""
    engine = _engine(model)
    d = ColocatedDispatcher.from_engine(engine)
    p = prompts(1, seed=5)[0]
    ref = _engine(model).generate([p], SamplingParams(max_new_tokens=6))[0]

    async def main():
        router = Router(d, {"default": None})
        outs = [o async for o in router.generate(GenerateInput(
            prompt_token_ids=tuple(p), sampling=SamplingInput(max_tokens=6)))]
        return outs, router.stats()

    try:
        outs, stats = run(main())
        assert [t for o in outs for t in o.token_ids] == list(ref.output_ids)
        assert outs[-1].usage.completion_tokens == len(ref.output_ids)
        assert stats.num_finished == 1 and stats.workers[0].info.num_pages > 0
        _wait_free(d, engine)
    finally:
        run(d.close())


@pytest.mark.timeout(60)
@pytest.mark.parametrize("overlap", [False, True])
def test_abort_and_close_free_every_page(model, overlap):
    engine = _engine(model, overlap_schedule=overlap)
    d = ColocatedDispatcher.from_engine(engine)

    async def main():
        # Abort: the stream ends with ABORT.
        stream = d.submit(_req("a", [1, 2, 3], 400))
        chunks = [await anext(stream), await anext(stream)]
        assert await d.abort("a") is True
        chunks += [c async for c in stream]
        assert chunks[-1].finish_reason is FinishReason.ABORT
        assert sum(len(c.token_ids) for c in chunks) < 400
        # Close before the end (client cancel): the request is aborted in the engine.
        stream = d.submit(_req("b", [4, 5, 6], 400))
        await anext(stream)
        await stream.aclose()
        # Cancel the consumer task mid-wait.
        task = asyncio.create_task(_tokens(d, _req("c", [7, 8], 400)))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert await d.abort("zzz") is False

    try:
        run(main())
        _wait_free(d, engine)
    finally:
        run(d.close())


@pytest.mark.timeout(60)
def test_deadline_aborts_in_the_engine(model):
    engine = _engine(model)
    d = ColocatedDispatcher.from_engine(engine)

    async def main():
        with pytest.raises(DeadlineExceeded, match="deadline"):
            await _tokens(d, _req("d", [1, 2, 3], 400, deadline=time.time() + 0.1))

    try:
        run(main())
        _wait_free(d, engine)
    finally:
        run(d.close())


@pytest.mark.timeout(60)
def test_capacity_backstop(model):
    engine = _engine(model, num_pages=8)  # 7 usable pages of 4 tokens
    d = ColocatedDispatcher.from_engine(engine)
    assert d.models()[0].max_request_tokens == 28

    async def main():
        with pytest.raises(CapacityExceeded, match="max_new_tokens"):
            await _tokens(d, _req("big", [1, 2, 3], 100))

    try:
        run(main())
        _wait_free(d, engine)
    finally:
        run(d.close())


@pytest.mark.timeout(60)
def test_engine_failure_is_unavailable_fast_and_marks_unhealthy(model):
    engine = _engine(model)
    d = ColocatedDispatcher.from_engine(engine)
    real_step, calls = engine.step, {"n": 0}

    def failing_step():
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("injected failure")
        return real_step()

    engine.step = failing_step

    async def main():
        with pytest.raises(WorkerUnavailable, match="injected failure") as e:
            await _tokens(d, _req("f", [1, 2, 3], 50))
        assert e.value.worker == W
        (info,) = d.workers()
        assert not info.healthy and "injected failure" in info.error
        t0 = time.perf_counter()
        with pytest.raises(WorkerUnavailable):
            await _tokens(d, _req("g", [1, 2], 5))
        assert time.perf_counter() - t0 < 1.0  # no hang on a dead worker

    try:
        run(main())
        assert engine.allocator.num_free == engine.allocator.num_usable  # failed request freed
    finally:
        run(d.close())


@pytest.mark.timeout(60)
def test_stop_ends_in_flight_requests(model):
    engine = _engine(model)
    d = ColocatedDispatcher.from_engine(engine)

    async def main():
        stream = d.submit(_req("s", [1, 2, 3], 400))
        await anext(stream)
        await d.close()
        with pytest.raises(WorkerUnavailable, match="shutting down"):
            async for _ in stream:
                pass
        with pytest.raises(WorkerUnavailable):
            await _tokens(d, _req("t", [1], 2))

    run(main())
    assert_pages_free(engine)


@pytest.mark.timeout(60)
def test_speculative_engine_reports_acceptance(model):
    spec = SpecConfig(num_steps=3)
    engine = SpecEngine(engine_cfg(), spec, model, tiny_head(model, "eagle"))
    d = ColocatedDispatcher.from_engine(engine)
    ps = prompts(2, seed=7)
    ref = _engine(model).generate(ps, SamplingParams(max_new_tokens=20, ignore_eos=True))

    async def main():
        return await asyncio.gather(*(_tokens(d, _req(f"s{i}", p, 20))
                                      for i, p in enumerate(ps)))

    try:
        results = run(main())
        for (tokens, chunks), want in zip(results, ref):
            assert tokens == list(want.output_ids)  # lossless (float32 greedy)
            s = chunks[-1].spec
            assert s is not None and len(s.per_position) == 3
            # Every chunk after the first token is one round: tokens = rounds' lengths.
            assert s.num_rounds == len(chunks) - 1
            assert s.mean_acceptance_length * s.num_rounds == pytest.approx(len(tokens) - 1)
            assert 1.0 <= s.mean_acceptance_length <= 4.0
            assert all(a >= b for a, b in zip(s.per_position, s.per_position[1:]))
        (info,) = d.workers()
        assert info.speculative and d.stats().spec is not None
        _wait_free(d, engine)
        assert not engine.seeds
    finally:
        run(d.close())


@pytest.mark.timeout(60)
def test_unexpected_add_request_error_fails_one_request_only(model):
    engine = _engine(model)
    d = ColocatedDispatcher.from_engine(engine)
    real_add = engine.add_request

    def add(prompt_ids, params, req_id=None):
        if req_id == "bad":
            raise RuntimeError("boom")
        return real_add(prompt_ids, params, req_id)

    engine.add_request = add

    async def main():
        with pytest.raises(RequestRejected, match="boom"):
            await _tokens(d, _req("bad", [1, 2], 3))
        tokens, _ = await _tokens(d, _req("good", [1, 2], 3))
        assert len(tokens) == 3

    try:
        run(main())
        assert d.workers()[0].healthy
        _wait_free(d, engine)
    finally:
        run(d.close())


@pytest.mark.timeout(60)
def test_the_last_chunk_carries_the_time_queued_in_the_engine(model):
    """Colocated mode queues in the engine: a request that waited for the only running slot
    reports that wait (queue_s, what the router's queue-time metric observes)."""
    engine = _engine(model, max_num_seqs=1)
    d = ColocatedDispatcher.from_engine(engine)

    async def main():
        return await asyncio.gather(_tokens(d, _req("a", [1, 2, 3], 12)),
                                    _tokens(d, _req("b", [4, 5, 6], 12)))

    try:
        (_, first), (_, second) = run(main())
        waits = {c[-1].request_id: c[-1].queue_s for c in (first, second)}
        assert all(w is not None and w >= 0 for w in waits.values())
        assert all(c.queue_s is None for c in first[:-1] + second[:-1])  # last chunk only
        # One of them ran first; the other waited for its 12 tokens.
        assert max(waits.values()) > min(waits.values())
        _wait_free(d, engine)
    finally:
        run(d.close())
