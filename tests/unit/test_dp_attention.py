"""DP attention over gloo: 2 ranks, each owning its own requests and KV pages for attention, the
MLP/MoE run across both ranks on the gathered tokens -- every request's greedy tokens equal a
single rank running all requests (float32), dense and MoE (experts over the DP ranks, or
columns). Ranks with uneven work, and a rank with no requests at all, keep joining the
collectives with empty batches: nothing deadlocks (a hang fails the queue timeout)."""

from __future__ import annotations

import random

import pytest
import torch

from hf_tiny import save_tiny
from rank_helpers import run_ranks
from tandem.engine import EngineConfig, LLMEngine, ParallelContext, ParallelGroup, SamplingParams

pytestmark = pytest.mark.timeout(150)

# (architecture, experts over the DP ranks?)
MODELS = (("llama", False), ("mixtral", True), ("qwen3_moe", False))


def _requests():
    rng = random.Random(7)
    prompts = [[rng.randrange(256) for _ in range(rng.randint(2, 20))] for _ in range(5)]
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in (14, 3, 9, 1, 12)]
    return prompts, params


# Which DP rank owns each request, per scenario: uneven, and rank 1 idle throughout.
ASSIGNMENTS = ((0, 1, 0, 1, 0), (0, 0, 0, 0, 0))


def _engine(model_dir: str, par: ParallelContext | None = None) -> LLMEngine:
    return LLMEngine.from_config(EngineConfig(model=model_dir, dtype="float32", num_pages=96,
                                              page_size=4, max_num_batched_tokens=16), par)


def _dp_worker(rank: int, port: int, model_dirs: list[str], out) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    group = ParallelGroup(rank=rank, size=2, handle=dist.group.WORLD)
    prompts, params = _requests()
    results = []
    for (arch, ep), model_dir in zip(MODELS, model_dirs):
        par = ParallelContext(dp=group, ep=group if ep else ParallelGroup())
        eng = _engine(model_dir, par)
        for owner in ASSIGNMENTS:
            mine = [i for i, r in enumerate(owner) if r == rank]
            got = eng.generate([prompts[i] for i in mine], [params[i] for i in mine])
            results.append({i: c.output_ids for i, c in zip(mine, got)})
            assert eng.allocator.num_free == eng.allocator.num_usable  # no page kept
    out.put((rank, results))
    dist.destroy_process_group()


def test_dp_attention_two_ranks_equal_one(tmp_path):
    torch.set_num_threads(1)
    model_dirs = [str(save_tiny(arch, tmp_path)[0]) for arch, _ in MODELS]
    prompts, params = _requests()
    reference = [[c.output_ids for c in _engine(d).generate(prompts, params)] for d in model_dirs]

    reports, exitcodes = run_ranks(_dp_worker, 2, model_dirs, timeout_s=120)
    per_rank = dict(reports)
    assert all(code == 0 for code in exitcodes)

    k = 0
    for (arch, _), ref in zip(MODELS, reference):
        for owner in ASSIGNMENTS:
            merged = {**per_rank[0][k], **per_rank[1][k]}
            assert sorted(merged) == list(range(len(prompts)))
            for i, r in enumerate(owner):
                assert i in per_rank[r][k]  # each request ran on the rank it was assigned to
            assert [merged[i] for i in range(len(prompts))] == ref, (arch, owner)
            k += 1


def test_dp_rows_round_trip_single_rank():
    """all_gather_rows/counts are the identity on one rank (the engine's default path)."""
    g = ParallelGroup()
    x = torch.randn(3, 4)
    assert g.all_gather_counts(3, x.device) == (3,)
    assert g.all_gather_rows(x, (3,)) is x
