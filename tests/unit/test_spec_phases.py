"""`DraftInput.from_seeds`: a round over exactly the last round's seeds, in order, takes that
batch's tensors (no stacking, no upload); any other set of seeds is stacked. Either way the
values are the seeds'."""

from __future__ import annotations

import torch

from tandem.spec.phases import DraftInput, DraftSeed


def _batch(bs: int = 3, topk: int = 2, hidden: int = 5) -> DraftInput:
    g = torch.Generator().manual_seed(bs)
    return DraftInput(
        page_ids=tuple((r, r + 10) for r in range(bs)), num_cached=tuple(7 + r for r in range(bs)),
        last_tokens=torch.arange(100, 100 + bs), topk_ids=torch.randint(0, 50, (bs, topk),
                                                                        generator=g),
        topk_logp=torch.randn(bs, topk, generator=g), hidden=torch.randn(bs, hidden, generator=g),
        last_token_ids=tuple(range(100, 100 + bs)))


def _same_values(got: DraftInput, seeds: list[DraftSeed]) -> None:
    assert got.num_cached == tuple(s.num_cached for s in seeds)
    assert got.last_token_ids == tuple(s.last_token for s in seeds)
    assert got.last_tokens.tolist() == [s.last_token for s in seeds]
    assert torch.equal(got.topk_ids, torch.stack([s.topk_ids for s in seeds]))
    assert torch.equal(got.topk_logp, torch.stack([s.topk_logp for s in seeds]))
    assert torch.equal(got.hidden, torch.stack([s.hidden for s in seeds]))


def test_the_same_batch_again_takes_its_tensors():
    nxt = _batch()
    seeds = nxt.seeds()
    pages = [(1, 2, 3), (4,), (5, 6)]  # pages grow between rounds: the new lists are used
    got = DraftInput.from_seeds(seeds, pages)
    assert got.hidden is nxt.hidden and got.topk_ids is nxt.topk_ids
    assert got.last_tokens is nxt.last_tokens and got.page_ids == tuple(pages)
    _same_values(got, seeds)


def test_other_seeds_are_stacked():
    nxt, other = _batch(), _batch(bs=2)
    seeds = nxt.seeds()
    for pick in ([seeds[1], seeds[0], seeds[2]],  # another order
                 seeds[:2],  # a request left
                 [seeds[0], other.seeds()[1], seeds[2]],  # another batch's seed among them
                 [DraftSeed(num_cached=s.num_cached, last_token=s.last_token, topk_ids=s.topk_ids,
                            topk_logp=s.topk_logp, hidden=s.hidden) for s in seeds]):  # new
        got = DraftInput.from_seeds(pick, [(9,)] * len(pick))
        assert got.hidden is not nxt.hidden
        _same_values(got, pick)
