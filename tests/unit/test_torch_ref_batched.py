"""The reference backend's batched decode path equals its per-sequence oracle path."""

from __future__ import annotations

import torch

from tandem.engine import SeqSlice, build_metadata
from tandem.engine.attention.torch_ref import TorchReferenceBackend


def test_batched_decode_equals_per_sequence():
    g = torch.Generator().manual_seed(0)
    num_pages, ps, hkv, hq, d = 40, 4, 2, 6, 16
    lens = [1, 7, 13, 4, 22]
    seqs, page = [], 1
    for n in lens:
        need = -(-n // ps)
        seqs.append(SeqSlice(page_ids=list(range(page, page + need)), num_cached=n - 1, num_new=1))
        page += need
    meta = build_metadata(seqs, ps).attn
    q = torch.randn(len(lens), hq, d, generator=g)
    k = torch.randn(len(lens), hkv, d, generator=g)
    v = torch.randn(len(lens), hkv, d, generator=g)
    outs = []
    for batched in (True, False):
        cache = torch.randn(num_pages, 2, ps, hkv, d, generator=torch.Generator().manual_seed(1))
        backend = TorchReferenceBackend(torch.device("cpu"), batched_decode=batched)
        plan = backend.plan(meta)
        assert (plan.decode is not None) == batched
        outs.append(backend.forward(plan, cache, q, k, v, d**-0.5))
    torch.testing.assert_close(outs[0], outs[1], atol=1e-5, rtol=1e-5)
