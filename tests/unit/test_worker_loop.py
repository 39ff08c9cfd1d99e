"""WorkerLoop: calls run on the loop thread between steps, are never starved by a busy worker,
wake an idle loop at once, and fail cleanly once the loop stopped."""

from __future__ import annotations

import threading
import time

import pytest

from tandem.worker import WorkerLoop


class Stepper:
    def __init__(self, busy: bool, step_s: float = 0.0, fail_at: int | None = None) -> None:
        self.steps = 0
        self._busy, self._step_s, self._fail_at = busy, step_s, fail_at
        self.threads: set[str] = set()

    def step(self) -> list[int]:
        self.threads.add(threading.current_thread().name)
        self.steps += 1
        if self._fail_at is not None and self.steps >= self._fail_at:
            raise RuntimeError("step blew up")
        if self._step_s:
            time.sleep(self._step_s)
        return []

    def busy(self) -> bool:
        return self._busy

    def where(self) -> tuple[str, int]:
        return threading.current_thread().name, self.steps


def test_calls_run_on_the_loop_thread_between_steps_even_when_always_busy():
    """A worker that is always busy used to starve callers (the stepping thread re-took the
    lock at once); now every call is applied before the next step."""
    w = Stepper(busy=True, step_s=0.002)
    loop = WorkerLoop(w, lambda outs: None, name="t-loop")
    try:
        seen = []
        for _ in range(20):
            before = w.steps
            name, at = loop.call(w.where)
            seen.append(at - before)
            assert name == "t-loop"
        assert max(seen) <= 2, seen  # applied within the step in flight and the next one
        assert w.threads == {"t-loop"}
    finally:
        loop.close()


def test_a_call_wakes_an_idle_loop_at_once():
    w = Stepper(busy=False)
    loop = WorkerLoop(w, lambda outs: None, idle_sleep_s=60.0)  # would otherwise sleep a minute
    try:
        time.sleep(0.05)
        t0 = time.monotonic()
        assert loop.call(w.where)[0] != threading.current_thread().name
        assert time.monotonic() - t0 < 10.0
    finally:
        loop.close()


def test_a_raising_call_reaches_its_caller_and_the_loop_goes_on():
    w = Stepper(busy=False)
    loop = WorkerLoop(w, lambda outs: None, idle_sleep_s=0.001)

    def bad():
        raise ValueError("room: nope")

    try:
        with pytest.raises(ValueError, match="room: nope"):
            loop.call(bad)
        assert loop.call(lambda: 7) == 7
    finally:
        loop.close()


def test_after_a_crashed_step_calls_fail_and_nothing_hangs():
    w = Stepper(busy=True, fail_at=3)
    loop = WorkerLoop(w, lambda outs: None)
    deadline = time.monotonic() + 10
    while loop.error is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert isinstance(loop.error, RuntimeError)
    with pytest.raises(RuntimeError, match="stopped after an error"):
        loop.call(w.where)
    loop.close()


def test_close_fails_calls_still_queued():
    w = Stepper(busy=True, step_s=0.2)
    loop = WorkerLoop(w, lambda outs: None)
    time.sleep(0.05)  # a step is in flight
    futs = [loop.submit(w.where) for _ in range(3)]
    loop.close()
    for f in futs:  # each either ran before the stop or was failed by it: none hangs
        try:
            f.result(timeout=5)
        except RuntimeError as exc:
            assert "stopped" in str(exc)
    with pytest.raises(RuntimeError):
        loop.submit(w.where)
