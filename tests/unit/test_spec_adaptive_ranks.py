"""Adaptive speculation on a worker of several ranks (TP = 2, gloo, two processes): every rank
steps together (collectives in each forward), so every rank must choose the same k and the
same regime each step -- from one cost table. The ranks profile together when any of them lacks
a cached table (here rank 0 has one, rank 1 not: without the agreement rank 1 would profile
alone and wait forever in its first collective) and take each cost's largest over ranks; the
tables end equal, and greedy output equals one rank's. Served step times (each rank's own)
do not rescale the prices there."""

from __future__ import annotations

import json

import pytest
import torch
from disagg_helpers import tiny_model_and_head
from rank_helpers import run_ranks

from tandem.engine import EngineConfig, ParallelContext, ParallelGroup, SamplingParams
from tandem.spec import SpecConfig, SpecEngine

pytestmark = pytest.mark.timeout(240)

PROMPTS = [[5, 9, 14, 3], [7, 7, 21, 40, 2, 8], [100, 3]]


def _engine(dirs, par: ParallelContext | None = None) -> SpecEngine:
    model_dir, head_dir = dirs
    return SpecEngine.from_config(
        EngineConfig(model=str(model_dir), dtype="float32", num_pages=256, page_size=4),
        SpecConfig(draft_model=str(head_dir), num_steps=2, adaptive=True), par)


def _rank(rank: int, port: int, dirs, cache_root: str, out) -> None:
    import os

    import torch.distributed as dist

    import tandem.spec.cost_profile as cost_profile
    from tandem.spec.adaptive import StepCostTable

    torch.set_num_threads(1)
    os.environ["TANDEM_CACHE"] = f"{cache_root}/rank{rank}"
    os.environ.pop(cost_profile.CACHE_ENV, None)
    if rank == 0:  # rank 0 finds a table of its own; rank 1 has none
        stale = StepCostTable(batch_sizes=(1,), seconds=((9.0, 9.0, 9.0),), plain=(9.0,))
        cost_profile._cached = lambda path, num_steps: stale
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    group = ParallelGroup(rank=rank, size=2, handle=dist.group.WORLD)
    eng = _engine(dirs, ParallelContext(tp=group, ep=group))
    got = eng.generate(PROMPTS, SamplingParams(max_new_tokens=12, ignore_eos=True))
    assert eng.allocator.num_free == eng.allocator.num_usable
    pol = eng.spec_scheduler.policy  # served times are a rank's own: never heard here
    assert pol.plain_scale == pol.round_scale == 1.0
    out.put((rank, pol.table.to_json(), [c.output_ids for c in got]))
    dist.destroy_process_group()


def test_tp_ranks_agree_on_one_cost_table(tmp_path):
    torch.set_num_threads(1)
    dirs = tiny_model_and_head(tmp_path)
    reports, exitcodes = run_ranks(_rank, 2, dirs, str(tmp_path / "cache"), timeout_s=180)
    assert all(code == 0 for code in exitcodes)
    by_rank = {r: (table, outs) for r, table, outs in reports}
    assert by_rank[0][0] == by_rank[1][0]  # one table
    table = json.loads(by_rank[0][0])  # rank 0's cached one gave way: both profiled
    assert max(max(row) for row in table["seconds"]) < 9.0 and len(table["plain"]) > 1
    from tandem.engine import LLMEngine

    model_dir, _ = dirs
    plain = LLMEngine.from_config(EngineConfig(model=str(model_dir), dtype="float32",
                                               num_pages=256, page_size=4))
    want = [c.output_ids for c in plain.generate(
        PROMPTS, SamplingParams(max_new_tokens=12, ignore_eos=True))]
    assert by_rank[0][1] == by_rank[1][1] == want
