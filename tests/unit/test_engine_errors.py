"""Bad models and bad requests fail with a clear exception that names the problem."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from hf_tiny import save_tiny
from tandem.engine import ConfigError, EngineConfig, LLMEngine, SamplingParams, WeightLoadError


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    path, _ = save_tiny("llama", tmp_path_factory.mktemp("hf"))
    return path


def _copy(src, dst):
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def _engine(path, **kw):
    return LLMEngine.from_config(EngineConfig(model=str(path), dtype="float32", num_pages=32, **kw))


def test_unknown_architecture(llama_dir, tmp_path):
    d = _copy(llama_dir, tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    cfg["architectures"] = ["GPTNeoXForCausalLM"]
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="unknown architecture 'GPTNeoXForCausalLM'"):
        _engine(d)


def test_missing_weight(llama_dir, tmp_path):
    d = _copy(llama_dir, tmp_path / "m")
    w = load_file(d / "model.safetensors")
    del w["model.layers.1.mlp.down_proj.weight"]
    save_file(w, d / "model.safetensors")
    with pytest.raises(WeightLoadError, match=r"missing weight\(s\) model.layers.1.mlp.down_proj"):
        _engine(d)


def test_shape_mismatch(llama_dir, tmp_path):
    d = _copy(llama_dir, tmp_path / "m")
    w = load_file(d / "model.safetensors")
    w["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(16, 64)
    save_file(w, d / "model.safetensors")
    with pytest.raises(ValueError, match=r"k_proj.weight': shape \(16, 64\) in the checkpoint, "
                                         r"config implies \(32, 64\)"):
        _engine(d)


def test_unexpected_weight(llama_dir, tmp_path):
    d = _copy(llama_dir, tmp_path / "m")
    w = load_file(d / "model.safetensors")
    w["model.layers.0.mlp.extra.weight"] = torch.zeros(2)
    save_file(w, d / "model.safetensors")
    with pytest.raises(WeightLoadError, match="unexpected weight 'model.layers.0.mlp.extra"):
        _engine(d)


def test_not_a_model_dir(tmp_path):
    with pytest.raises(ConfigError, match="neither a directory nor a preset"):
        _engine(tmp_path / "nope")


def test_bad_requests(llama_dir):
    eng = _engine(llama_dir, max_model_len=64)
    p = SamplingParams(max_new_tokens=4)
    with pytest.raises(ValueError, match="prompt is empty"):
        eng.add_request([], p)
    with pytest.raises(ValueError, match=r"prompt_token_ids\[1\]: token id 256 is outside"):
        eng.add_request([1, 256], p)
    with pytest.raises(ValueError, match=r"prompt_token_ids\[0\]: token id -1"):
        eng.add_request([-1], p)
    with pytest.raises(ValueError, match="prompt has 64 tokens; the context holds 64"):
        eng.add_request([1] * 64, p)
    assert not eng.has_unfinished()  # nothing half-added


@pytest.mark.parametrize("field,kw", [
    ("max_new_tokens", dict(max_new_tokens=0)),
    ("temperature", dict(temperature=-0.1)),
    ("temperature", dict(temperature=float("nan"))),
    ("top_k", dict(top_k=-1)),
    ("top_p", dict(top_p=0.0)),
    ("top_p", dict(top_p=1.5)),
    ("min_p", dict(min_p=2.0)),
])
def test_bad_sampling_params_name_the_field(field, kw):
    with pytest.raises(ValueError, match=f"^{field}:"):
        SamplingParams(**kw)


def test_request_larger_than_pool(llama_dir):
    eng = LLMEngine.from_config(EngineConfig(model=str(llama_dir), dtype="float32", num_pages=8,
                                             page_size=4))
    with pytest.raises(ValueError, match="needs 9 KV pages; the pool has 7"):
        eng.add_request([1] * 30, SamplingParams(max_new_tokens=5))
    assert eng.allocator.num_free == 7 and not eng.has_unfinished()


def test_engine_config_validation():
    with pytest.raises(ConfigError, match="^dtype:"):
        EngineConfig(dtype="int8")
    with pytest.raises(ConfigError, match="^page_size:"):
        EngineConfig(page_size=0)
