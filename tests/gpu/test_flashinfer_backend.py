"""FlashInfer equals the torch reference (float32) on the same inputs: decode, chunked/ragged
prefill and tree verify, page sizes 1 and 16, head_dim 64 (GQA 3) and 128 (GQA 4)."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.gpu
pytest.importorskip("flashinfer")

from cases import CASES, run_case  # noqa: E402  (tests/gpu is on sys.path via rootdir conftest)


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_flashinfer_matches_reference(case, page_size, head_dim):
    r = run_case(case, page_size, head_dim)
    assert r.cache_equal, "new K/V landed in different slots"
    assert r.rel_err < 1e-2, r  # bf16 operands: 1e-3..1e-2 relative
