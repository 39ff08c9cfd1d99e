"""The phases of one speculative round, as frozen values (docs/architecture.md, "Phases are
values").

    RoundInput (planned by the SpecScheduler) = DraftInput + how each request samples
    DraftInput --propose--> VerifyInput --target forward + accept--> VerifyResult
        --make_extend_input--> DraftExtendInput --draft forward--> DraftInput (next round)

Each object is built once by a function and consumed once by the next; nothing is mutated in
place, and no field is backed up and restored. Per-request state between rounds lives in a
`DraftSeed` (one row of a DraftInput), owned by the request table.

Conventions for one request with committed tokens x_0 .. x_{L-1}:
- the target KV holds x_0 .. x_{L-2}: `num_cached = L - 1`; x_{L-1} is `last_token`;
- the draft KV holds pairs (f_t, x_{t+1}) for t < L - 1 at draft position t (same page table,
  same slot index as the target's position t);
- `topk_ids` are the draft's first-level proposals for x_L, made from `hidden`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tandem.engine.h2d import tensor as h2d_tensor
from tandem.messages import SamplingParams, TokenLogprob


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class DraftSeed:
    """One request's speculative state between rounds (and the EAGLE seed a prefill worker
    hands to a decode worker)."""

    num_cached: int  # target tokens in the KV cache (committed - 1)
    last_token: int  # committed, not yet in the target KV
    topk_ids: torch.Tensor  # [topk] int64 target ids proposed for the next position
    topk_logp: torch.Tensor  # [topk] float32 their draft log-probabilities
    hidden: torch.Tensor  # [H] draft hidden that proposed them (input of the next draft step)
    # (batch, row) when this seed is row `row` of `batch` (`DraftInput.seeds`): a round over
    # exactly that batch's seeds, in order, takes its tensors instead of stacking the rows
    row_of: tuple[DraftInput, int] | None = None


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class DraftInput:
    """A batch of seeds, ready for drafting."""

    page_ids: tuple[tuple[int, ...], ...]  # per request, its page table
    num_cached: tuple[int, ...]  # [bs]
    last_tokens: torch.Tensor  # [bs] int64
    topk_ids: torch.Tensor  # [bs, topk] int64
    topk_logp: torch.Tensor  # [bs, topk] float32
    hidden: torch.Tensor  # [bs, H]
    # [bs] the same last tokens on the host when the builder knew them (then `seeds` needs no
    # device read); None = read `last_tokens`.
    last_token_ids: tuple[int, ...] | None = None

    @property
    def batch_size(self) -> int:
        return len(self.num_cached)

    @staticmethod
    def from_seeds(seeds: Sequence[DraftSeed], page_ids: Sequence[Sequence[int]]) -> DraftInput:
        last = tuple(s.last_token for s in seeds)
        src = seeds[0].row_of[0] if seeds and seeds[0].row_of is not None else None
        if src is not None and src.batch_size == len(seeds) and all(
                s.row_of is not None and s.row_of[0] is src and s.row_of[1] == i
                for i, s in enumerate(seeds)):  # the last round's batch again: no stacking
            return DraftInput(
                page_ids=tuple(tuple(p) for p in page_ids), num_cached=src.num_cached,
                last_tokens=src.last_tokens, topk_ids=src.topk_ids, topk_logp=src.topk_logp,
                hidden=src.hidden, last_token_ids=last)
        return DraftInput(
            page_ids=tuple(tuple(p) for p in page_ids),
            num_cached=tuple(s.num_cached for s in seeds),
            last_tokens=h2d_tensor(last, torch.int64, seeds[0].hidden.device),  # no sync
            topk_ids=torch.stack([s.topk_ids for s in seeds]),
            topk_logp=torch.stack([s.topk_logp for s in seeds]),
            hidden=torch.stack([s.hidden for s in seeds]),
            last_token_ids=last,
        )

    def seeds(self) -> list[DraftSeed]:
        last = self.last_token_ids
        if last is None:
            last = self.last_tokens.tolist()  # SYNC: only when no builder knew them
        # (row views by `unbind`: one call a tensor, not an index a row -- a round's host path)
        ids, logp, hidden = self.topk_ids.unbind(0), self.topk_logp.unbind(0), self.hidden.unbind(0)
        return [DraftSeed(num_cached=self.num_cached[i], last_token=last[i], topk_ids=ids[i],
                          topk_logp=logp[i], hidden=hidden[i], row_of=(self, i))
                for i in range(self.batch_size)]


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class RoundInput:
    """Everything one speculative round needs, and nothing of the scheduling around it: the
    `SpecScheduler` builds it for requests that already hold pages for every KV slot the round
    may write (num_cached + SpecConfig.slots_per_round)."""

    req_ids: tuple[str, ...]  # [bs] row order of every phase of the round
    params: tuple[SamplingParams, ...]  # [bs] how the target's token is chosen (acceptance)
    generators: tuple[torch.Generator | None, ...]  # [bs] a seeded row's own RNG, else None
    draft: DraftInput  # [bs] the requests' seeds with their page tables
    # k: chain drafts this round proposes, 0 .. SpecConfig.num_steps (0: a plain step -- the
    # root alone is verified, then draft-extended, so the next seed is valid as after any round)
    num_drafts: int


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class VerifyInput:
    """A token tree per request to verify with one target forward. Node 0 is the root
    (`last_token`); a chain is the tree whose parents are 0, 1, 2, ...

    Node j of request r is written at target position num_cached[r] + j of its page table;
    its rope position is num_cached[r] + depth[j]."""

    page_ids: tuple[tuple[int, ...], ...]
    num_cached: tuple[int, ...]  # [bs]
    tokens: torch.Tensor  # [bs, N] int64
    parents: tuple[tuple[int, ...], ...]  # [bs][N], -1 for the root
    depths: tuple[tuple[int, ...], ...]  # [bs][N], 0 for the root

    @property
    def batch_size(self) -> int:
        return len(self.num_cached)

    @property
    def num_nodes(self) -> int:
        return self.tokens.shape[1]

    @property
    def is_chain(self) -> bool:
        return all(p == tuple(range(-1, len(p) - 1)) for p in self.parents)


@dataclass(frozen=True, slots=True, kw_only=True)
class VerifyResult:
    """What the target accepted, per request. Plain ints: the commit step and the stop checks
    read them on the host anyway (one sync per round)."""

    path_nodes: tuple[tuple[int, ...], ...]  # accepted draft nodes in order (root excluded)
    new_tokens: tuple[tuple[int, ...], ...]  # accepted draft tokens + the bonus token
    # [bs] "" for a row accepted normally; else why its request fails (that row's path and
    # tokens are placeholders the round's batched work may use, never committed). () = none.
    errors: tuple[str, ...] = ()
    # [bs][len(new_tokens[r])] each new token's logprob from the verify forward's target
    # distribution (messages/logprobs.py), for the rows whose request asks; () for a row that
    # does not, () for all when none does.
    logprobs: tuple[tuple[TokenLogprob, ...], ...] = ()

    def error_of(self, row: int) -> str:
        return self.errors[row] if self.errors else ""

    def logprobs_of(self, row: int) -> tuple[TokenLogprob, ...]:
        return self.logprobs[row] if self.logprobs else ()

    @property
    def num_accepted(self) -> tuple[int, ...]:
        return tuple(len(p) for p in self.path_nodes)


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class DraftExtendInput:
    """Run the draft over exactly the accepted tokens plus the bonus token, so its KV follows
    the accepted path: request r feeds pairs (f, x) at draft positions num_cached[r] ..
    num_cached[r] + len(new_tokens[r]) - 1, where f are the target features of the root and
    the accepted nodes."""

    page_ids: tuple[tuple[int, ...], ...]
    num_cached: tuple[int, ...]  # [bs] same as the round's (first extend position)
    new_tokens: tuple[tuple[int, ...], ...]  # [bs][a_r + 1]
    features: torch.Tensor  # [sum_r (a_r + 1), F] target features, request-major


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class ExtendOutput:
    """The draft-extend graph's result for the real rows: the next round's first level. New
    tensors (the graph's static outputs are copied out)."""

    hidden: torch.Tensor  # [bs, H] draft hidden of each request's bonus row
    topk_ids: torch.Tensor  # [bs, topk] int64 target ids it proposes
    topk_logp: torch.Tensor  # [bs, topk] float32 their draft log-probabilities
    last_tokens: torch.Tensor  # [bs] int64 the bonus tokens
