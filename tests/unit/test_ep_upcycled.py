"""Expert parallelism on an "upcycled" Mixtral: a tiny Llama whose dense MLP is copied into every
expert, with a random router. Top-k weights are renormalised to sum to 1 and every expert computes
the same function, so the MoE block equals the dense MLP whatever the router picks -- EP=2 over
gloo must reproduce the dense model's logits (float32, tolerance) and greedy tokens (exactly),
for a mild and a near-one-hot router. A wrong expert shard, a dropped expert or a missing
all-reduce breaks it (a rank summing only its own experts halves the MLP output)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from hf_tiny import save_tiny
from rank_helpers import prompt_logits, run_ranks
from tandem.engine import EngineConfig, LLMEngine, ParallelContext, ParallelGroup, SamplingParams

pytestmark = pytest.mark.timeout(120)

NUM_EXPERTS, TOP_K = 4, 2
ROUTER_SCALES = (1.0, 50.0)  # mild routing, and nearly one-hot routing


def upcycle(dense_dir: Path, out: Path, router_scale: float, seed: int) -> Path:
    """Write a Mixtral checkpoint whose experts are copies of `dense_dir`'s Llama MLPs."""
    from safetensors.torch import load_file, save_file

    cfg = json.loads((dense_dir / "config.json").read_text())
    state = load_file(str(dense_dir / "model.safetensors"))
    gen = torch.Generator().manual_seed(seed)
    moe_state = {}
    for name, t in state.items():
        if ".mlp." not in name:
            moe_state[name] = t
            continue
        prefix, proj = name.split(".mlp.")
        hf = {"gate_proj.weight": "w1", "up_proj.weight": "w3", "down_proj.weight": "w2"}[proj]
        for e in range(NUM_EXPERTS):
            moe_state[f"{prefix}.block_sparse_moe.experts.{e}.{hf}.weight"] = t.clone()
    for i in range(cfg["num_hidden_layers"]):
        moe_state[f"model.layers.{i}.block_sparse_moe.gate.weight"] = (
            torch.randn(NUM_EXPERTS, cfg["hidden_size"], generator=gen) * router_scale)
    cfg.update(architectures=["MixtralForCausalLM"], model_type="mixtral",
               num_local_experts=NUM_EXPERTS, num_experts_per_tok=TOP_K)
    out.mkdir(parents=True)
    (out / "config.json").write_text(json.dumps(cfg))
    save_file({k: v.contiguous() for k, v in moe_state.items()}, str(out / "model.safetensors"))
    return out


def _engine(model_dir: str, par: ParallelContext | None = None) -> LLMEngine:
    return LLMEngine.from_config(EngineConfig(model=model_dir, dtype="float32", num_pages=64,
                                              page_size=4, max_num_batched_tokens=32), par)


def _prompts():
    rng = random.Random(3)
    return [[rng.randrange(256) for _ in range(rng.randint(3, 16))] for _ in range(3)]


def _results(model_dir: str, par: ParallelContext | None = None):
    eng = _engine(model_dir, par)
    logits = [prompt_logits(eng, p) for p in _prompts()]
    tokens = [c.output_ids for c in eng.generate(_prompts(), SamplingParams(
        max_new_tokens=12, ignore_eos=True))]
    return logits, tokens


def _ep_worker(rank: int, port: int, model_dirs: list[str], out) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    ep = ParallelGroup(rank=rank, size=2, handle=dist.group.WORLD)
    results = [_results(d, ParallelContext(ep=ep)) for d in model_dirs]
    # numpy arrays travel by value; torch tensors would travel as shared-memory handles that
    # the parent can only open while this process lives (it may have exited by then)
    out.put((rank, [([x.numpy() for x in logits], tokens) for logits, tokens in results]))
    dist.destroy_process_group()


def test_upcycled_mixtral_ep2_equals_dense(tmp_path):
    dense_dir, _ = save_tiny("llama", tmp_path)
    moe_dirs = [str(upcycle(dense_dir, tmp_path / f"moe{i}", scale, seed=11 + i))
                for i, scale in enumerate(ROUTER_SCALES)]
    torch.set_num_threads(1)
    dense_logits, dense_tokens = _results(str(dense_dir))

    reports, exitcodes = run_ranks(_ep_worker, 2, moe_dirs, timeout_s=100)
    per_rank = dict(reports)
    assert all(code == 0 for code in exitcodes)

    for rank in (0, 1):
        for scale, (logits, tokens) in zip(ROUTER_SCALES, per_rank[rank]):
            assert tokens == dense_tokens, f"rank {rank}, router scale {scale}"
            for got, want in zip(logits, dense_logits):
                torch.testing.assert_close(torch.from_numpy(got), want, rtol=1e-4, atol=1e-4)


def test_upcycled_mixtral_routes_unevenly(tmp_path):
    """The test above means something only if the router really spreads tokens over experts
    that live on different EP ranks (not all on rank 0's)."""
    from tandem.engine.layers.mlp import SparseMoE

    dense_dir, _ = save_tiny("llama", tmp_path)
    moe_dir = upcycle(dense_dir, tmp_path / "moe", 1.0, seed=11)
    eng = _engine(str(moe_dir))
    chosen: list[torch.Tensor] = []
    moe = next(m for m in eng.model.modules() if isinstance(m, SparseMoE))
    hook = moe.register_forward_hook(
        lambda mod, args, _out: chosen.append(torch.topk(mod.router(args[0]), TOP_K).indices))
    prompt_logits(eng, _prompts()[0])
    hook.remove()
    experts = torch.cat(chosen).flatten()
    assert (experts < NUM_EXPERTS // 2).any() and (experts >= NUM_EXPERTS // 2).any()
