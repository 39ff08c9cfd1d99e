"""Shared set-up for CPU tests that run Triton kernels through TRITON_INTERPRET=1."""

from __future__ import annotations

import os

import pytest
import torch


def require_triton_interpreter() -> None:
    """Call at module level, before anything imports triton: skips the module on a CUDA
    machine (the interpreter flag is process-wide; tests/gpu covers the compiled kernels),
    without triton or numpy, or when triton was imported before the flag could be set."""
    if torch.cuda.is_available():
        pytest.skip("CUDA machine: tests/gpu runs the compiled kernels", allow_module_level=True)
    os.environ.setdefault("TRITON_INTERPRET", "1")
    pytest.importorskip("triton")
    pytest.importorskip("numpy")
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("triton was imported before TRITON_INTERPRET could be set",
                    allow_module_level=True)
