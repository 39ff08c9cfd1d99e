"""Overlap scheduling under TP (engine/overlap.py): 2 gloo ranks of a TP=2 plain engine, each
launching step n+1 before reading step n (pending tokens fed from the device, the same on every
rank), give the single-rank engine's greedy tokens in float32 -- with stops, a length limit and
a request aborted while a step is in flight -- and every page back on both ranks."""

from __future__ import annotations

import random

import pytest
import torch

from hf_tiny import save_tiny
from rank_helpers import run_ranks
from tandem.engine import EngineConfig, LLMEngine, ParallelContext, SamplingParams

pytestmark = pytest.mark.timeout(180)


def _engine(model_dir, par: ParallelContext | None = None, overlap: bool = False) -> LLMEngine:
    return LLMEngine.from_config(EngineConfig(model=str(model_dir), dtype="float32",
                                              num_pages=64, page_size=4,
                                              max_num_batched_tokens=16,
                                              overlap_schedule=overlap), par)


def _requests():
    rng = random.Random(3)
    prompts = [[rng.randrange(256) for _ in range(rng.randint(2, 14))] for _ in range(4)]
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in (9, 1, 6, 12)]
    return prompts, params


def _run(eng: LLMEngine) -> tuple[list, list[int]]:
    """Greedy tokens of the 4 requests, then a 5th aborted while a step is in flight."""
    prompts, params = _requests()
    done = [c.output_ids for c in eng.generate(prompts, params)]
    rid = eng.add_request(prompts[0], SamplingParams(max_new_tokens=30, ignore_eos=True))
    got: list[int] = []
    for _ in range(4):
        got += [t for o in eng.step() for t in o.new_token_ids]
    eng.abort(rid)
    while eng.has_unfinished():
        got += [t for o in eng.step() for t in o.new_token_ids]
    assert eng.allocator.num_free == eng.allocator.num_usable
    return done, got


def _rank(rank: int, port: int, model_dir, out) -> None:
    from tandem.worker.ranks import RankInfo, join_group, leave_group

    torch.set_num_threads(1)
    par, _ = join_group(RankInfo(rank=rank, tp=2), "127.0.0.1", port, "cpu")
    eng = _engine(model_dir, par, overlap=True)
    assert eng.overlap
    out.put((rank, _run(eng)))
    leave_group()


def test_tp2_overlap_equals_one_rank_without_overlap(tmp_path):
    torch.set_num_threads(1)
    model_dir = save_tiny("llama", tmp_path)[0]
    want_done, want_aborted = _run(_engine(model_dir))
    items, codes = run_ranks(_rank, 2, model_dir, timeout_s=150)
    assert codes == [0, 0]
    for _, (done, aborted) in items:
        assert done == want_done
        # 4 calls before the abort: the synchronous engine read 4 tokens, the overlapped one 3
        # (its reads lag a step); the token in flight at the abort is dropped.
        assert len(want_aborted) == 4 and aborted == want_aborted[:3]
