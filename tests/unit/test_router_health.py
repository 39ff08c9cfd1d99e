"""The router's worker health table (the disaggregated dispatcher's poll): a worker whose
answers come late stays up (they still count as heard); one heard from by nothing for
DOWN_AFTER_S is marked down (frozen); a failing call (dead actor) marks it down at once; a good
answer brings it back."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from tandem.messages import WorkerHealth
from tandem.router import worker_health
from tandem.router.worker_health import WorkerHealthTable


class FakeHandle:
    """What the poll uses of a Ray actor handle: `health.remote()` -> something to await."""

    def __init__(self) -> None:
        self.mode = "ok"
        self.health = SimpleNamespace(remote=self._remote)

    def _remote(self):
        return self._answer()

    async def _answer(self):
        if self.mode == "hang":
            await asyncio.sleep(3600)
        if self.mode == "slow":
            await asyncio.sleep(0.05)
        if self.mode == "dead":
            raise RuntimeError("actor died")
        return WorkerHealth(name="prefill-0", role="prefill", healthy=True, error="", node="n0",
                            num_running=0, num_waiting=0, num_free_pages=10, num_pages=10)


@pytest.fixture
def fast_polls(monkeypatch):
    monkeypatch.setattr(worker_health, "HEALTH_TIMEOUT_S", 0.02)
    monkeypatch.setattr(worker_health, "DOWN_AFTER_S", 0.3)


def test_late_answers_keep_a_worker_up_silence_and_failures_do_not(fast_polls):
    handle = FakeHandle()
    table = WorkerHealthTable({"prefill-0": handle}, {}, {}, "m", lambda name: 0.0)

    def healthy() -> bool:
        return table.get("prefill-0").healthy

    async def scenario():
        await table.check("prefill-0")
        assert healthy()
        handle.mode = "slow"  # every answer 2.5x later than a poll waits: still heard
        for _ in range(12):
            await table.check("prefill-0")
            await asyncio.sleep(0.02)
            assert healthy()
        await asyncio.sleep(0.06)  # the last slow answer lands
        handle.mode = "hang"  # frozen: nothing is heard any more
        await table.check("prefill-0")
        assert healthy()  # not silent long enough yet
        await asyncio.sleep(0.4)
        await table.check("prefill-0")
        assert not healthy()
        assert "nothing heard from it" in table.get("prefill-0").error
        table._workers["prefill-0"].asking.cancel()  # the frozen call (SIGCONT would answer it)
        await asyncio.sleep(0.01)
        handle.mode = "ok"
        await table.check("prefill-0")
        assert healthy()
        handle.mode = "dead"
        await table.check("prefill-0")
        assert not healthy()

    asyncio.run(scenario())
