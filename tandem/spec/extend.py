"""From a verify result to the next round: KV compaction of an accepted tree path, the
draft-extend input, and the draft-extend forward that yields the next DraftInput.

Also the draft prefill, which is the same computation over a prompt chunk: pairs
(target feature f_t, token x_{t+1}) at draft positions t.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tandem.engine.attention.metadata import SeqSlice, build_metadata
from tandem.engine.kv_cache import KVPool
from tandem.spec.draft_runner import DraftRunner
from tandem.spec.phases import DraftExtendInput, DraftInput, VerifyInput, VerifyResult


def compact_accepted_path(pool: KVPool, group: str, verify: VerifyInput,
                          result: VerifyResult) -> None:
    """Move the target K/V of accepted tree nodes to consecutive slots after the root, so the
    cache holds the accepted path linearly. A chain is already linear (no-op)."""
    if verify.is_chain:
        return
    ps = pool.page_size
    src, dst = [], []
    for pages, nc, path in zip(verify.page_ids, verify.num_cached, result.path_nodes):
        for j, node in enumerate(path, start=1):
            if node != j:
                src.append(_slot(pages, nc + node, ps))
                dst.append(_slot(pages, nc + j, ps))
    if src:
        device = verify.tokens.device
        pool.move_tokens(group, torch.tensor(src, device=device), torch.tensor(dst, device=device))


def _slot(pages: Sequence[int], position: int, page_size: int) -> int:
    return pages[position // page_size] * page_size + position % page_size


def make_extend_input(verify: VerifyInput, result: VerifyResult,
                      features: torch.Tensor) -> DraftExtendInput:
    """features: [bs * N, F] target features of the verify forward, request-major."""
    n = verify.num_nodes
    rows = [r * n + node for r, path in enumerate(result.path_nodes) for node in (0, *path)]
    index = torch.tensor(rows, dtype=torch.int64, device=features.device)
    return DraftExtendInput(page_ids=verify.page_ids, num_cached=verify.num_cached,
                            new_tokens=result.new_tokens, features=features[index])


def draft_extend(draft: DraftRunner, ext: DraftExtendInput, topk: int) -> DraftInput:
    """Run the draft over the accepted tokens + bonus; its last row per request proposes the
    next round's first level. The new DraftInput has num_cached advanced by a + 1."""
    device = ext.features.device
    layout = build_metadata(
        [SeqSlice(page_ids=p, num_cached=nc, num_new=len(toks))
         for p, nc, toks in zip(ext.page_ids, ext.num_cached, ext.new_tokens)],
        draft.kv_pool.page_size, device,
    )
    tokens = torch.tensor([t for toks in ext.new_tokens for t in toks], dtype=torch.int64,
                          device=device)
    hidden = draft.forward(tokens, ext.features, layout)  # [sum(a+1), H]
    last = layout.attn.qo_indptr_cpu[1:].to(torch.int64) - 1
    last_hidden = hidden[last.to(device)]  # [bs, H]
    ids, logp = draft.head.topk(last_hidden, topk)
    return DraftInput(
        page_ids=ext.page_ids,
        num_cached=tuple(nc + len(t) for nc, t in zip(ext.num_cached, ext.new_tokens)),
        last_tokens=torch.tensor([t[-1] for t in ext.new_tokens], dtype=torch.int64,
                                 device=device),
        topk_ids=ids, topk_logp=logp, hidden=last_hidden,
    )


def draft_prefill(
    draft: DraftRunner, page_ids: Sequence[Sequence[int]], starts: Sequence[int],
    next_tokens: Sequence[Sequence[int]], features: torch.Tensor,
) -> torch.Tensor:
    """Draft over prompt chunks: request r's chunk covers target positions starts[r] ..
    starts[r] + len(next_tokens[r]) - 1; next_tokens[r] are x_{t+1} for those t (the last one
    may be the freshly sampled first token); features [sum, F] are the target features of the
    chunk's rows. Returns the draft hidden [sum, H]."""
    layout = build_metadata(
        [SeqSlice(page_ids=p, num_cached=s, num_new=len(t))
         for p, s, t in zip(page_ids, starts, next_tokens)],
        draft.kv_pool.page_size, features.device,
    )
    tokens = torch.tensor([t for toks in next_tokens for t in toks], dtype=torch.int64,
                          device=features.device)
    return draft.forward(tokens, features, layout)
