"""Verification: which drafted tokens the target accepts, and the bonus token.

Walk the tree from the root. At node c the target's distribution for the next token is
p = target_probs(logits[c], params) -- the same function the plain sampler uses.

- Greedy: move to the child whose token is argmax p; stop when none matches. The bonus token
  is argmax p at the last node. Output == the target's greedy output, token for token.
- Sampling (target-only rejection, lossless for any choice of draft candidates): try the
  children in draft-score order; accept child t with probability p(t); on rejection set
  p(t) = 0 and renormalize; if every child is rejected (or there is none), draw the bonus token
  from the remaining p. By induction P(emit t) = p(t): the first child is emitted with
  probability p(t1), any other t with (1 - p(t1)) * p(t) / (1 - p(t1)) = p(t).

A row whose walk raises fails its own request only (`VerifyResult.errors`), as in the sampler.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from tandem.engine.h2d import tensor as h2d_tensor
from tandem.engine.config import SamplingFault
from tandem.engine.sampling import SamplingParams, check_fault, row_error, target_probs
from tandem.spec import kernels as spec_kernels
from tandem.spec.phases import VerifyInput, VerifyResult


def children_of(parents: Sequence[int]) -> list[list[int]]:
    kids: list[list[int]] = [[] for _ in parents]
    for j, p in enumerate(parents):
        if p >= 0:
            kids[p].append(j)
    return kids


def accept(
    verify: VerifyInput,
    logits: torch.Tensor,  # [bs * N, V] float32, request-major, node order of `verify`
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
    req_ids: Sequence[str] = (),  # [bs] the test-only fault hook's key; () = no fault checks
    fault: SamplingFault | None = None,
) -> VerifyResult:
    n = verify.num_nodes
    if all(p.greedy for p in params):
        return with_row_faults(launch_greedy_accept(verify, logits).result(), req_ids, fault)
    argmax = logits.argmax(dim=-1).view(verify.batch_size, n)
    # SYNC: the one host read of the round: draft tokens and target argmax together.
    both = torch.stack([verify.tokens, argmax]).tolist()
    tokens_h, argmax_h = both[0], both[1]
    paths, new_tokens, errors = [], [], [""] * verify.batch_size
    for r in range(verify.batch_size):
        kids = children_of(verify.parents[r])
        try:
            if req_ids:
                check_fault(fault, req_ids[r])
            if params[r].greedy:
                path, bonus = _walk_greedy(tokens_h[r], argmax_h[r], kids)
            else:
                path, bonus = _walk_sampled(tokens_h[r], logits[r * n : (r + 1) * n], kids,
                                            params[r], generators[r])
        except Exception as exc:  # noqa: BLE001 -- this row's request fails, alone
            path, bonus = [], argmax_h[r][0]  # a placeholder for the round's batched work
            errors[r] = row_error("acceptance", exc)
        paths.append(tuple(path))
        new_tokens.append(tuple(tokens_h[r][c] for c in path) + (bonus,))
    return VerifyResult(path_nodes=tuple(paths), new_tokens=tuple(new_tokens),
                        errors=tuple(errors) if any(errors) else ())


def with_row_faults(result: VerifyResult, req_ids: Sequence[str],
                    fault: SamplingFault | None) -> VerifyResult:
    """A batch accepted on the device (greedy) has no host walk per row: the test-only fault
    hook marks the rows it selects failed here (their path stays, as a placeholder)."""
    if fault is None or not req_ids:
        return result
    errors = [""] * len(req_ids)
    for r, rid in enumerate(req_ids):
        try:
            check_fault(fault, rid)
        except Exception as exc:  # noqa: BLE001
            errors[r] = row_error("acceptance", exc)
    return replace(result, errors=tuple(errors)) if any(errors) else result


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class GreedyAcceptance:
    """Greedy acceptance of a whole batch, computed on the device; its host copy is in flight
    (`result` waits for it). Work queued after `launch_greedy_accept` -- the draft-extend
    graph -- runs on the GPU while the host reads the result and commits."""

    num_accepted: torch.Tensor  # [bs] int32 accepted drafts per request
    path: torch.Tensor  # [bs, depth] int32 accepted nodes in order, -1 past the end
    bonus: torch.Tensor  # [bs] int64 the target's token after the accepted path
    depth: int  # the deepest node any tree of the batch has
    rows_host: torch.Tensor  # [bs, 2 + 2 * depth] int64 on the host (pinned on CUDA)
    ready: Any  # torch.cuda.Event recorded after the device->host copy; None on CPU

    def result(self) -> VerifyResult:
        if self.ready is not None:
            # SYNC: the round's one host read -- waits for the acceptance kernel and the copy,
            # not for whatever was queued after them.
            self.ready.synchronize()
        d = self.depth
        paths, new_tokens = [], []
        for row in self.rows_host.tolist():
            a = row[0]
            paths.append(tuple(row[2 : 2 + a]))
            new_tokens.append(tuple(row[2 + d : 2 + d + a]) + (row[1],))
        return VerifyResult(path_nodes=tuple(paths), new_tokens=tuple(new_tokens))


def launch_greedy_accept(verify: VerifyInput, logits: torch.Tensor) -> GreedyAcceptance:
    """An all-greedy batch: the walk (`_walk_greedy` for every request) runs on the device --
    one Triton kernel on CUDA -- and one device->host copy of what the commit needs (accepted
    lengths, bonus tokens, paths, tokens) is queued without waiting for it. Nothing here
    copies host data to the device synchronously."""
    n, bs = verify.num_nodes, verify.batch_size
    argmax = logits.argmax(dim=-1).view(bs, n)
    depth = max(max(d) for d in verify.depths)  # the longest path any tree allows
    parents = h2d_tensor(verify.parents, torch.int32, argmax.device)  # [bs, N]
    num, path, bonus = spec_kernels.greedy_accept(verify.tokens, argmax, parents, depth)
    path_tokens = verify.tokens.gather(1, path.long().clamp(min=0))  # [bs, depth]
    rows = torch.cat([num.long()[:, None], bonus[:, None], path.long(), path_tokens], dim=1)
    ready = None
    if rows.is_cuda:
        host = torch.empty(rows.shape, dtype=rows.dtype, pin_memory=True)
        host.copy_(rows, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record()
        rows = host
    return GreedyAcceptance(num_accepted=num, path=path, bonus=bonus, depth=depth,
                            rows_host=rows, ready=ready)


def _walk_greedy(tokens: list[int], argmax: list[int], kids: list[list[int]]
                 ) -> tuple[list[int], int]:
    node, path = 0, []
    while True:
        nxt = next((c for c in kids[node] if tokens[c] == argmax[node]), None)
        if nxt is None:
            return path, argmax[node]
        path.append(nxt)
        node = nxt


def _walk_sampled(
    tokens: list[int], logits: torch.Tensor, kids: list[list[int]], params: SamplingParams,
    gen: torch.Generator | None,
) -> tuple[list[int], int]:
    node, path = 0, []
    while True:
        p = target_probs(logits[node], params)  # [V]
        moved = False
        for c in kids[node]:  # children are stored in draft-score order
            t = tokens[c]
            u = torch.rand((), generator=gen, device=p.device)
            if u < p[t]:
                path.append(c)
                node, moved = c, True
                break
            p = p.clone()
            p[t] = 0.0
            total = p.sum()
            if not total > 0:
                # u < 1 always accepts p(t) = 1, so the rest of p has mass; float32 can still
                # round a p(t) just below 1 up to leave none: then t is the answer (not NaN).
                return path, t
            p = p / total
        if not moved:
            return path, int(torch.multinomial(p, 1, generator=gen)[0])
