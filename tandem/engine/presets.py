"""Config shapes of well-known models, for `--load-format dummy` runs that need no files."""

from __future__ import annotations

from typing import Any

_LLAMA3_ROPE = {
    "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192, "rope_theta": 500000.0,
}

PRESETS: dict[str, dict[str, Any]] = {
    "smollm2-135m": {
        "architectures": ["LlamaForCausalLM"], "vocab_size": 49152, "hidden_size": 576,
        "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9,
        "num_key_value_heads": 3, "rms_norm_eps": 1e-5, "rope_theta": 100000.0,
        "max_position_embeddings": 8192, "tie_word_embeddings": True,
        "bos_token_id": 1, "eos_token_id": 2,
    },
    "llama-3.1-8b": {
        "architectures": ["LlamaForCausalLM"], "vocab_size": 128256, "hidden_size": 4096,
        "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
        "num_key_value_heads": 8, "rms_norm_eps": 1e-5, "rope_parameters": _LLAMA3_ROPE,
        "max_position_embeddings": 131072, "tie_word_embeddings": False,
        "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009],
    },
    "llama-3.1-70b": {
        "architectures": ["LlamaForCausalLM"], "vocab_size": 128256, "hidden_size": 8192,
        "intermediate_size": 28672, "num_hidden_layers": 80, "num_attention_heads": 64,
        "num_key_value_heads": 8, "rms_norm_eps": 1e-5, "rope_parameters": _LLAMA3_ROPE,
        "max_position_embeddings": 131072, "tie_word_embeddings": False,
        "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009],
    },
    "qwen3-30b-a3b": {
        "architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 151936, "hidden_size": 2048,
        "intermediate_size": 6144, "moe_intermediate_size": 768, "num_hidden_layers": 48,
        "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
        "num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": True,
        "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "max_position_embeddings": 40960,
        "tie_word_embeddings": False, "eos_token_id": 151645,
    },
}
