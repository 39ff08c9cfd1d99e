"""All-to-all MoE dispatch over gloo (2 ranks, float32): the "alltoall" (variable splits) and
"alltoall_padded" (fixed capacity) paths give what the all-reduce oracle and one rank give --
for one MoE layer (batch 1, batch > experts, every token routed to one rank's experts, ranks
bringing their own uneven rows as under DP attention, a rank with none) and for a whole tiny
Qwen3-MoE model (prompt logits and greedy tokens at EP=2, and under DP attention dp=2, ep=2),
and a tiny Mixtral under DP attention x TP (4 ranks: dp 2 x tp 2, experts over all four);
the padded path reads nothing back to the host.
One spawn runs every case; the parent compares (a failing case names itself)."""

from __future__ import annotations

import contextlib
import random
import traceback
from unittest import mock

import pytest
import torch

from hf_tiny import save_tiny
from rank_helpers import prompt_logits, run_ranks
from tandem.engine import (
    ConfigError,
    EngineConfig,
    LLMEngine,
    ParallelContext,
    ParallelGroup,
    SamplingParams,
)

pytestmark = pytest.mark.timeout(180)

MODES = ("alltoall", "alltoall_padded")
H, INTER, NUM_EXPERTS, TOP_K = 16, 8, 4, 2


# ---- one layer -------------------------------------------------------------------------------

def _moe(ep: ParallelGroup, dispatch: str, router_bias: int | None = None):
    """A SparseMoE over `ep` with the same full weights on every rank (seeded). router_bias:
    make every token pick experts of that EP rank (uneven routing)."""
    from tandem.engine.layers.mlp import SparseMoE

    moe = SparseMoE(H, INTER, NUM_EXPERTS, TOP_K, True, ep, ParallelGroup(), torch.float32,
                    dispatch)
    gen = torch.Generator().manual_seed(5)
    router = torch.randn(NUM_EXPERTS, H, generator=gen)
    if router_bias is not None:  # inputs are positive, so these rows win every token
        per = NUM_EXPERTS // 2
        router[router_bias * per : (router_bias + 1) * per] += 10.0
    moe.router.load_weight("router", router)
    for e in range(NUM_EXPERTS):
        for which, shape in (("gate", (INTER, H)), ("up", (INTER, H)), ("down", (H, INTER))):
            moe.load_expert(f"e{e}.{which}", e, which, torch.randn(*shape, generator=gen))
    return moe


def _inputs(rows: int, seed: int, positive: bool) -> torch.Tensor:  # [rows, H] float32
    x = torch.randn(rows, H, generator=torch.Generator().manual_seed(seed))
    return x.abs() if positive else x


@contextlib.contextmanager
def _no_host_reads():
    """Any Tensor.item()/.tolist() inside raises (the padded dispatch's promise for graphs)."""
    def refuse(*_args, **_kwargs):
        raise AssertionError("host read in the padded all-to-all path")

    with mock.patch.object(torch.Tensor, "item", refuse), \
            mock.patch.object(torch.Tensor, "tolist", refuse):
        yield


def test_no_host_reads_catches_a_read():
    with _no_host_reads(), pytest.raises(AssertionError, match="host read"):
        torch.ones(2).tolist()


# (name, rows per rank, router bias): replicated cases use rows[0] on both ranks
LAYER_CASES = (
    ("batch1", (1, 1), None),
    ("batch_gt_experts", (9, 9), None),
    ("all_to_rank1", (6, 6), 1),
    ("all_to_rank0", (5, 5), 0),
    ("dp_uneven", (3, 7), None),
    ("dp_one_idle", (4, 0), 1),
    ("dp_batch1_each", (1, 1), 0),
)


def _layer_results(ep: ParallelGroup) -> dict[str, float]:
    """Max |difference| from the single-rank layer, per case and path."""
    diffs: dict[str, float] = {}
    for name, rows, bias in LAYER_CASES:
        positive = bias is not None
        local = _inputs(rows[ep.rank], 100 * ep.rank + len(name), positive)
        every = [_inputs(rows[r], 100 * r + len(name), positive) for r in range(ep.size)]
        single = _moe(ParallelGroup(), "allreduce", bias)
        if bias is not None:  # the case routes what it says: every pick on rank `bias`
            picks = single.route(torch.cat(every))[1]  # [T, k] global expert ids
            assert bool((picks // (NUM_EXPERTS // ep.size) == bias).all()), name
        if name.startswith("dp_"):  # each rank brings its own rows
            start = sum(rows[: ep.rank])
            want = single(torch.cat(every))[start : start + rows[ep.rank]]
            for mode in MODES:
                moe = _moe(ep, mode, bias)
                if mode == "alltoall_padded":  # counts stay on the device
                    with _no_host_reads():
                        got = moe(local, max(rows), ParallelGroup())
                else:
                    got = moe(local, max(rows), ParallelGroup())
                diffs[f"{name}/{mode}"] = _rel(got, want) if len(got) else 0.0
        else:  # the same rows on every rank
            x = every[0]
            want = single(x)
            for mode in ("allreduce", *MODES):
                got = _moe(ep, mode, bias)(x)
                diffs[f"{name}/{mode}"] = _rel(got, want)
    return diffs


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    """Max |got - want| over the scale of `want` (at least 1): float32 sums of other row
    counts differ in the last bits, by how much depends on the CPU's BLAS kernels."""
    return ((got - want).abs().max() / want.abs().max().clamp(min=1.0)).item()


# ---- a whole model ---------------------------------------------------------------------------

def _engine(model_dir: str, par: ParallelContext | None = None, dispatch: str = "allreduce"):
    return LLMEngine.from_config(EngineConfig(model=model_dir, dtype="float32", num_pages=96,
                                              page_size=4, max_num_batched_tokens=16,
                                              moe_dispatch=dispatch), par)


def _requests():
    rng = random.Random(11)
    prompts = [[rng.randrange(256) for _ in range(rng.randint(2, 14))] for _ in range(6)]
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in (8, 3, 6, 1, 7, 5)]
    return prompts, params


def _dispatches(engine: LLMEngine) -> list[bool]:
    """Per MoE layer: do its tokens travel (all-to-all), or is it the all-reduce path?"""
    from tandem.engine.layers.mlp import SparseMoE

    return [m.dispatches_tokens for m in engine.model.modules() if isinstance(m, SparseMoE)]


def _model_results(group: ParallelGroup, model_dir: str) -> dict:
    prompts, params = _requests()
    results = {}
    for mode in ("allreduce", *MODES):
        eng = _engine(model_dir, ParallelContext(ep=group), mode)
        results[f"ep/{mode}/dispatches"] = _dispatches(eng)
        results[f"ep/{mode}/logits"] = [prompt_logits(eng, p).numpy() for p in prompts[:2]]
        results[f"ep/{mode}/batch"] = [c.output_ids for c in eng.generate(prompts, params)]
        results[f"ep/{mode}/one"] = [c.output_ids for c in eng.generate(prompts[:1], params[:1])]
    # DP attention: rank r owns requests r, r+2, ...; then rank 1 idle (all on rank 0)
    for mode in MODES:
        eng = _engine(model_dir, ParallelContext(dp=group, ep=group), mode)
        results[f"dp/{mode}/dispatches"] = _dispatches(eng)
        for owner_name, owner in (("split", [i % 2 for i in range(6)]), ("idle", [0] * 6)):
            mine = [i for i, r in enumerate(owner) if r == group.rank]
            got = eng.generate([prompts[i] for i in mine], [params[i] for i in mine])
            results[f"dp/{mode}/{owner_name}"] = {i: c.output_ids for i, c in zip(mine, got)}
    return results


def _worker(rank: int, port: int, model_dir: str, out) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=2)
        group = ParallelGroup(rank=rank, size=2, handle=dist.group.WORLD)
        out.put((rank, _layer_results(group), _model_results(group, model_dir)))
        dist.destroy_process_group()
    except Exception:  # the parent fails with this rank's traceback instead of a timeout
        out.put((rank, traceback.format_exc(), None))


def test_alltoall_equals_allreduce_and_single_rank(tmp_path):
    torch.set_num_threads(1)
    model_dir = str(save_tiny("qwen3_moe", tmp_path)[0])
    prompts, params = _requests()
    single = _engine(model_dir)
    ref_logits = [prompt_logits(single, p) for p in prompts[:2]]
    ref_batch = [c.output_ids for c in single.generate(prompts, params)]
    ref_one = [c.output_ids for c in single.generate(prompts[:1], params[:1])]

    reports, exitcodes = run_ranks(_worker, 2, model_dir, timeout_s=150)
    per_rank = {r: (layer, model) for r, layer, model in reports}
    for rank, (layer, _) in per_rank.items():
        assert isinstance(layer, dict), f"rank {rank} failed:\n{layer}"
    assert all(code == 0 for code in exitcodes)

    for rank, (layer, model) in per_rank.items():
        for case, diff in layer.items():
            assert diff <= 1e-6, f"rank {rank}, layer case {case}: max |diff| / scale {diff}"
        for mode in ("allreduce", *MODES):
            for got, want in zip(model[f"ep/{mode}/logits"], ref_logits):
                torch.testing.assert_close(torch.from_numpy(got), want, rtol=1e-5, atol=1e-5,
                                           msg=f"rank {rank}, {mode} logits")
            assert model[f"ep/{mode}/batch"] == ref_batch, (rank, mode)
            assert model[f"ep/{mode}/one"] == ref_one, (rank, mode)
            # the equality above tests the path asked for, not a silent fallback
            assert model[f"ep/{mode}/dispatches"] == [mode != "allreduce"] * 2, (rank, mode)
    for mode in MODES:
        assert per_rank[0][1][f"dp/{mode}/dispatches"] == [True, True], mode
        for owner in ("split", "idle"):
            key = f"dp/{mode}/{owner}"
            merged = {**per_rank[0][1][key], **per_rank[1][1][key]}
            assert [merged[i] for i in range(len(prompts))] == ref_batch, (mode, owner)


def test_moe_dispatch_is_validated_naming_the_field():
    with pytest.raises(ConfigError, match="moe_dispatch"):
        EngineConfig(moe_dispatch="all2all")  # type: ignore[arg-type]
    assert EngineConfig().moe_dispatch == "allreduce"  # the default is the oracle path
    from tandem.deploy.config import parse_deploy  # the deployment YAML's engine section

    assert parse_deploy({"engine": {"moe_dispatch": "alltoall"}}).engine.moe_dispatch == "alltoall"
    with pytest.raises(ConfigError, match="engine.moe_dispatch"):
        parse_deploy({"engine": {"moe_dispatch": "a2a"}})


def test_alltoall_without_ep_is_the_local_path():
    """One EP rank: nothing to dispatch, every mode runs the same local experts."""
    from tandem.engine.layers.mlp import SparseMoE

    x = _inputs(5, 1, False)
    outs = [_moe(ParallelGroup(), mode)(x) for mode in ("allreduce", *MODES)]
    assert all(isinstance(_moe(ParallelGroup(), m), SparseMoE) for m in MODES)
    for got in outs[1:]:
        assert torch.equal(got, outs[0])


# ---- DP attention x TP: a DP rank of two TP ranks splits its own tokens between them --------

def _dp_tp_rank(rank: int, port: int, model_dir: str, out) -> None:
    from tandem.worker.ranks import RankInfo, join_group, leave_group

    torch.set_num_threads(1)
    try:
        par, _ = join_group(RankInfo(rank=rank, tp=2, dp=2), "127.0.0.1", port, "cpu")
        moe_par = ParallelContext(tp=par.tp, dp=par.dp, ep=par.dp)  # experts over all 4 ranks
        prompts, params = _requests()
        results = {}
        for mode in MODES:
            eng = _engine(model_dir, moe_par, mode)
            assert _dispatches(eng) == [True, True], mode
            for owner_name, owner in (("split", [i % 2 for i in range(6)]), ("idle", [0] * 6)):
                mine = [i for i, r in enumerate(owner) if r == par.dp_rank]
                got = eng.generate([prompts[i] for i in mine], [params[i] for i in mine])
                results[f"{mode}/{owner_name}"] = {i: c.output_ids for i, c in zip(mine, got)}
        out.put((rank, results))
        leave_group()
    except Exception:
        out.put((rank, traceback.format_exc()))


def test_dp2_tp2_alltoall_equals_one_rank(tmp_path):
    torch.set_num_threads(1)
    model_dir = str(save_tiny("mixtral", tmp_path)[0])
    prompts, params = _requests()
    ref = [c.output_ids for c in _engine(model_dir).generate(prompts, params)]

    reports, _ = run_ranks(_dp_tp_rank, 4, model_dir, timeout_s=150)
    per_rank = dict(reports)
    for rank, got in per_rank.items():
        assert isinstance(got, dict), f"rank {rank} failed:\n{got}"
    for key in per_rank[0]:
        assert per_rank[0][key] == per_rank[1][key] and per_rank[2][key] == per_rank[3][key]
        merged = {**per_rank[0][key], **per_rank[2][key]}  # the two DP ranks' TP leads
        assert [merged[i] for i in range(len(prompts))] == ref, key
