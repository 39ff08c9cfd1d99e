"""The fused decode path under TP (norms, activation and residual adds folded into the GEMVs;
rank 0's row-parallel GEMV adds the residual before the all-reduce) computes the same function
as the layer-by-layer TP path and as one rank. Two or four gloo processes on the CPU run the
torch twins, so in float32 every result must agree to rounding, on every rank; the GPU runs
(benchmarks/gpu_tp.py, tests/gpu/test_tp_graphs.py) check the Triton kernels."""

from __future__ import annotations

import socket

import pytest
import torch
import torch.multiprocessing as mp

from tandem.engine import SeqSlice, build_metadata, kernels
from tandem.engine.attention.torch_ref import TorchReferenceBackend
from tandem.engine.config import ModelConfig
from tandem.engine.kv_cache import KVGroupSpec, KVPool
from tandem.engine.loader import fill_dummy
from tandem.engine.models.decoder import DecoderLM
from tandem.engine.parallel import ParallelContext, ParallelGroup
from tandem.engine.runner import ForwardBatch, ModelRunner

pytestmark = pytest.mark.timeout(240)

TINY = {
    "architectures": ["LlamaForCausalLM"], "vocab_size": 96, "hidden_size": 64,
    "intermediate_size": 96, "num_hidden_layers": 3, "num_attention_heads": 4,
    "num_key_value_heads": 2, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
    "max_position_embeddings": 128, "tie_word_embeddings": False,
}
CONTEXT, NEW = [5, 17, 3], [11, 42, 8, 64, 2]  # a verify of 5 rows after a 3-token context


def _logits(par: ParallelContext, fuse: bool) -> torch.Tensor:
    """[len(NEW), V] float32 logits of NEW after CONTEXT, every layer fused or none (fused:
    asserts that every layer asked for the fused path, which it does only where it can fuse)."""
    cfg = ModelConfig.from_hf(TINY)
    model = DecoderLM(cfg, par, torch.float32, 128)
    fill_dummy(model.weight_loaders(), torch.float32, torch.device("cpu"), seed=7)
    gen = torch.Generator().manual_seed(3)  # norm weights off 1, the same on every rank
    for name, p in sorted(model.named_parameters()):
        if "norm" in name:
            p.data.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=gen))
    group = KVGroupSpec(name="target", num_layers=cfg.num_layers,  # this rank's KV heads
                        num_kv_heads=max(1, cfg.num_kv_heads // par.tp.size),
                        head_dim=cfg.head_dim)
    pool = KVPool([group], 8, 4, torch.float32, "cpu")
    runner = ModelRunner(model.eval(), pool, TorchReferenceBackend(torch.device("cpu")))

    def run(num_cached: int, ids: list[int]) -> torch.Tensor:
        lay = build_metadata([SeqSlice(page_ids=[1, 2, 3, 4], num_cached=num_cached,
                                       num_new=len(ids))], 4)
        return runner.forward(ForwardBatch(
            input_ids=torch.tensor(ids), positions=lay.positions, attn=lay.attn,
            logits_indices=torch.arange(len(ids)))).logits

    layered_ok, asked = kernels.decode_fusion_ok, []

    def fuse_new_rows(x: torch.Tensor) -> bool:
        asked.append(x.shape[0])
        return x.shape[0] == len(NEW)

    with torch.inference_mode():
        run(0, CONTEXT)
        kernels.decode_fusion_ok = fuse_new_rows if fuse else layered_ok
        try:
            logits = run(len(CONTEXT), NEW).clone()
        finally:
            kernels.decode_fusion_ok = layered_ok
    assert asked == ([len(NEW)] * cfg.num_layers if fuse else []), asked
    return logits


def _rank(rank: int, world: int, port: int, out) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    try:
        par = ParallelContext(tp=ParallelGroup(rank=rank, size=world, handle=dist.group.WORLD))
        try:
            # numpy arrays pickle by value: a tensor in the queue is shared through a socket of
            # this process, gone if it exits before the parent reads (FileNotFoundError in CI)
            out.put((rank, _logits(par, fuse=False).numpy(), _logits(par, fuse=True).numpy()))
        except Exception as exc:  # reported, not left to the parent's timeout
            out.put((rank, f"{type(exc).__name__}: {exc}", None))
            raise
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 4])  # 4: KV heads replicated over 2 ranks each
def test_fused_tp_equals_layered_tp_and_one_rank(world):
    single_layered = _logits(ParallelContext(), fuse=False)
    single_fused = _logits(ParallelContext(), fuse=True)
    torch.testing.assert_close(single_fused, single_layered, atol=1e-5, rtol=1e-5)

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [ctx.Process(target=_rank, args=(r, world, port, q)) for r in range(world)]
    [p.start() for p in procs]
    got = {r: (layered, fused) for r, layered, fused in (q.get(timeout=180) for _ in procs)}
    [p.join(60) for p in procs]
    for rank, (layered, fused) in got.items():
        assert fused is not None, f"rank {rank}: {layered}"
        layered, fused = torch.from_numpy(layered), torch.from_numpy(fused)
        torch.testing.assert_close(layered, single_layered, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(fused, single_layered, atol=1e-5, rtol=1e-5,
                                   msg=lambda m: f"rank {rank}, fused TP={world}: {m}")
    assert all(p.exitcode == 0 for p in procs)
