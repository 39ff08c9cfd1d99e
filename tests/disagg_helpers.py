"""A tiny target checkpoint plus a dummy EAGLE head saved as a head directory, and the worker
configs tests build the disaggregated system from."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from hf_tiny import save_tiny
from tandem.deploy.worker_config import WorkerConfig
from tandem.engine import EngineConfig, ParallelContext, build_model, resolve_model
from tandem.kvtransfer import EndpointConfig
from tandem.spec import DraftHeadConfig, SpecConfig, dummy_head

FAST_ENDPOINT = EndpointConfig(handshake_timeout_s=5.0, timeout_s=10.0, drain_timeout_s=6.0,
                               lease_margin_s=8.0)


def tiny_model_and_head(root: Path, kind: str = "eagle") -> tuple[Path, Path]:
    model_dir, _ = save_tiny("llama", root)
    ecfg = EngineConfig(model=str(model_dir), dtype="float32")
    mcfg, path = resolve_model(ecfg)
    model = build_model(mcfg, path, ecfg, ParallelContext(), 512)
    head = dummy_head(DraftHeadConfig.like_target(mcfg, kind), model, torch.float32,
                      torch.device("cpu"), 512, seed=5)
    head_dir = root / f"head-{kind}"
    head_dir.mkdir()
    from safetensors.torch import save_file

    save_file(head.state_for_saving(), str(head_dir / "model.safetensors"))
    (head_dir / "config.json").write_text(json.dumps(head.cfg.to_json()))
    return model_dir, head_dir


def worker_config(name: str, model_dir: Path, head_dir: Path, backend: str,
                  spec: SpecConfig | None = None, num_pages: int = 256, **kw) -> WorkerConfig:
    spec = spec or SpecConfig(num_steps=3)
    spec = SpecConfig(draft_model=str(head_dir), num_steps=spec.num_steps, topk=spec.topk,
                      num_draft_tokens=spec.num_draft_tokens)
    return WorkerConfig(
        name=name, engine=EngineConfig(model=str(model_dir), dtype="float32", page_size=4,
                                       num_pages=num_pages),
        spec=spec, transfer_backend=backend, endpoint=FAST_ENDPOINT, transfer_timeout_s=10.0,
        **kw)
