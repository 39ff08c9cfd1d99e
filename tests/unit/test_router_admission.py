"""`Admission`: at most max_running at once, a FIFO queue of max_queued, RESOURCE_EXHAUSTED at
once beyond it, the deadline while queued, and slots handed over in arrival order."""

from __future__ import annotations

import asyncio
import time

import pytest

from tandem.router.admission import Admission, AdmissionConfig
from tandem.router.dispatch import CapacityExceeded, DeadlineExceeded


def test_bounds_queue_fifo_and_refusal():
    async def scenario():
        adm = Admission(AdmissionConfig(max_running=2, max_queued=2))
        order: list[int] = []
        release = asyncio.Event()

        async def request(i: int):
            async with adm.slot(f"r{i}", None):
                order.append(i)
                await release.wait()

        tasks = [asyncio.ensure_future(request(i)) for i in range(4)]
        await asyncio.sleep(0.01)
        assert order == [0, 1] and adm.num_running == 2 and adm.num_queued == 2
        with pytest.raises(CapacityExceeded, match="queue: 2 requests running and 2 waiting"):
            async with adm.slot("r9", None):
                pass
        release.set()
        await asyncio.gather(*tasks)
        assert order == [0, 1, 2, 3]  # the queued ones in arrival order
        assert adm.num_running == 0 and adm.num_queued == 0

    asyncio.run(scenario())


def test_deadline_while_queued_and_a_cancelled_waiter_gives_its_slot_on():
    async def scenario():
        adm = Admission(AdmissionConfig(max_running=1, max_queued=4))
        hold = asyncio.Event()

        async def holder():
            async with adm.slot("h", None):
                await hold.wait()

        h = asyncio.ensure_future(holder())
        await asyncio.sleep(0.01)
        with pytest.raises(DeadlineExceeded, match="while queued"):
            async with adm.slot("late", time.time() + 0.05):
                pass
        assert not adm._waiters  # a waiter that left is out of the queue at once
        cancelled = asyncio.ensure_future(adm.slot("c", None).__aenter__())
        await asyncio.sleep(0.01)
        cancelled.cancel()
        await asyncio.sleep(0)
        assert not adm._waiters
        got: list[str] = []

        async def waiter():
            async with adm.slot("w", None):
                got.append("w")

        w = asyncio.ensure_future(waiter())
        await asyncio.sleep(0.01)
        hold.set()
        await asyncio.gather(h, w)
        assert got == ["w"] and adm.num_running == 0

    asyncio.run(scenario())


def test_wait_for_capacity_wakes_when_a_request_ends():
    async def scenario():
        adm = Admission(AdmissionConfig(max_running=4, max_queued=4))
        done = asyncio.Event()

        async def short():
            async with adm.slot("s", None):
                await done.wait()

        s = asyncio.ensure_future(short())
        await asyncio.sleep(0.01)
        t0 = time.monotonic()
        waiting = asyncio.ensure_future(adm.wait_for_capacity("x", None, max_wait_s=5.0))
        await asyncio.sleep(0.02)
        done.set()
        await waiting
        assert time.monotonic() - t0 < 1.0  # woken by the end, not by max_wait_s
        await s
        with pytest.raises(DeadlineExceeded):
            await adm.wait_for_capacity("y", time.time() - 1)

    asyncio.run(scenario())


def test_a_request_end_wakes_only_the_oldest_page_waiter():
    async def scenario():
        adm = Admission(AdmissionConfig(max_running=8, max_queued=8))
        ends = [asyncio.Event() for _ in range(2)]

        async def running(i: int):
            async with adm.slot(f"run{i}", None):
                await ends[i].wait()

        runs = [asyncio.ensure_future(running(i)) for i in range(2)]
        await asyncio.sleep(0.01)
        woken: list[str] = []

        async def waiter(name: str):
            await adm.wait_for_capacity(name, None, max_wait_s=5.0)
            woken.append(name)

        waiters = [asyncio.ensure_future(waiter(n)) for n in ("a", "b", "c")]
        await asyncio.sleep(0.01)
        ends[0].set()
        await asyncio.sleep(0.05)
        assert woken == ["a"]  # one end, one turn, oldest first
        ends[1].set()
        await asyncio.sleep(0.05)
        assert woken == ["a", "b"]
        for w in waiters:
            w.cancel()
        await asyncio.gather(*runs, *waiters, return_exceptions=True)

    asyncio.run(scenario())
