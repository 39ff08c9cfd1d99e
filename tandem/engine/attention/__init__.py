"""Attention: per-forward metadata builders and the backends that consume them."""

from tandem.engine.attention.backend import (
    AttentionBackend,
    AttentionShape,
    available_backends,
    create_backend,
)
from tandem.engine.attention.metadata import (
    AttentionMetadata,
    BatchLayout,
    SeqSlice,
    build_metadata,
    causal_mask,
    tree_mask,
)

__all__ = [
    "AttentionBackend",
    "AttentionMetadata",
    "AttentionShape",
    "BatchLayout",
    "SeqSlice",
    "available_backends",
    "build_metadata",
    "causal_mask",
    "create_backend",
    "tree_mask",
]
