"""The attention backend interface and its registry.

A backend turns frozen `AttentionMetadata` into a plan once per forward (`plan`), then every
layer calls `forward(plan, kv_cache, q, k, v)`, which writes the new K/V into the layer's pages
and returns the attention output. Layers never plan. GPU-only backends are imported lazily, so
importing tandem on a CPU machine never touches FlashInfer.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from tandem.engine.attention.metadata import AttentionMetadata


@dataclass(frozen=True, slots=True, kw_only=True)
class AttentionShape:
    """The per-rank attention geometry a backend plans for (fixed for a model)."""

    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype  # of q, k, v and the KV pages
    scale: float  # softmax scale, head_dim ** -0.5 for every supported family


class AttentionBackend(Protocol):
    name: str

    def plan(self, meta: AttentionMetadata) -> Any:
        """Prepare one forward (host work, workspace planning). The result is opaque to callers
        and valid only for this forward."""

    def forward(
        self,
        plan: Any,
        kv_cache: torch.Tensor,  # [num_pages, 2, page_size, Hkv, D] this layer's pages
        q: torch.Tensor,  # [T, Hq, D]
        k: torch.Tensor,  # [T, Hkv, D]
        v: torch.Tensor,  # [T, Hkv, D]
        scale: float,
    ) -> torch.Tensor:  # [T, Hq, D]
        ...

    # Optional: `kv_slots(plan) -> Tensor [T] int64` offers layers to write the new K/V
    # themselves (fused with rope) at those slots; they then pass k = v = None to `forward`.
    # Backends without it (the reference) always receive k and v.


# name -> "module:Class"; modules load on first use.
_REGISTRY: dict[str, str] = {
    "torch": "tandem.engine.attention.torch_ref:TorchReferenceBackend",
    "flashinfer": "tandem.engine.attention.flashinfer_backend:FlashInferBackend",
}


def available_backends() -> tuple[str, ...]:
    return tuple(_REGISTRY)


def create_backend(
    name: str, device: torch.device, shape: AttentionShape | None = None
) -> AttentionBackend:
    """`auto` picks FlashInfer on CUDA and the torch reference elsewhere. `shape` is required
    by backends that plan kernels ahead (FlashInfer); the reference ignores it."""
    if name == "auto":
        name = "flashinfer" if device.type == "cuda" else "torch"
    if name not in _REGISTRY:
        raise ValueError(f"attention_backend: unknown '{name}' (known: {', '.join(_REGISTRY)})")
    module_name, cls_name = _REGISTRY[name].split(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise RuntimeError(f"attention backend '{name}' is not available here: {exc}") from exc
    return getattr(module, cls_name)(device=device, shape=shape)
