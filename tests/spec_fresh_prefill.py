"""The cache invariant of the speculative engine, as the tests of its phases check it: after any
step, every request's target KV, draft KV and draft seed equal what a fresh engine computes by
prefilling the request's committed tokens (same weights, a pool of its own, other page ids)."""

from __future__ import annotations

import torch
from spec_helpers import engine_cfg, slot

from tandem.engine import ForwardBatch, SeqSlice, build_metadata
from tandem.spec import DRAFT_GROUP, SpecConfig, SpecEngine, draft_prefill, target_features


def assert_seeds_equal_a_fresh_prefill(eng: SpecEngine, spec: SpecConfig, model, head) -> None:
    """For each request with a seed in `eng`: its seed covers every committed token but the
    last (which the seed carries), and the KV of both groups at those positions, the seed's
    hidden state and its top-k draft ids equal a fresh prefill's (float32, within 1e-4)."""
    fresh = SpecEngine(engine_cfg(), spec, model, head)
    page = eng.cfg.page_size
    for rid, seed in eng.seeds.items():
        req = eng.scheduler.requests[rid]
        nc, ids = seed.num_cached, req.all_ids
        assert nc == req.num_computed == len(ids) - 1 and seed.last_token == ids[-1], rid
        pages = fresh.allocator.alloc(-(-(nc + 1) // page))
        lay = build_metadata([SeqSlice(page_ids=pages, num_cached=0, num_new=nc)], page)
        out = fresh.runner.forward(ForwardBatch(
            input_ids=torch.tensor(ids[:nc]), positions=lay.positions, attn=lay.attn,
            logits_indices=torch.tensor([nc - 1]), capture_layers=fresh.capture))
        hidden = draft_prefill(fresh.draft, [pages], [0], [ids[1 : nc + 1]],
                               target_features(out, head))
        got_slots = torch.tensor([slot(req.page_ids, t, page) for t in range(nc)])
        want_slots = torch.tensor([slot(pages, t, page) for t in range(nc)])
        for group in ("target", DRAFT_GROUP):
            got = eng.kv_pool.group_tensor(group)[:, got_slots // page, :, got_slots % page]
            want = fresh.kv_pool.group_tensor(group)[:, want_slots // page, :, want_slots % page]
            torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4,
                                       msg=lambda m, w=f"{rid} {group} KV": f"{w}: {m}")
        torch.testing.assert_close(seed.hidden, hidden[nc - 1], atol=1e-4, rtol=1e-4)
        ids_fresh, _ = head.topk(hidden[nc - 1 : nc], spec.topk)
        assert torch.equal(seed.topk_ids, ids_fresh[0]), rid
