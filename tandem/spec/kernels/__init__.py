"""Speculative bookkeeping kernels: Triton on CUDA, torch twins elsewhere (see `ops`)."""

from tandem.spec.kernels.ops import extend_inputs, extend_rows, greedy_accept, tree_mask

__all__ = ["extend_inputs", "extend_rows", "greedy_accept", "tree_mask"]
