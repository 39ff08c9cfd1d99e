"""A decode worker grants pages to a KV transfer, which writes them outside the stream's order.
Pages a step freed may still be written by GPU work the step queued after its host read
(draft-extend, drafting and verifying ahead: spec/ahead.py), so once pages were freed,
`reserve` waits for the device's queued work (`settle`) before it takes pages from the
allocator -- never after."""

from __future__ import annotations

import pytest
from spec_helpers import one_thread  # noqa: F401 (autouse fixture)

import tandem.decode_node.worker as worker_mod
from tandem.engine import SamplingParams


@pytest.mark.timeout(120)
def test_reserve_settles_the_device_before_it_takes_pages(tmp_path, monkeypatch):
    from disagg_helpers import tiny_model_and_head, worker_config

    model_dir, head_dir = tiny_model_and_head(tmp_path)
    decode = worker_mod.DecodeWorker(worker_config("d", model_dir, head_dir, "fake"))
    try:
        events: list[str] = []
        monkeypatch.setattr(worker_mod, "settle", lambda device: events.append("settle"))
        alloc = decode.engine.allocator
        real = alloc.alloc
        monkeypatch.setattr(alloc, "alloc", lambda n: events.append("alloc") or real(n))
        params = SamplingParams(max_new_tokens=4)
        free = alloc.num_free
        assert decode.reserve(7, [5, 6, 7, 8], params) is not None and alloc.num_free < free
        assert events == ["alloc"]  # nothing was ever freed: nothing to wait for
        alloc.free(alloc.alloc(2))  # pages a step freed (as a finished request's are)
        events.clear()
        assert decode.reserve(8, [5, 6, 7, 8], params) is not None
        assert events == ["settle", "alloc"]  # the device's queued work first
        events.clear()
        assert decode.reserve(9, [5, 6, 7, 8], params) is not None
        assert events == ["alloc"]  # no page freed since the last settle
        for room in (7, 8, 9):
            decode.abort(room)
    finally:
        decode.close()


def test_settle_waits_on_cuda_only():
    """On the CPU nothing is queued: settle returns at once (it must not touch torch.cuda)."""
    import torch

    worker_mod.settle(torch.device("cpu"))
