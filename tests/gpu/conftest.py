"""GPU tests: everything under tests/gpu (and anything marked `gpu`) is skipped cleanly on a
machine without CUDA. FlashInfer-only tests additionally skip when flashinfer is missing."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

_HERE = Path(__file__).parent


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU (torch.cuda.is_available() is False)")
    for item in items:
        if "gpu" in item.keywords or _HERE in Path(item.path).parents:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _inference_mode():
    """GPU tests run as serving does, without autograd: kernels/ops.py keeps the Triton
    kernels for inference only, so an eager piece a test calls outside the engine's step
    (e.g. head.topk) takes the same kernels as the CUDA graph it is compared with."""
    with torch.inference_mode():
        yield
