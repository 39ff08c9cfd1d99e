"""Tiny random HF checkpoints of every supported architecture, written with transformers
(the reference implementation) so tests compare tandem against HF on identical weights."""

from __future__ import annotations

from pathlib import Path

import torch

TINY_COMMON = dict(
    vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
    initializer_range=0.1, tie_word_embeddings=False,
)

ARCHS = ("llama", "qwen2", "qwen3", "mixtral", "qwen3_moe")


def make_hf_model(arch: str, seed: int = 0):
    import transformers as tf

    torch.manual_seed(seed)
    if arch == "llama":
        cfg = tf.LlamaConfig(**TINY_COMMON, rope_theta=10000.0)
        return tf.LlamaForCausalLM(cfg)
    if arch == "qwen2":
        cfg = tf.Qwen2Config(**TINY_COMMON)
        model = tf.Qwen2ForCausalLM(cfg)
        with torch.no_grad():  # biases are zero-initialised; make them matter
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.1)
        return model
    if arch == "qwen3":
        cfg = tf.Qwen3Config(**TINY_COMMON, head_dim=32)
        model = tf.Qwen3ForCausalLM(cfg)
        _randomize_norms(model)
        return model
    if arch == "mixtral":
        cfg = tf.MixtralConfig(**TINY_COMMON, num_local_experts=4, num_experts_per_tok=2)
        return tf.MixtralForCausalLM(cfg)
    if arch == "qwen3_moe":
        cfg = tf.Qwen3MoeConfig(**TINY_COMMON, moe_intermediate_size=32, num_experts=4,
                                num_experts_per_tok=2, head_dim=16, norm_topk_prob=True)
        model = tf.Qwen3MoeForCausalLM(cfg)
        _randomize_norms(model)
        return model
    raise ValueError(arch)


def _randomize_norms(model) -> None:
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(torch.randn_like(p) * 0.1)


def save_tiny(arch: str, root: Path, seed: int = 0) -> tuple[Path, object]:
    model = make_hf_model(arch, seed).eval()
    out = root / arch
    model.save_pretrained(out)
    return out, model
