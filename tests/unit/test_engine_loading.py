"""Checkpoint formats: a sharded safetensors directory loads like a single file, and
`load_format=dummy` builds a model of a preset's shape without any files."""

from __future__ import annotations

import json

import pytest

from hf_tiny import make_hf_model
from tandem.engine import EngineConfig, LLMEngine, SamplingParams


def test_sharded_checkpoint_equals_single_file(tmp_path):
    model = make_hf_model("qwen3").eval()
    model.save_pretrained(tmp_path / "one")
    model.save_pretrained(tmp_path / "sharded", max_shard_size="100KB")
    index = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1  # really sharded
    outs = []
    for d in ("one", "sharded"):
        eng = LLMEngine.from_config(EngineConfig(model=str(tmp_path / d), dtype="float32",
                                                 num_pages=64))
        outs.append(eng.generate([[1, 2, 3, 4]], SamplingParams(max_new_tokens=8,
                                                                ignore_eos=True))[0].output_ids)
    assert outs[0] == outs[1]


def test_dummy_preset_runs_without_files():
    eng = LLMEngine.from_config(EngineConfig(model="smollm2-135m", load_format="dummy",
                                             dtype="float32", num_pages=64))
    assert eng.model_cfg.num_layers == 30 and eng.tokenizer is None
    out = eng.generate([[5, 6, 7]], SamplingParams(max_new_tokens=4, ignore_eos=True))[0]
    assert len(out.output_ids) == 4
    # Deterministic: the same seed gives the same weights, so the same tokens.
    again = LLMEngine.from_config(EngineConfig(model="smollm2-135m", load_format="dummy",
                                               dtype="float32", num_pages=64))
    assert again.generate([[5, 6, 7]], SamplingParams(max_new_tokens=4,
                                                      ignore_eos=True))[0].output_ids == out.output_ids


def test_preset_needs_dummy_format():
    from tandem.engine import ConfigError

    with pytest.raises(ConfigError, match="load_format=dummy"):
        LLMEngine.from_config(EngineConfig(model="llama-3.1-8b"))
