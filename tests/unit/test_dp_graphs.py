"""Decode CUDA graphs under DP attention, on the CPU with the graph runner in eager mode (its
body runs at each replay, with the same buffers, bucket padding and DP counts; planned on the
host or, dense, on the device as on CUDA: `DeviceDecodePlanner`): gloo ranks of a
DP 2 worker (and DP 2 x TP 2) decode through `DecodeGraphRunner`, every rank replaying the
bucket the ranks agreed on -- an idle rank over padding rows alone -- with the MLP's gather
counts taken from the bucket (`ParallelContext.static_dp_counts`), not exchanged. Greedy
float32: every request equals the single-rank engine, dense and MoE (all-reduce and padded
all-to-all dispatch), with uneven work and one DP rank idle throughout."""

from __future__ import annotations

import random

import pytest
import torch
from test_spec_graph_padding import _FakePlanner

from hf_tiny import save_tiny
from rank_helpers import run_ranks
from tandem.engine import EngineConfig, LLMEngine, ParallelContext, SamplingParams

pytestmark = pytest.mark.timeout(240)

ASSIGNMENTS = ((0, 1, 1, 0), (0, 0, 0, 0))  # which DP rank owns each request, per scenario
SIZES = (1, 2, 4)


def _requests():
    rng = random.Random(7)
    prompts = [[rng.randrange(256) for _ in range(rng.randint(2, 14))] for _ in range(4)]
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in (9, 2, 6, 1)]
    return prompts, params


def _engine(model_dir, par: ParallelContext | None = None, graphs: bool = True,
            moe_dispatch: str = "allreduce", device_metadata: bool = False) -> LLMEngine:
    from tandem.engine.cuda_graphs import DecodeGraphRunner

    eng = LLMEngine.from_config(EngineConfig(model=str(model_dir), dtype="float32",
                                             num_pages=64, page_size=4,
                                             max_num_batched_tokens=16,
                                             moe_dispatch=moe_dispatch), par)
    if graphs:
        backend = eng.runner.backend
        backend.graph_decode_planner = lambda bs, pages: _FakePlanner(backend, True)
        eng.graphs = DecodeGraphRunner(eng.runner, SIZES, max_pages_per_seq=16,
                                       par=eng.model.par, device_metadata=device_metadata)
        eng.graphs.capture(eager=True)
        runs = eng.graph_runs = []
        run = eng.graphs.run
        eng.graphs.run = lambda batch: runs.append(batch.attn.num_seqs) or run(batch)
    return eng


def _run(eng: LLMEngine, dp_rank: int) -> tuple[list[dict[int, tuple]], list[int]]:
    prompts, params = _requests()
    results = []
    for owner in ASSIGNMENTS:
        mine = [i for i, r in enumerate(owner) if r == dp_rank]
        got = eng.generate([prompts[i] for i in mine], [params[i] for i in mine])
        results.append({i: c.output_ids for i, c in zip(mine, got)})
        assert eng.allocator.num_free == eng.allocator.num_usable  # no page kept
    return results, list(eng.graph_runs)


def _rank(rank: int, port: int, tp: int, dense_dir, moe_dir, out) -> None:
    from tandem.worker.ranks import RankInfo, join_group, leave_group

    torch.set_num_threads(1)
    par, _ = join_group(RankInfo(rank=rank, tp=tp, dp=2), "127.0.0.1", port, "cpu")
    moe_par = ParallelContext(tp=par.tp, dp=par.dp, ep=par.dp)  # experts over every rank
    outs = {"dense": _run(_engine(dense_dir, par), par.dp_rank),
            # planned on the device (DeviceDecodePlanner, the CUDA default)
            "dense-device": _run(_engine(dense_dir, par, device_metadata=True), par.dp_rank),
            "moe-allreduce": _run(_engine(moe_dir, moe_par), par.dp_rank),
            "moe-alltoall-padded": _run(_engine(moe_dir, moe_par,
                                                moe_dispatch="alltoall_padded"), par.dp_rank)}
    out.put((rank, outs))
    leave_group()


@pytest.mark.parametrize("tp", [1, 2])
def test_dp_decode_graphs_equal_one_rank(tmp_path, tp):
    torch.set_num_threads(1)
    dense_dir = save_tiny("llama", tmp_path / "dense")[0]
    moe_dir = save_tiny("mixtral", tmp_path / "moe")[0]
    prompts, params = _requests()
    ref_dense = [c.output_ids for c in _engine(dense_dir, graphs=False).generate(prompts, params)]
    ref_moe = [c.output_ids for c in _engine(moe_dir, graphs=False).generate(prompts, params)]
    reports, codes = run_ranks(_rank, 2 * tp, tp, dense_dir, moe_dir, timeout_s=200)
    assert all(code == 0 for code in codes)
    per_rank = dict(reports)
    for what, ref in (("dense", ref_dense), ("dense-device", ref_dense), ("moe-allreduce", ref_moe),
                      ("moe-alltoall-padded", ref_moe)):
        for k, owner in enumerate(ASSIGNMENTS):
            merged = {**per_rank[0][what][0][k], **per_rank[tp][what][0][k]}
            assert [merged[i] for i in range(len(prompts))] == ref, (what, owner)
        runs = [per_rank[r][what][1] for r in range(2 * tp)]
        assert all(r == runs[0] for r in runs), "the ranks replayed different graphs"
        # (Equal on every rank: DP rank 1, idle in scenario 2, replayed the others' graphs.)
        assert runs[0], f"{what}: no decode step ran through the graphs"
