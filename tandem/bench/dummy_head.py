"""Random EAGLE heads on disk, for benchmarking speculative decoding of `--load-format dummy`
models (which have no trained head). Such a head accepts almost nothing (tau ~ 1): it measures
what speculation costs, not what it gains.

A bench config asks for one with `spec: {draft_model: dummy}`; the head is written once per
model shape and dtype under `$TANDEM_CACHE/dummy-heads/` (default ~/.cache/tandem) and the
config then points at that directory. The directory must be visible to every worker: true on
one node; on several nodes use a shared filesystem (or pass a real head).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import torch

from tandem.engine.config import ModelConfig

DUMMY = "dummy"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def head_tensors(cfg: ModelConfig, dtype: torch.dtype, seed: int = 0
                 ) -> dict[str, torch.Tensor]:
    """An EAGLE-1 head shaped like one target layer, in the checkpoint layout `load_head` reads:
    fc over [token embedding, target feature] -> hidden, one decoder layer without input norm."""
    h, d, inter = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    q, kv = cfg.num_heads * d, cfg.num_kv_heads * d
    shapes = {
        "fc.weight": (h, 2 * h), "fc.bias": (h,),
        "layers.0.self_attn.q_proj.weight": (q, h), "layers.0.self_attn.k_proj.weight": (kv, h),
        "layers.0.self_attn.v_proj.weight": (kv, h), "layers.0.self_attn.o_proj.weight": (h, q),
        "layers.0.mlp.gate_proj.weight": (inter, h), "layers.0.mlp.up_proj.weight": (inter, h),
        "layers.0.mlp.down_proj.weight": (h, inter),
    }
    gen = torch.Generator().manual_seed(seed)
    out = {name: (torch.randn(shape, generator=gen) * 0.02).to(dtype)
           for name, shape in shapes.items()}
    out["layers.0.post_attention_layernorm.weight"] = torch.ones(h, dtype=dtype)
    return out


def head_config_json(cfg: ModelConfig) -> dict[str, object]:
    from tandem.spec.head import DraftHeadConfig

    raw = DraftHeadConfig.like_target(cfg, "eagle").to_json()
    raw["tandem_dummy_head"] = True  # random weights: tau ~ 1
    return raw


def write_dummy_head(cfg: ModelConfig, dtype: str, root: Path | None = None) -> Path:
    """The directory of a random head for `cfg` (written on the first call)."""
    from safetensors.torch import save_file

    digest = hashlib.sha256(repr(cfg).encode()).hexdigest()[:12]
    root = root or Path(os.environ.get("TANDEM_CACHE", Path.home() / ".cache" / "tandem"))
    path = root / "dummy-heads" / f"eagle-{digest}-{dtype}"
    if (path / "model.safetensors").is_file():
        return path
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    save_file(head_tensors(cfg, DTYPES[dtype]), str(tmp / "model.safetensors"))
    (tmp / "config.json").write_text(json.dumps(head_config_json(cfg), indent=2) + "\n")
    try:
        tmp.rename(path)  # atomic: a concurrent writer's copy wins, ours is dropped
    except OSError:
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    return path
