"""`tandem serve --tensor-parallel-size 2`'s engine on two GPUs (colocated_node/tp_processes.py):
rank 1 spawned on GPU 1 following rank 0's `LockstepEngine` on GPU 0, bf16, FlashInfer, decode
graphs with the collectives inside, plain and speculative. Every request completes with its
tokens, every page comes back, and greedy output equals one GPU's up to bf16 near-ties.
Skipped with fewer than two GPUs. One case per process (`-k plain`, then `-k spec`): the
first launch's process group cannot be torn down (NCCL captured in graphs), so a second
launch in the same process skips."""

from __future__ import annotations

import json

import pytest
import torch

from near_ties import assert_parts_only_at_near_ties

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600),
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")]
pytest.importorskip("flashinfer")

SMALL_LLAMA = {  # head_dim 128 (the AOT-stashed FlashInfer modules), quick to build
    "architectures": ["LlamaForCausalLM"], "vocab_size": 4096, "hidden_size": 1024,
    "intermediate_size": 2816, "num_hidden_layers": 4, "num_attention_heads": 8,
    "num_key_value_heads": 4, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
    "max_position_embeddings": 2048, "tie_word_embeddings": False, "eos_token_id": 2,
}
PROMPTS = [[5, 9, 14, 3] * 8, [7, 7, 21, 40, 2, 8] * 5, [100, 3] * 20]


@pytest.mark.parametrize("speculative", [False, True], ids=["plain", "spec"])
def test_tp2_local_ranks_on_two_gpus(tmp_path, speculative):
    import torch.distributed as dist

    if dist.is_initialized():  # NCCL communicators captured in graphs never tear down
        pytest.skip("an earlier TP launch in this process kept its process group (pytorch "
                    "#115388): run each case in a process of its own (-k plain, -k spec)")
    from tandem.colocated_node import tp_processes
    from tandem.engine import EngineConfig, LLMEngine, SamplingParams
    from tandem.spec import DraftHeadConfig, SpecConfig, dummy_head

    (tmp_path / "config.json").write_text(json.dumps(SMALL_LLAMA))
    cfg = EngineConfig(model=str(tmp_path), load_format="dummy", device="cuda",
                       dtype="bfloat16", attention_backend="flashinfer", cuda_graphs=True,
                       max_num_seqs=8, max_model_len=512, kv_cache_bytes=256 << 20)
    spec = None
    one = LLMEngine.from_config(cfg)  # GPU 0, the reference
    if speculative:
        from safetensors.torch import save_file

        head = dummy_head(DraftHeadConfig.like_target(one.model_cfg, "eagle"), one.model,
                          torch.bfloat16, torch.device("cuda"), 512, seed=5)
        head_dir = tmp_path / "head"
        head_dir.mkdir()
        save_file(head.state_for_saving(), str(head_dir / "model.safetensors"))
        (head_dir / "config.json").write_text(json.dumps(head.cfg.to_json()))
        spec = SpecConfig(draft_model=str(head_dir), num_steps=3)
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    want = [list(c.output_ids) for c in one.generate(PROMPTS, params)]
    tp = tp_processes.launch(cfg, spec, 2)
    try:
        front = tp.engine
        got: dict[str, list[int]] = {}
        for i, p in enumerate(PROMPTS):
            front.add_request(p, params, f"r{i}")
        while front.has_unfinished():
            for o in front.step():
                got.setdefault(o.req_id, []).extend(o.new_token_ids)
        assert front.allocator.num_free == front.allocator.num_usable
    finally:
        tp.close()
    out = [got[f"r{i}"] for i in range(len(PROMPTS))]
    assert all(len(o) == 24 for o in out)
    assert_parts_only_at_near_ties(one, PROMPTS, out, want, top2=False)
