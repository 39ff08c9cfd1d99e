"""Building a model and filling its weights: from an HF checkpoint directory (safetensors,
sharded or not) or with deterministic random weights (`load_format="dummy"`)."""

from __future__ import annotations

import json
import logging
import zlib
from collections.abc import Iterator
from pathlib import Path

import torch

from tandem.engine.config import ConfigError, EngineConfig, ModelConfig
from tandem.engine.models.decoder import DecoderLM, WeightSlot
from tandem.engine.parallel import ParallelContext
from tandem.engine.presets import PRESETS

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Checkpoint entries that are derived state, not weights.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class WeightLoadError(ValueError):
    """The checkpoint does not match the model: a missing, unexpected or misshapen tensor."""


def resolve_model(engine_cfg: EngineConfig) -> tuple[ModelConfig, Path | None]:
    """(config, checkpoint dir or None for a preset). `default` is the bundled SmolLM2."""
    name = engine_cfg.model
    if name in PRESETS:
        if engine_cfg.load_format != "dummy":
            raise ConfigError(f"model: preset '{name}' has no weights; use load_format=dummy")
        return ModelConfig.from_hf(PRESETS[name]), None
    if name == "default":
        from tandem.engine.model_import import ensure_default_model

        path = ensure_default_model()
    else:
        path = Path(name).expanduser()
        if not path.is_dir():
            raise ConfigError(
                f"model: '{name}' is neither a directory nor a preset "
                f"({', '.join(sorted(PRESETS))}, default)"
            )
    return ModelConfig.from_dir(path), path


def build_model(
    cfg: ModelConfig, path: Path | None, engine_cfg: EngineConfig, par: ParallelContext,
    max_position: int,
) -> DecoderLM:
    dtype = DTYPES[engine_cfg.dtype]
    device = torch.device(engine_cfg.device)
    if par.tp.size > 1 and device.type == "cuda":  # before the layers take their groups
        from tandem.engine.allreduce import attach_fast_all_reduce
        from tandem.engine.cuda_graphs import graph_batch_sizes

        par = attach_fast_all_reduce(par, engine_cfg.all_reduce, device, dtype, cfg.hidden_size,
                                     graph_batch_sizes(engine_cfg.max_num_seqs))
    with torch.device(device):
        model = DecoderLM(cfg, par, dtype, max_position, engine_cfg.moe_dispatch)
    slots = model.weight_loaders()
    if engine_cfg.load_format == "dummy":
        fill_dummy(slots, dtype, device, engine_cfg.seed)
    else:
        if path is None:
            raise ConfigError("model: no checkpoint directory to load weights from")
        load_checkpoint(slots, path, cfg)
    return model.eval()


def fill_dummy(
    slots: dict[str, WeightSlot], dtype: torch.dtype, device: torch.device, seed: int
) -> None:
    """Deterministic random weights. Each tensor's generator is seeded from its name, so every
    TP rank draws the same full tensor and keeps its own slice."""
    for name, slot in slots.items():
        if slot.is_norm:
            slot.load(torch.ones(slot.shape, dtype=dtype, device=device))
            continue
        gen = torch.Generator(device=device).manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
        full = torch.empty(slot.shape, dtype=dtype, device=device).normal_(0.0, 0.02, generator=gen)
        slot.load(full)


def checkpoint_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        return sorted({path / f for f in weight_map.values()})
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise WeightLoadError(f"{path}: no *.safetensors files")
    return files


def iter_checkpoint(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    for file in checkpoint_files(path):
        if not file.is_file():
            raise WeightLoadError(f"{file}: listed in the index but missing")
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def load_checkpoint(slots: dict[str, WeightSlot], path: Path, cfg: ModelConfig) -> None:
    loaded: set[str] = set()
    for name, tensor in iter_checkpoint(path):
        slot = slots.get(name)
        if slot is None:
            if name.endswith(_IGNORED_SUFFIXES) or (
                name == "lm_head.weight" and cfg.tie_word_embeddings
            ):
                continue
            raise WeightLoadError(f"{path}: unexpected weight '{name}' for {cfg.architecture}")
        slot.load(tensor)
        loaded.add(name)
    missing = sorted(set(slots) - loaded)
    if missing:
        shown = ", ".join(missing[:5]) + (f" (+{len(missing) - 5} more)" if len(missing) > 5 else "")
        raise WeightLoadError(f"{path}: missing weight(s) {shown}")
