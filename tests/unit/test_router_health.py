"""The disaggregated dispatcher's health poll: a worker that answers late once keeps its last
report; SLOW_POLLS_DOWN late answers in a row mark it down; a failing call (dead actor) marks it
down at once; a good answer brings it back."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from tandem.router import disagg
from tandem.router.disagg import DisaggregatedDispatcher
from tandem.router.dispatch import ModelInfo


class FakeHandle:
    """What `_check` uses of a Ray actor handle: `health.remote()` -> something to await."""

    def __init__(self) -> None:
        self.mode = "ok"
        self.health = SimpleNamespace(remote=self._remote)

    def _remote(self):
        return self._answer()

    async def _answer(self):
        if self.mode == "hang":
            await asyncio.sleep(3600)
        if self.mode == "dead":
            raise RuntimeError("actor died")
        return SimpleNamespace(healthy=True, error="", node="n0", num_running=0, num_waiting=0,
                               num_free_pages=10, num_pages=10)


@pytest.fixture
def fast_polls(monkeypatch):
    monkeypatch.setattr(disagg, "HEALTH_TIMEOUT_S", 0.02)


def test_late_answers_are_tolerated_until_a_run_of_them_and_failures_are_not(fast_polls):
    handle = FakeHandle()
    disp = DisaggregatedDispatcher({"prefill-0": handle}, {}, {},
                                   ModelInfo(name="m", vocab_size=10, max_model_len=64,
                                             max_request_tokens=64), num_steps=1)

    def healthy() -> bool:  # the report (disp.workers() would also start the poller)
        return disp._health["prefill-0"].healthy

    async def scenario():
        await disp._check("prefill-0", handle)
        assert healthy()
        handle.mode = "hang"
        for _ in range(disagg.SLOW_POLLS_DOWN - 1):
            await disp._check("prefill-0", handle)
            assert healthy()  # late, not dead: the last report stands
        await disp._check("prefill-0", handle)
        assert not healthy()
        assert "polls in a row" in disp._health["prefill-0"].error
        handle.mode = "ok"
        await disp._check("prefill-0", handle)
        assert healthy()
        handle.mode = "hang"  # the count starts over after a good answer
        await disp._check("prefill-0", handle)
        assert healthy()
        handle.mode = "dead"
        await disp._check("prefill-0", handle)
        assert not healthy()

    asyncio.run(scenario())
