"""Speculative bookkeeping kernels: Triton on CUDA, torch twins elsewhere (see `ops`)."""

from tandem.spec.kernels.ops import (
    accept_chain_into,
    extend_inputs,
    extend_rows,
    greedy_accept,
    tree_mask,
)

__all__ = ["accept_chain_into", "extend_inputs", "extend_rows", "greedy_accept", "tree_mask"]
