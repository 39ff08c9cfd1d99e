"""DESIGN.md §3 "No leaks", on the router's side: however a request ends -- finished, aborted,
its consumer cancelled, past its deadline, its worker failed -- the router keeps nothing of it:
it leaves the table of requests in flight (its id can be used again), and the load it put on its
workers (`WorkerState.num_assigned`, what placement policies read) is taken off again. A
forgotten release would make a worker look busy forever and starve it of requests."""

from __future__ import annotations

import asyncio
from contextlib import aclosing

import pytest

from tandem.router import Code, Router, RouterError, SamplingInput
from tests.unit.test_router_lifecycle import FakeDispatcher, _inp, run


def _assert_holds_nothing(router: Router, d: FakeDispatcher) -> None:
    assert router.stats().num_in_flight == 0
    assert [w.num_assigned for w in router.workers()] == [0]
    assert not d.live  # the dispatcher's stream was closed


async def _finish(router: Router) -> None:
    async for _ in router.generate(_inp(request_id="x")):
        pass


async def _abort(router: Router) -> None:
    async for _ in router.generate(_inp(request_id="x", sampling=SamplingInput(max_tokens=40))):
        assert await router.abort("x") is True


async def _cancel(router: Router) -> None:
    async def consume():
        async with aclosing(router.generate(_inp(request_id="x", sampling=SamplingInput(
                max_tokens=40)))) as outs:
            async for _ in outs:
                pass

    task = asyncio.create_task(consume())
    await asyncio.sleep(0.1)
    assert router.stats().num_in_flight == 1  # it was in flight when cancelled
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def _deadline(router: Router) -> None:
    with pytest.raises(RouterError) as e:
        async for _ in router.generate(_inp(request_id="x", sampling=SamplingInput(
                max_tokens=40)), timeout_s=0.15):
            pass
    assert e.value.code is Code.DEADLINE_EXCEEDED


async def _worker_fails(router: Router) -> None:
    with pytest.raises(RouterError) as e:
        async for _ in router.generate(_inp(request_id="x")):
            pass
    assert e.value.code is Code.UNAVAILABLE


@pytest.mark.timeout(30)
@pytest.mark.parametrize("end", [_finish, _abort, _cancel, _deadline, _worker_fails],
                         ids=["finished", "aborted", "cancelled", "deadline", "worker_failed"])
def test_router_keeps_nothing_of_an_ended_request(end):
    async def main():
        d = FakeDispatcher(num_tokens=40, delay_s=0.03,
                           fail_after=1 if end is _worker_fails else None)
        router = Router(d, {"m": None})
        await end(router)
        _assert_holds_nothing(router, d)
        assert await router.abort("x") is False  # its id is in the table no more
    run(main())
