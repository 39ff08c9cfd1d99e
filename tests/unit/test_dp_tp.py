"""DP attention with TP inside each DP rank, at engine level: 4 gloo ranks joined as a worker of
dp 2 x tp 2 (worker/ranks.py `join_group`), each DP rank owning its own requests with its
attention heads, vocabulary and KV pages split over its two TP ranks, and the MLP over all four
ranks on the tokens gathered from the DP ranks. Greedy float32: every request equals the
single-rank engine running all of them, plain (dense, and MoE with experts over the four ranks)
and speculative, with uneven work and one DP rank idle throughout (a hang fails the queue
timeout)."""

from __future__ import annotations

import random

import pytest
import torch
from disagg_helpers import tiny_model_and_head

from hf_tiny import save_tiny
from rank_helpers import run_ranks
from tandem.engine import EngineConfig, LLMEngine, ParallelContext, SamplingParams
from tandem.spec import SpecConfig, SpecEngine

pytestmark = pytest.mark.timeout(240)

DP, TP = 2, 2
# Which DP rank owns each request, per scenario: uneven on both DP ranks; DP rank 1 idle.
ASSIGNMENTS = ((0, 1, 1, 0), (0, 0, 0, 0))


def _requests():
    rng = random.Random(5)
    prompts = [[rng.randrange(256) for _ in range(rng.randint(2, 14))] for _ in range(4)]
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in (9, 2, 6, 1)]
    return prompts, params


def _plain(model_dir, par: ParallelContext | None = None) -> LLMEngine:
    return LLMEngine.from_config(EngineConfig(model=str(model_dir), dtype="float32",
                                              num_pages=64, page_size=4,
                                              max_num_batched_tokens=16), par)


def _spec(dirs, par: ParallelContext | None = None) -> SpecEngine:
    model_dir, head_dir = dirs
    return SpecEngine.from_config(
        EngineConfig(model=str(model_dir), dtype="float32", num_pages=64, page_size=4),
        SpecConfig(draft_model=str(head_dir), num_steps=3), par)


def _run(eng, rank_dp: int, prompts, params) -> list[dict[int, list[int]]]:
    results = []
    for owner in ASSIGNMENTS:
        mine = [i for i, r in enumerate(owner) if r == rank_dp]
        got = eng.generate([prompts[i] for i in mine], [params[i] for i in mine])
        results.append({i: c.output_ids for i, c in zip(mine, got)})
        assert eng.allocator.num_free == eng.allocator.num_usable  # no page kept
    return results


def _rank(rank: int, port: int, moe_dir, dirs, out) -> None:
    from tandem.worker.ranks import RankInfo, join_group, leave_group

    torch.set_num_threads(1)
    par, _ = join_group(RankInfo(rank=rank, tp=TP, dp=DP), "127.0.0.1", port, "cpu")
    assert (par.tp.size, par.dp.size, par.num_dp_ranks) == (TP, DP * TP, DP)
    assert (par.dp_rank, par.tp.rank) == divmod(rank, TP)
    prompts, params = _requests()
    moe_par = ParallelContext(tp=par.tp, dp=par.dp, ep=par.dp)  # experts over all 4 ranks
    outs = {"dense": _run(_plain(dirs[0], par), par.dp_rank, prompts, params),
            "moe": _run(_plain(moe_dir, moe_par), par.dp_rank, prompts, params),
            "spec": _run(_spec(dirs, par), par.dp_rank, prompts, params)}
    out.put((rank, outs))
    leave_group()


def test_dp2_tp2_equals_one_rank(tmp_path):
    torch.set_num_threads(1)
    dirs = tiny_model_and_head(tmp_path)
    moe_dir = save_tiny("mixtral", tmp_path)[0]
    prompts, params = _requests()
    reference = {"dense": [c.output_ids for c in _plain(dirs[0]).generate(prompts, params)],
                 "moe": [c.output_ids for c in _plain(moe_dir).generate(prompts, params)],
                 "spec": [c.output_ids for c in _spec(dirs).generate(prompts, params)]}

    reports, exitcodes = run_ranks(_rank, DP * TP, moe_dir, dirs, timeout_s=200)
    per_rank = dict(reports)
    assert all(code == 0 for code in exitcodes)
    for what, ref in reference.items():
        for k, owner in enumerate(ASSIGNMENTS):
            # The TP ranks of a DP rank agree; each request ran on the DP rank it was given.
            for d in range(DP):
                assert per_rank[d * TP][what][k] == per_rank[d * TP + 1][what][k], what
            merged = {**per_rank[0][what][k], **per_rank[TP][what][k]}
            for i, r in enumerate(owner):
                assert i in per_rank[r * TP][what][k]
            assert [merged[i] for i in range(len(prompts))] == ref, (what, owner)


class _ListSync:
    """A world channel whose all_gather returns a fixed per-rank list (what every rank sees)."""

    def __init__(self, rank: int, objs: list) -> None:
        self.rank, self.size, self._objs = rank, len(objs), objs

    def all_gather(self, obj):
        assert obj == self._objs[self.rank]
        return list(self._objs)

    def broadcast(self, obj):
        return self._objs[0]


def test_split_sync_gives_one_voice_per_dp_rank():
    from tandem.engine import ParallelGroup
    from tandem.worker.ranks import SOLO, DpLeadSync, TorchSync, split_sync

    # World rank 3 = DP rank 1, TP rank 1 of dp 2 x tp 2: the DP channel lists each DP rank's
    # TP lead's object once (ranks 0 and 2), never a TP rank twice.
    objs = ["a", "a", "b", "b"]
    dp = DpLeadSync(_ListSync(3, objs), 2)
    assert (dp.rank, dp.size, dp.all_gather("b")) == (1, 2, ["a", "b"])
    tp = TorchSync(1, 2, None)
    world = TorchSync(3, 4, None, tp_sync=tp)
    par = ParallelContext(tp=ParallelGroup(rank=1, size=2), dp=ParallelGroup(rank=3, size=4))
    got_tp, got_dp = split_sync(world, par)
    assert got_tp is tp and isinstance(got_dp, DpLeadSync) and (got_dp.rank, got_dp.size) == (1, 2)
    # The layouts before DP x TP keep their channels: TP only, DP only.
    assert split_sync(world, ParallelContext(tp=ParallelGroup(rank=1, size=2))) == (world, SOLO)
    assert split_sync(world, ParallelContext(dp=ParallelGroup(rank=1, size=2))) == (SOLO, world)
    with pytest.raises(ValueError, match="sync"):
        split_sync(SOLO, par)


def test_parallel_context_refuses_a_tp_group_off_the_dp_major_layout():
    from tandem.engine import ParallelGroup

    with pytest.raises(ValueError, match="DP-major"):
        ParallelContext(tp=ParallelGroup(rank=0, size=2), dp=ParallelGroup(rank=3, size=4))
    par = ParallelContext(tp=ParallelGroup(rank=1, size=2), dp=ParallelGroup(rank=3, size=4))
    assert (par.num_dp_ranks, par.dp_rank, par.dp_gather_rows(5)) == (2, 1, 0)
    assert par.dp_lead_offset((3, 0, 4, 0)) == 3  # DP rank 1's rows follow DP rank 0's
