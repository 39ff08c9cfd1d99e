"""The SPMD machinery of a TP worker, in one process: two prefill "ranks" and two decode "ranks"
(full replicas on threads, joined by a barrier-based RankSync, each pair driven by GroupLoops,
KV over the fake backend rank to rank). Prefill rank 1 breaks about half of its transfers while
rank 0's all land, so the ranks see different transfer events: a request must be admitted only
when its KV landed on every rank (and then equal the colocated output), fail with an error when
one rank failed, and every rank must end with the same, complete page pool and slot list."""

from __future__ import annotations

import queue
import random
import threading
import time

import pytest

from disagg_helpers import tiny_model_and_head, worker_config
from tandem.decode_node.worker import DecodeWorker
from tandem.engine import SamplingParams
from tandem.kvtransfer import FailureInjection, FaultKind
from tandem.messages import Connect, GetEndpoint, PerRank, ReserveRoom, SubmitPrompt
from tandem.prefill_node.worker import PrefillWorker
from tandem.spec import SpecConfig, SpecEngine
from tandem.worker import GroupLoop

pytestmark = pytest.mark.timeout(120)


class ThreadSync:
    """RankSync among threads of one process (a barrier around a shared list)."""

    def __init__(self, rank: int, shared: dict) -> None:
        self.rank, self.size, self._s = rank, len(shared["slots"]), shared

    def all_gather(self, obj):
        slots, barrier = self._s["slots"], self._s["barrier"]
        slots[self.rank] = obj
        barrier.wait(timeout=30)
        out = list(slots)
        barrier.wait(timeout=30)
        return out

    def broadcast(self, obj):
        return self.all_gather(obj)[0]


def syncs(size: int = 2) -> list[ThreadSync]:
    shared = {"slots": [None] * size, "barrier": threading.Barrier(size)}
    return [ThreadSync(r, shared) for r in range(size)]


def test_ranks_agree_on_asymmetric_transfer_failures(tmp_path):
    model_dir, head_dir = tiny_model_and_head(tmp_path)
    spec = SpecConfig(num_steps=3)
    rng = random.Random(5)
    prompts = [[rng.randrange(256) for _ in range(rng.randint(2, 20))] for _ in range(8)]
    params = [SamplingParams(max_new_tokens=rng.randint(2, 10), ignore_eos=True)
              for _ in prompts]
    colocated = SpecEngine.from_config(
        worker_config("c", model_dir, head_dir, "fake", spec).engine,
        SpecConfig(draft_model=str(head_dir), num_steps=3)).generate(prompts, params)

    broken = FailureInjection(probability=0.5, kind=FaultKind.FAIL_TRANSFER, seed=3)
    psync, dsync = syncs(), syncs()
    prefill = [PrefillWorker(worker_config(f"p{r}", model_dir, head_dir, "fake", spec,
                                           faults=broken if r == 1 else None), None, psync[r])
               for r in range(2)]
    decode = [DecodeWorker(worker_config(f"d{r}", model_dir, head_dir, "fake", spec), None,
                           dsync[r]) for r in range(2)]
    events: queue.Queue = queue.Queue()
    ploops = [GroupLoop(prefill[r], psync[r],
                        (lambda outs: [events.put(("p", o)) for o in outs]) if r == 0 else None)
              for r in range(2)]
    dloops = [GroupLoop(decode[r], dsync[r],
                        (lambda outs: [events.put(("d", o)) for o in outs]) if r == 0 else None)
              for r in range(2)]
    try:
        ploops[0].call(Connect(endpoints=PerRank(tuple(dloops[0].call(GetEndpoint())))))
        for i, (p, sp) in enumerate(zip(prompts, params)):
            dests = dloops[0].call(ReserveRoom(room=500 + i, prompt_ids=tuple(p), params=sp))
            ploops[0].call(SubmitPrompt(room=500 + i, prompt_ids=tuple(p), params=sp,
                                        destinations=PerRank(tuple(dests))))
        tokens = {500 + i: [] for i in range(len(prompts))}
        prefill_ok: dict[int, bool] = {}
        errors: set[int] = set()
        finished: set[int] = set()
        while len(finished | errors) < len(prompts) or len(prefill_ok) < len(prompts):
            side, o = events.get(timeout=60)
            if side == "p":
                prefill_ok[o.room] = o.ok
                continue
            if o.finish_reason == "error":
                errors.add(o.room)
                continue
            tokens[o.room].extend(o.token_ids)
            if o.finished:
                finished.add(o.room)
        assert errors and finished, "the fault seed must break some transfers and not others"
        assert errors == {room for room, ok in prefill_ok.items() if not ok}
        for i, c in enumerate(colocated):
            if 500 + i in finished:
                assert tuple(tokens[500 + i]) == c.output_ids
        # Every page and slot back, on every rank, in the same order (the next schedule
        # depends on it).
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and any(
                w.allocator.num_free != w.allocator.num_usable
                for w in [*(x.engine for x in prefill), *(x.engine for x in decode)]):
            time.sleep(0.05)
        for workers in (prefill, decode):
            assert all(w.engine.allocator.num_free == w.engine.allocator.num_usable
                       for w in workers)
        assert decode[0]._free_slots == decode[1]._free_slots
        assert sorted(decode[0]._free_slots) == list(range(decode[0].cfg.aux_slots))
        assert all(loop.error is None for loop in [*ploops, *dloops])
    finally:
        ploops[0].close()
        dloops[0].close()
        for loop in (ploops[1], dloops[1]):
            assert loop.wait_stopped(10)  # rank 0's close stopped the follower too
        for w in [*prefill, *decode]:
            w.close()
