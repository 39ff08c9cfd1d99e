"""DP attention under EAGLE speculation, at engine level: two SpecEngine ranks over gloo, each
owning its own requests, pages and seeds, with the target's MLP over the gathered tokens. A round
is k draft steps (replicated head, no collectives), one verify forward (collectives) and the
draft-extend; the ranks agree per phase whether any of them runs a target forward and an idle
rank joins with an empty one. Greedy float32: every request equals the single-rank SpecEngine
running all of them, with uneven work, requests ending at different rounds, and one rank idle
throughout (a hang fails the queue timeout)."""

from __future__ import annotations

import random

import pytest
import torch
from disagg_helpers import tiny_model_and_head
from rank_helpers import run_ranks

from tandem.engine import EngineConfig, ParallelContext, ParallelGroup, SamplingParams
from tandem.spec import SpecConfig, SpecEngine

pytestmark = pytest.mark.timeout(120)

# Which DP rank owns each request, per scenario: uneven lengths on both ranks; rank 1 idle.
ASSIGNMENTS = ((0, 1, 1, 0, 1), (0, 0, 0, 0, 0))


def _requests():
    rng = random.Random(11)
    prompts = [[rng.randrange(256) for _ in range(rng.randint(2, 20))] for _ in range(5)]
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in (13, 2, 9, 1, 17)]
    return prompts, params


def _engine(dirs, par: ParallelContext | None = None) -> SpecEngine:
    model_dir, head_dir = dirs
    return SpecEngine.from_config(
        EngineConfig(model=str(model_dir), dtype="float32", num_pages=96, page_size=4),
        SpecConfig(draft_model=str(head_dir), num_steps=3), par)


def _rank(rank: int, port: int, dirs, out) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    eng = _engine(dirs, ParallelContext(dp=ParallelGroup(rank=rank, size=2,
                                                         handle=dist.group.WORLD)))
    prompts, params = _requests()
    results = []
    for owner in ASSIGNMENTS:
        mine = [i for i, r in enumerate(owner) if r == rank]
        got = eng.generate([prompts[i] for i in mine], [params[i] for i in mine])
        results.append({i: c.output_ids for i, c in zip(mine, got)})
        assert eng.allocator.num_free == eng.allocator.num_usable  # no page kept
        assert not eng.seeds
    out.put((rank, results, eng.spec_stats.num_rounds))
    dist.destroy_process_group()


def test_dp2_speculative_equals_one_rank(tmp_path):
    torch.set_num_threads(1)
    dirs = tiny_model_and_head(tmp_path)
    prompts, params = _requests()
    reference = [c.output_ids for c in _engine(dirs).generate(prompts, params)]

    reports, exitcodes = run_ranks(_rank, 2, dirs, timeout_s=90)
    per_rank = {r: (res, rounds) for r, res, rounds in reports}
    assert all(code == 0 for code in exitcodes)
    assert all(rounds > 0 for _, rounds in per_rank.values())  # both ranks ran spec rounds
    for k, owner in enumerate(ASSIGNMENTS):
        merged = {**per_rank[0][0][k], **per_rank[1][0][k]}
        for i, r in enumerate(owner):
            assert i in per_rank[r][0][k]
        assert [merged[i] for i in range(len(prompts))] == reference, owner
