"""The TP all-reduce choice (engine/allreduce.py), on the CPU: the size -> method table built
from timings, the fallbacks to NCCL, config validation, and that `ParallelGroup.all_reduce`
takes the custom path only where it answers. The kernels themselves run on GPUs
(tests/gpu/test_tp_graphs.py, benchmarks/gpu_tp.py)."""

from __future__ import annotations

import math
import socket

import pytest
import torch

from tandem.engine import ConfigError, EngineConfig, ParallelContext, ParallelGroup
from tandem.engine.allreduce import (
    ALIGN,
    FLAG_ONE_SHOT,
    METHODS,
    NCCL,
    ONE_SHOT,
    TWO_SHOT,
    MethodTable,
    attach_fast_all_reduce,
    choose_methods,
    custom_eligible,
    message_sizes,
)

INF = math.inf
SIZES = (8192, 65536, 524288)
THREE = (NCCL, ONE_SHOT, TWO_SHOT)  # the columns of the tables below


def test_auto_takes_the_fastest_method_of_each_size():
    us = [[20.0, 6.0, 9.0], [22.0, 12.0, 10.0], [30.0, 41.0, 33.0]]
    table = choose_methods(SIZES, THREE, us)
    assert table.chosen == (ONE_SHOT, TWO_SHOT, NCCL)
    assert table.max_custom_bytes == 65536


def test_ties_go_to_nccl_and_failed_methods_are_never_chosen():
    table = choose_methods(SIZES, THREE, [[5.0, 5.0, 5.0], [9.0, INF, 3.0], [INF, INF, INF]])
    assert table.chosen == (NCCL, TWO_SHOT, NCCL)  # all failed: NCCL, the fallback
    assert choose_methods(SIZES, THREE, [[5.0, INF, INF]] * 3).max_custom_bytes == 0


def test_a_forced_method_runs_wherever_it_ran_and_nccl_elsewhere():
    us = [[1.0, 50.0, 2.0], [1.0, INF, 2.0], [1.0, 3.0, 2.0]]
    assert choose_methods(SIZES, THREE, us, ONE_SHOT).chosen == (ONE_SHOT, NCCL, ONE_SHOT)
    assert choose_methods(SIZES, THREE, us, NCCL).chosen == (NCCL,) * 3
    assert choose_methods(SIZES, (NCCL, ONE_SHOT), [r[:2] for r in us], TWO_SHOT).chosen == \
        (NCCL,) * 3  # not measured: not taken


def test_the_flag_one_shot_is_a_method_like_the_others():
    assert METHODS == (NCCL, ONE_SHOT, TWO_SHOT, FLAG_ONE_SHOT)  # NCCL first: it wins ties
    us = [[9.0, 8.0, 12.0, 4.0], [9.0, 8.0, 12.0, INF], [9.0, 10.0, 7.0, 8.0]]
    assert choose_methods(SIZES, METHODS, us).chosen == (FLAG_ONE_SHOT, ONE_SHOT, TWO_SHOT)
    assert choose_methods(SIZES, METHODS, us, FLAG_ONE_SHOT).chosen == \
        (FLAG_ONE_SHOT, NCCL, FLAG_ONE_SHOT)


def test_flag_one_shot_ranges_cover_every_element_once():
    triton_allreduce = pytest.importorskip("tandem.engine.kernels.triton_allreduce")
    g = triton_allreduce.PROGRAMS
    for n in (1, 8, 4096, 4104, 32768, 65536, 262144, 524288):
        block, iters = triton_allreduce.launch_shape(n)
        assert block & (block - 1) == 0 and block <= triton_allreduce.MAX_BLOCK
        assert g * iters * block >= n  # the G programs' ranges reach past the message
        assert iters * block < 2 * max(block, -(-n // g))  # no program spans twice its share


def test_a_message_takes_the_next_measured_size_and_nccl_beyond_the_last():
    table = choose_methods(SIZES, THREE, [[9.0, 1.0, 5.0], [9.0, 5.0, 1.0], [1.0, 5.0, 9.0]])
    assert [table.method_for(n) for n in (16, 8192, 8208, 65536, 65552, 524288, 524304)] == \
        [ONE_SHOT, ONE_SHOT, TWO_SHOT, TWO_SHOT, NCCL, NCCL, NCCL]
    one = choose_methods((8192,), THREE, [[9.0, 1.0, 5.0]])
    assert one.method_for(8192 + ALIGN) == NCCL  # bigger than anything measured


def test_bad_tables_and_modes_are_refused():
    with pytest.raises(ValueError, match="ascending"):
        MethodTable(sizes=(2, 1), methods=(NCCL,), us=((1.0,), (1.0,)), chosen=(NCCL, NCCL))
    with pytest.raises(ValueError, match="us:"):
        MethodTable(sizes=(1,), methods=(NCCL, ONE_SHOT), us=((1.0,),), chosen=(NCCL,))
    with pytest.raises(ValueError, match="methods"):
        MethodTable(sizes=(1,), methods=("mpi",), us=((1.0,),), chosen=(NCCL,))
    with pytest.raises(ValueError, match="mode"):
        choose_methods(SIZES, THREE, [[1.0] * 3] * 3, "fastest")
    with pytest.raises(ValueError, match="NCCL"):
        choose_methods((1,), (ONE_SHOT,), [[1.0]])


def test_message_sizes_cover_the_decode_batches_and_powers_of_two():
    sizes = message_sizes(4096, 2, (1, 24, 48, 512, 4096), max_bytes=1 << 20)
    row = 4096 * 2
    assert sizes == tuple(sorted({n * row for n in (1, 2, 4, 8, 16, 24, 32, 48, 64, 128)}))
    assert max(sizes) <= 1 << 20 and 4096 * row not in sizes


@pytest.mark.parametrize("case,ok", [
    (dict(), True),
    (dict(dtype=torch.float16), False),  # not the buffer's dtype
    (dict(contiguous=False), False),
    (dict(nbytes=8192 + 2), False),  # size not 16-byte aligned
    (dict(offset_bytes=8), False),  # start not 16-byte aligned
    (dict(nbytes=(1 << 20) + ALIGN), False),  # larger than the buffer
    (dict(nbytes=0), False),
])
def test_only_aligned_contiguous_messages_of_the_buffers_dtype_that_fit_go_custom(case, ok):
    args = dict(dtype=torch.bfloat16, buffer_dtype=torch.bfloat16, nbytes=8192,
                offset_bytes=32, contiguous=True, max_bytes=1 << 20) | case
    assert custom_eligible(**args) is ok


def test_config_names_the_field():
    assert EngineConfig().all_reduce == "auto"
    for mode in ("nccl", "one_shot", "two_shot"):
        assert EngineConfig(all_reduce=mode).all_reduce == mode
    with pytest.raises(ConfigError, match="all_reduce: 'fast'"):
        EngineConfig(all_reduce="fast")


def test_nothing_is_attached_on_the_cpu_with_tp1_or_nccl():
    tp = ParallelGroup(rank=0, size=2, handle=object())
    par = ParallelContext(tp=tp, ep=tp)
    for p, mode, dev in ((par, "auto", "cpu"), (ParallelContext(), "auto", "cuda"),
                         (par, "nccl", "cuda")):
        assert attach_fast_all_reduce(p, mode, torch.device(dev), torch.bfloat16, 64, (1,)) is p
    dp = ParallelContext(tp=ParallelGroup(), dp=tp)  # DP attention: its groups stay NCCL
    assert attach_fast_all_reduce(dp, "auto", torch.device("cuda"), torch.bfloat16, 64, (1,)) is dp
    with pytest.raises(ValueError, match="all_reduce"):
        attach_fast_all_reduce(par, "fast", torch.device("cpu"), torch.bfloat16, 64, (1,))


class _FakeFast:
    """Answers for messages of `limit` elements or fewer (a custom result: x * 10), else None."""

    def __init__(self, limit: int) -> None:
        self.limit, self.calls = limit, 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor | None:
        self.calls += 1
        return x * 10 if x.numel() <= self.limit else None


@pytest.fixture(scope="module")
def gloo_world_of_one():
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


def test_group_takes_the_custom_result_when_there_is_one_and_nccl_otherwise(gloo_world_of_one):
    fast = _FakeFast(limit=4)
    # size 2 over a world of one: the backend's all-reduce is then the identity
    group = ParallelGroup(rank=0, size=2, handle=gloo_world_of_one, fast=fast)
    small, big = torch.ones(4), torch.ones(8)
    assert torch.equal(group.all_reduce(small), small * 10)
    out = group.all_reduce(big)
    assert torch.equal(out, big) and out is not big  # the backend's, on a copy
    assert torch.equal(small, torch.ones(4)) and torch.equal(big, torch.ones(8))
    assert fast.calls == 2
    plain = ParallelGroup(rank=0, size=2, handle=gloo_world_of_one)
    assert torch.equal(plain.all_reduce(small), small)


def test_engine_config_takes_every_all_reduce_mode():
    from tandem.engine.allreduce import MODES
    from tandem.engine.config import ALL_REDUCE_MODES, EngineConfig

    assert ALL_REDUCE_MODES == MODES
    for mode in MODES:
        EngineConfig(model="smollm2-135m", load_format="dummy", all_reduce=mode)
