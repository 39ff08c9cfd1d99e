"""`leave_group` never blocks a worker's shutdown for long: NCCL's teardown hangs on a
communicator captured in CUDA graphs (pytorch#115388), so it is bounded."""

from __future__ import annotations

import threading

import torch.distributed as dist

from tandem.worker.ranks import leave_group


def test_a_hanging_teardown_is_left_behind_after_the_timeout(monkeypatch):
    release = threading.Event()
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "destroy_process_group", lambda: release.wait(30))
    try:
        assert leave_group(timeout_s=0.2) is False
    finally:
        release.set()


def test_a_teardown_that_finishes_is_waited_for(monkeypatch):
    calls = []
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "destroy_process_group", lambda: calls.append(1))
    assert leave_group(timeout_s=5.0) is True and calls == [1]
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    assert leave_group() is True and calls == [1]  # no group: nothing to do
