"""Programmatic dependent launch (kernels/pdl.py, TANDEM_PDL=1) changes when the decode step's
Triton kernels start, never what they compute: each kernel launched as a dependent equals its
normal launch bit for bit, back to back and inside a CUDA graph. Hopper only (sm_90+)."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available()
                                 or torch.cuda.get_device_capability()[0] < 9,
                                 reason="needs a Hopper GPU")]
pytest.importorskip("triton")

DEV = "cuda"


def _chain(x, w1, w2, rows_w, res, norm, pos, cos, sin, cache, slots):
    """gemv (norm prologue) -> gemv (residual) -> multi-row gemv -> rope + store: every kernel
    reads the one before, as in a layer."""
    from tandem.engine.kernels import triton_gemv, triton_ops

    h = triton_gemv.gemv(x, w1, norm_weight=norm, eps=1e-5)  # [1, N]
    y = triton_gemv.gemv(h, w2, residual=res)  # [1, K]
    z = triton_gemv.gemv(y.expand(5, -1).contiguous(), rows_w)  # [5, 256]
    q = z[:, :128].reshape(5, 2, 64).contiguous()
    k = z[:, 128:192].reshape(5, 1, 64).contiguous()
    v = z[:, 192:].reshape(5, 1, 64).contiguous()
    qr = triton_ops.rotary_store(pos, q, k, v, cos, sin, cache, slots)
    return y, z, qr, cache.clone()


def test_pdl_launches_equal_normal_launches(monkeypatch):
    from tandem.engine.kernels import pdl

    g = torch.Generator(DEV).manual_seed(0)
    bf = dict(device=DEV, dtype=torch.bfloat16)
    x = torch.randn(1, 1024, generator=g, device=DEV).bfloat16()
    w1 = torch.randn(3072, 1024, generator=g, device=DEV).bfloat16() * 0.02
    w2 = torch.randn(1024, 3072, generator=g, device=DEV).bfloat16() * 0.02
    rows_w = torch.randn(256, 1024, generator=g, device=DEV).bfloat16() * 0.02
    res = torch.randn(1, 1024, generator=g, device=DEV).bfloat16()
    norm = (1 + 0.1 * torch.randn(1024, generator=g, device=DEV)).bfloat16()
    pos = torch.arange(5, device=DEV)
    inv = 1.0 / (10000 ** (torch.arange(0, 64, 2, device=DEV).float() / 64))
    ang = torch.arange(64, device=DEV).float()[:, None] * inv[None, :]
    cos, sin = ang.cos().contiguous(), ang.sin().contiguous()  # [64, 32]
    slots = torch.arange(3, 8, device=DEV)

    def run(enabled: bool, graph: bool):
        monkeypatch.setattr(pdl, "ENABLED", enabled)
        cache = torch.zeros(4, 2, 4, 1, 64, **bf)
        args = (x, w1, w2, rows_w, res, norm, pos, cos, sin, cache, slots)
        _chain(*args)  # tune and compile outside the capture
        if not graph:
            return _chain(*args)
        cache.zero_()
        gr = torch.cuda.CUDAGraph()
        with torch.cuda.graph(gr):
            out = _chain(*args)
        cache.zero_()
        gr.replay()
        torch.cuda.synchronize()
        return tuple(t.clone() for t in out[:3]) + (cache.clone(),)

    for graph in (False, True):
        want, got = run(False, graph), run(True, graph)
        for a, b in zip(got, want):
            assert torch.equal(a, b), f"graph={graph}"
