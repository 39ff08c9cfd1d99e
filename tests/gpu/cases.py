"""Attention cases shared by tests/gpu and benchmarks/gpu_engine.py: the FlashInfer backend and the
torch reference run on the same metadata, pages and q/k/v (the reference in float32)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tandem.engine.attention import AttentionShape, SeqSlice, build_metadata, tree_mask

# (num_cached, num_new or a tree given as parent indices)
SeqSpec = tuple[int, "int | tuple[int, ...]"]


@dataclass(frozen=True, slots=True)
class AttnCase:
    name: str
    seqs: tuple[SeqSpec, ...]


CASES = (
    AttnCase("decode_ragged", ((0, 1), (16, 1), (40, 1), (99, 1), (3000, 1))),
    AttnCase("decode_long_bs1", ((4095, 1),)),
    AttnCase("prefill_ragged", ((0, 37), (20, 5), (0, 1), (64, 16), (15, 17))),
    AttnCase("verify_tree", ((30, (-1, 0, 0, 1, 2)), (7, (-1, 0, 1, 2)), (12, 4))),
)
HEADS = {64: (9, 3), 128: (32, 8)}  # head_dim -> (query heads, KV heads): SmolLM2, Llama-8B


@dataclass(frozen=True, slots=True)
class CaseResult:
    name: str
    page_size: int
    head_dim: int
    rel_err: float  # ||out - ref|| / ||ref||
    max_abs_err: float
    cache_equal: bool  # both backends wrote the same K/V into the same slots


def _slices(seqs: Sequence[SeqSpec], page_size: int, gen: torch.Generator) -> list[SeqSlice]:
    need = [-(-(c + (n if isinstance(n, int) else len(n))) // page_size) for c, n in seqs]
    pages = (torch.randperm(sum(need), generator=gen) + 1).tolist()  # page 0 is scratch
    out, start = [], 0
    for (cached, new), n_pages in zip(seqs, need):
        ids = pages[start : start + n_pages]
        start += n_pages
        if isinstance(new, int):
            out.append(SeqSlice(page_ids=ids, num_cached=cached, num_new=new))
        else:
            depth = [0] * len(new)
            for j, p in enumerate(new):
                depth[j] = 0 if p < 0 else depth[p] + 1
            out.append(SeqSlice(page_ids=ids, num_cached=cached, num_new=len(new),
                                mask=tree_mask(cached, new),
                                positions=[cached + d for d in depth]))
    return out


def run_case(case: AttnCase, page_size: int, head_dim: int, seed: int = 0) -> CaseResult:
    from tandem.engine.attention.flashinfer_backend import FlashInferBackend
    from tandem.engine.attention.torch_ref import TorchReferenceBackend

    dev = torch.device("cuda")
    gen = torch.Generator().manual_seed(seed)
    hq, hkv = HEADS[head_dim]
    slices = _slices(case.seqs, page_size, gen)
    num_pages = 1 + sum(len(s.page_ids) for s in slices)
    meta = build_metadata(slices, page_size, dev).attn
    t = meta.num_tokens
    cache = torch.randn(num_pages, 2, page_size, hkv, head_dim, generator=gen).to(dev,
                                                                                 torch.bfloat16)
    q, k, v = (torch.randn(t, h, head_dim, generator=gen).to(dev, torch.bfloat16)
               for h in (hq, hkv, hkv))
    scale = head_dim**-0.5
    shape = AttentionShape(num_qo_heads=hq, num_kv_heads=hkv, head_dim=head_dim,
                           dtype=torch.bfloat16, scale=scale)
    fi, ref = FlashInferBackend(dev, shape), TorchReferenceBackend(dev)
    cache_fi, cache_ref = cache.clone(), cache.float()
    out = fi.forward(fi.plan(meta), cache_fi, q, k, v, scale).float()
    want = ref.forward(ref.plan(meta), cache_ref, q.float(), k.float(), v.float(), scale)
    torch.cuda.synchronize()
    return CaseResult(
        name=case.name, page_size=page_size, head_dim=head_dim,
        rel_err=float((out - want).norm() / want.norm()),
        max_abs_err=float((out - want).abs().max()),
        cache_equal=bool(torch.equal(cache_fi.float(), cache_ref)),
    )
