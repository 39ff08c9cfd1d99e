"""The fused batch-1 decode path (norms, activation and residual adds folded into the GEMVs
on CUDA) computes the same function as the layer-by-layer path. On the CPU both run the torch
twins, so in float32 they must agree to rounding; the GPU run checks the Triton kernels."""

from __future__ import annotations

import pytest
import torch

from tandem.engine import SeqSlice, build_metadata, kernels
from tandem.engine.attention.torch_ref import TorchReferenceBackend
from tandem.engine.config import ModelConfig
from tandem.engine.kv_cache import KVGroupSpec, KVPool
from tandem.engine.loader import fill_dummy
from tandem.engine.models.decoder import DecoderLM
from tandem.engine.parallel import ParallelContext
from tandem.engine.runner import ForwardBatch, ModelRunner

TINY = {
    "architectures": ["LlamaForCausalLM"], "vocab_size": 97, "hidden_size": 64,
    "intermediate_size": 96, "num_hidden_layers": 3, "num_attention_heads": 4,
    "num_key_value_heads": 2, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
    "max_position_embeddings": 128, "tie_word_embeddings": False,
}


# (seed, context tokens, new tokens): a batch-1 decode step; speculative verify at batch 1
# (last accepted token + 4 drafts: the multi-row GEMV on CUDA, every row with its own norm
# statistics and residual).
CASES = {"decode": (3, [5, 17, 3, 42, 8], [11]), "verify": (4, [5, 17, 3], [11, 42, 8, 64, 2])}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("qk_norm", [False, True])
def test_fused_decode_path_equals_layered_path(monkeypatch, qk_norm, case):
    seed, context, new = CASES[case]
    raw = dict(TINY, architectures=["Qwen3ForCausalLM"], head_dim=16) if qk_norm else TINY
    cfg = ModelConfig.from_hf(raw)
    model = DecoderLM(cfg, ParallelContext(), torch.float32, 128)
    fill_dummy(model.weight_loaders(), torch.float32, torch.device("cpu"), seed=seed)
    group = KVGroupSpec(name="target", num_layers=cfg.num_layers,
                        num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim)
    pool = KVPool([group], 8, 4, torch.float32, "cpu")
    runner = ModelRunner(model.eval(), pool, TorchReferenceBackend(torch.device("cpu")))

    def run(num_cached: int, ids: list[int]) -> torch.Tensor:  # -> [len(ids), V] float32
        lay = build_metadata([SeqSlice(page_ids=[1, 2, 3, 4], num_cached=num_cached,
                                       num_new=len(ids))], 4)
        return runner.forward(ForwardBatch(
            input_ids=torch.tensor(ids), positions=lay.positions, attn=lay.attn,
            logits_indices=torch.arange(len(ids)))).logits

    run(0, context)  # the context (layered: nothing patched yet)
    layered = run(len(context), new)
    calls = []

    def fuse_these_rows(x: torch.Tensor) -> bool:
        calls.append(x.shape[0])
        return x.shape[0] == len(new)

    monkeypatch.setattr(kernels, "decode_fusion_ok", fuse_these_rows)
    fused = run(len(context), new)  # rewrites the same slots with the same K/V
    assert calls == [len(new)] * cfg.num_layers
    assert fused.shape == (len(new), cfg.vocab_size)
    torch.testing.assert_close(fused, layered, atol=1e-5, rtol=1e-5)


def test_fused_path_row_limit_follows_the_policy(monkeypatch):
    """decode_fusion_ok / the GEMV route take 1..gemv_max_rows rows (8: verify of k + 1
    tokens, small batches: the default; 1 is the batch-1-only behaviour). The Triton
    module lookup is faked so that the row rule itself is checked on the CPU."""
    from tandem.engine.kernels import ops

    monkeypatch.setattr(ops, "_triton_for", lambda x: ops)  # "CUDA with Triton"
    monkeypatch.setattr(ops, "_gemv_module", ops)
    rows = {m: torch.zeros(m, 16) for m in (0, 1, 2, 5, 8, 9)}
    assert kernels.KernelPolicy().gemv_max_rows == 8  # on since it ran end to end on a GPU
    # Explicit values: the process policy may come from TANDEM_* variables.
    with kernels.kernel_policy(gemv=True, fused_decode=True, gemv_max_rows=8):
        assert [m for m, x in rows.items() if kernels.decode_fusion_ok(x)] == [1, 2, 5, 8]
        with kernels.kernel_policy(gemv_max_rows=1):
            assert [m for m, x in rows.items() if kernels.decode_fusion_ok(x)] == [1]
        with kernels.kernel_policy(gemv=False):
            assert not any(kernels.decode_fusion_ok(x) for x in rows.values())
    for bad in (0, 9):
        with pytest.raises(ValueError, match="gemv_max_rows"):
            kernels.KernelPolicy(gemv_max_rows=bad)


@pytest.mark.parametrize(("kind", "layers"), [("eagle", 1), ("eagle3", 1), ("eagle", 2)],
                         ids=["eagle", "eagle3", "eagle-2layer"])
def test_fused_draft_head_equals_its_layered_path(tmp_path, monkeypatch, kind, layers):
    """The draft head's layers take the same fused path as the target's where
    decode_fusion_ok (a draft step, a small extend on CUDA): o_proj's GEMV adds the residual,
    the MLP folds its norm, SiLU-mul and add. On the CPU both run the torch twins: the same
    numbers in float32, for prefill-, extend- and step-shaped batches."""
    from hf_tiny import save_tiny

    from tandem.engine import EngineConfig, LLMEngine
    from tandem.spec import DraftHeadConfig, DraftRunner, draft_kv_group, dummy_head

    path, _ = save_tiny("llama", tmp_path)
    base = LLMEngine.from_config(EngineConfig(model=str(path), dtype="float32", num_pages=4))
    cfg = DraftHeadConfig.like_target(base.model.cfg, kind, num_layers=layers)
    head = dummy_head(cfg, base.model, torch.float32, torch.device("cpu"), 128, seed=5)
    eng = LLMEngine(EngineConfig(model=str(path), dtype="float32", num_pages=16, page_size=4),
                    base.model, extra_kv_groups=[draft_kv_group(head)])
    draft = DraftRunner(head, eng.kv_pool, eng.runner.backend, eng.max_model_len)
    pages = eng.allocator.alloc(8)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 256, (12,), generator=g)
    feats = torch.randn(12, cfg.feature_size, generator=g)

    def run(num_cached: int, n: int) -> torch.Tensor:  # [n, H]
        lay = build_metadata([SeqSlice(page_ids=pages, num_cached=num_cached, num_new=n)], 4)
        sl = slice(num_cached, num_cached + n)
        return draft.forward(tokens[sl], feats[sl], lay)

    layered = [run(0, 6), run(6, 5), run(11, 1)]  # prefill, extend, draft step
    calls = []

    def fuse_small(x: torch.Tensor) -> bool:
        calls.append(x.shape[0])
        return x.shape[0] <= 5

    monkeypatch.setattr(kernels, "decode_fusion_ok", fuse_small)
    assert kernels.KernelPolicy().fused_draft  # on by default
    with kernels.kernel_policy(fused_draft=False):
        run(11, 1)
    assert calls == []  # the policy turns it off
    with kernels.kernel_policy(fused_draft=True):
        fused = [run(0, 6), run(6, 5), run(11, 1)]  # rewrites the same slots, same K/V
    assert sorted(set(calls)) == [1, 5, 6] and len(calls) == 3 * layers
    for a, b in zip(fused, layered):
        torch.testing.assert_close(a, b, atol=0, rtol=0)
