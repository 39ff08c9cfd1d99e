"""From a verify result to the next round: KV compaction of an accepted tree path, the
draft-extend input, and the draft-extend forward that yields the next DraftInput.

Also the draft prefill, which is the same computation over a prompt chunk: pairs
(target feature f_t, token x_{t+1}) at draft positions t.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tandem.engine import h2d
from tandem.engine.attention.metadata import SeqSlice
from tandem.engine.h2d import build_layout
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
        pool.move_tokens(group, h2d.tensor(src, torch.int64, device),
                         h2d.tensor(dst, torch.int64, device))


def _slot(pages: Sequence[int], position: int, page_size: int) -> int:
    return pages[position // page_size] * page_size + position % page_size


def make_extend_input(verify: VerifyInput, result: VerifyResult,
                      features: torch.Tensor) -> DraftExtendInput:
    """features: [bs * N, F] target features of the verify forward, request-major."""
    n = verify.num_nodes
    rows = [r * n + node for r, path in enumerate(result.path_nodes) for node in (0, *path)]
    index = h2d.tensor(rows, torch.int64, features.device)
    return DraftExtendInput(page_ids=verify.page_ids, num_cached=verify.num_cached,
                            new_tokens=result.new_tokens, features=features[index])


def draft_extend(draft: DraftRunner, ext: DraftExtendInput, topk: int) -> DraftInput:
    """Run the draft over the accepted tokens + bonus; its last row per request proposes the
    next round's first level. The new DraftInput has num_cached advanced by a + 1."""
    device = ext.features.device
    layout = build_layout(
        [SeqSlice(page_ids=p, num_cached=nc, num_new=len(toks))
         for p, nc, toks in zip(ext.page_ids, ext.num_cached, ext.new_tokens)],
        draft.kv_pool.page_size, device,
    )
    tokens = h2d.tensor([t for toks in ext.new_tokens for t in toks], torch.int64, device)
    hidden = draft.forward(tokens, ext.features, layout)  # [sum(a+1), H]
    last = h2d.to_device(layout.attn.qo_indptr_cpu[1:].to(torch.int64) - 1, device)
    last_hidden = hidden[last]  # [bs, H]
    ids, logp = draft.head.topk(last_hidden, topk)
    last_ids = tuple(t[-1] for t in ext.new_tokens)
    return DraftInput(
        page_ids=ext.page_ids,
        num_cached=tuple(nc + len(t) for nc, t in zip(ext.num_cached, ext.new_tokens)),
        last_tokens=h2d.tensor(last_ids, torch.int64, device),
        topk_ids=ids, topk_logp=logp, hidden=last_hidden, last_token_ids=last_ids,
    )


def next_draft_input(verify: VerifyInput, result: VerifyResult, hidden: torch.Tensor,
                     topk_ids: torch.Tensor, topk_logp: torch.Tensor,
                     last_tokens: torch.Tensor) -> DraftInput:
    """The next round's DraftInput from a draft-extend that ran on the device (the graph):
    hidden [bs, H], topk_ids / topk_logp [bs, topk] of each request's bonus row, last_tokens
    [bs] int64 the bonus tokens; num_cached advanced by a + 1 from the host result (the same
    values `draft_extend` returns)."""
    return DraftInput(
        page_ids=verify.page_ids,
        num_cached=tuple(nc + len(t) for nc, t in zip(verify.num_cached, result.new_tokens)),
        last_tokens=last_tokens, topk_ids=topk_ids, topk_logp=topk_logp, hidden=hidden,
        last_token_ids=tuple(t[-1] for t in result.new_tokens),
    )


def draft_prefill(
    draft: DraftRunner, page_ids: Sequence[Sequence[int]], starts: Sequence[int],
    next_tokens: Sequence[Sequence[int]], features: torch.Tensor,
) -> torch.Tensor:
    """Draft over prompt chunks: request r's chunk covers target positions starts[r] ..
    starts[r] + len(next_tokens[r]) - 1; next_tokens[r] are x_{t+1} for those t (the last one
    may be the freshly sampled first token); features [sum, F] are the target features of the
    chunk's rows. Returns the draft hidden [sum, H]."""
    layout = build_layout(
        [SeqSlice(page_ids=p, num_cached=s, num_new=len(t))
         for p, s, t in zip(page_ids, starts, next_tokens)],
        draft.kv_pool.page_size, features.device,
    )
    tokens = h2d.tensor([t for toks in next_tokens for t in toks], torch.int64,
                        features.device)
    return draft.forward(tokens, features, layout)
