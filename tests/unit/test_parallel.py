"""Tensor and expert parallelism over torch.distributed (gloo on the CPU): TP=2 output equals
TP=1 token for token, and EP=2 on a MoE model equals EP=1."""

from __future__ import annotations

import random
import socket

import pytest
import torch
import torch.multiprocessing as mp

from hf_tiny import save_tiny
from tandem.engine import EngineConfig, LLMEngine, ParallelContext, ParallelGroup, SamplingParams

pytestmark = pytest.mark.timeout(300)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _prompts():
    rng = random.Random(0)
    return [[rng.randrange(256) for _ in range(rng.randint(2, 20))] for _ in range(4)]


def _worker(rank: int, world: int, port: int, model_dir: str, mode: str, out) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    group = ParallelGroup(rank=rank, size=world, handle=dist.group.WORLD)
    par = ParallelContext(tp=group) if mode == "tp" else ParallelContext(ep=group)
    eng = LLMEngine.from_config(EngineConfig(model=model_dir, dtype="float32", num_pages=128,
                                             page_size=4, max_num_batched_tokens=16), par)
    got = eng.generate(_prompts(), SamplingParams(max_new_tokens=10, ignore_eos=True))
    out.put((rank, [c.output_ids for c in got]))
    dist.destroy_process_group()


def _run(model_dir, mode: str, world: int = 2):
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, world, port, str(model_dir), mode, q))
             for r in range(world)]
    [p.start() for p in procs]
    results = dict(q.get(timeout=240) for _ in procs)
    [p.join(30) for p in procs]
    assert all(p.exitcode == 0 for p in procs)
    return results


@pytest.mark.parametrize("arch,mode", [("llama", "tp"), ("qwen2", "tp"), ("mixtral", "ep"),
                                       ("qwen3_moe", "ep"), ("qwen3_moe", "tp")])
def test_parallel_equals_single(tmp_path, arch, mode):
    model_dir, _ = save_tiny(arch, tmp_path)
    single = LLMEngine.from_config(EngineConfig(model=str(model_dir), dtype="float32",
                                                num_pages=128, page_size=4,
                                                max_num_batched_tokens=16))
    ref = [c.output_ids for c in single.generate(_prompts(), SamplingParams(
        max_new_tokens=10, ignore_eos=True))]
    results = _run(model_dir, mode)
    assert results[0] == ref and results[1] == ref  # every rank decodes the same tokens
