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

Greedy batches (any tree), and on a GPU chains with sampled rows, accept on the device without
a host read until the result (spec/device_accept.py); here, the walk on the host for the rest
(sampled trees; sampled chains on a CPU), one row at a time.

A row whose walk raises fails its own request only (`VerifyResult.errors`), as in the sampler.

Log-probabilities (rows whose request asks; messages/logprobs.py's rule): emitted token j of a
request came from the target's distribution at node (0, *path)[j] -- the root for the first,
accepted node j-1 for the next, the last accepted node for the bonus -- so its value is the
log-softmax of the verify logits there, the same distribution plain decoding samples that
position from. Computed on the device before the round's one host read and read with it: on
the device path for the emitted positions only (`_emitted_logprobs`); for the host walk, at
every node of the asking rows (`node_logprobs`), where a residual draw reads its value with the
draw itself (the read it made anyway).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from tandem.engine import kernels
from tandem.engine.config import SamplingFault
from tandem.engine.d2h import HostCopy
from tandem.engine.h2d import tensor as h2d_tensor
from tandem.engine.logprobs import (HostLogprobs, LogprobRows, asking_rows, pick_logprobs,
                                    repeated_rows)
from tandem.engine.sampling import SamplingParams, check_fault, row_error, target_probs
from tandem.messages import TokenLogprob
from tandem.spec.device_accept import (  # noqa: F401 (DeviceAcceptance, launch_greedy_accept:
    DeviceAcceptance,  # also imported from here)
    launch_device_accept,
    launch_greedy_accept,
)
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
    # On the device: greedy batches anywhere; sampled chains on a GPU, where one batched pass
    # over every node beats a host read per node (on a CPU the walk below, which computes
    # the distributions of the nodes it reaches only, is ~3x faster: 0.1 s against 0.34 s for
    # 16 chains of 5 nodes over 49,152 tokens with top-p).
    pending = (launch_device_accept(verify, logits, params, generators)
               if logits.is_cuda or all(p.greedy for p in params) else None)
    if pending is not None:
        return with_row_faults(pending.result(), req_ids, fault)
    argmax = kernels.row_max(logits)[1].view(verify.batch_size, n)
    nodes = node_logprobs(verify, logits, argmax, params)  # None: no row asks
    both_d = torch.stack([verify.tokens, argmax])  # [2, bs, N]
    host = None
    if nodes is None:
        # SYNC: the one host read of the round: draft tokens and target argmax together.
        both = both_d.tolist()
    else:
        # SYNC: the one host read of the round: draft tokens, target argmax and the logprobs
        # of the rows that ask, together.
        both_h, *lp_h = HostCopy.start((both_d, *nodes.tensors())).wait()
        both, host = both_h.tolist(), nodes.read(lp_h)
    tokens_h, argmax_h = both[0], both[1]
    paths, new_tokens, errors, logprobs = [], [], [""] * verify.batch_size, []
    for r in range(verify.batch_size):
        kids = children_of(verify.parents[r])
        entry = host.entry_of(r) if host is not None else None  # asking rows only
        bonus_lp = None  # a sampled bonus's logprob, from the walk
        try:
            if req_ids:
                check_fault(fault, req_ids[r])
            if params[r].greedy:
                path, bonus = _walk_greedy(tokens_h[r], argmax_h[r], kids)
            else:
                path, bonus, bonus_lp = _walk_sampled(
                    tokens_h[r], logits[r * n : (r + 1) * n], kids, params[r], generators[r],
                    None if entry is None else nodes.walk_view(entry, host))
        except Exception as exc:  # noqa: BLE001 -- this row's request fails, alone
            path, bonus = [], argmax_h[r][0]  # a placeholder for the round's batched work
            errors[r] = row_error("acceptance", exc)
        paths.append(tuple(path))
        new_tokens.append(tuple(tokens_h[r][c] for c in path) + (bonus,))
        logprobs.append(() if entry is None or errors[r] else
                        host.emitted(entry, path, new_tokens[-1], bonus_lp))
    return VerifyResult(path_nodes=tuple(paths), new_tokens=tuple(new_tokens),
                        errors=tuple(errors) if any(errors) else (),
                        logprobs=tuple(logprobs) if host is not None else ())


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class NodeLogprobs:
    """For the host walk: the verify forward's target distribution at every node of the
    requests that ask for logprobs -- whatever the walk emits there, its value is here or (a
    residual draw) read from `lp` by the walk. On the device until read with the walk's
    tokens."""

    reqs: tuple[int, ...]  # [m] the batch rows that ask
    num_nodes: int  # N
    lp: torch.Tensor  # [m * N, V] float32 log-softmax at each node
    # [m * N] per node: `chosen` = the node's argmax (a greedy bonus there), and the top-K
    at_argmax: LogprobRows
    child: torch.Tensor  # [m, N] float32 node c's token under its parent's distribution

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (*self.at_argmax.tensors(), self.child)

    def read(self, host: Sequence[torch.Tensor]) -> HostNodeLogprobs:
        """`host`: the host copies of `tensors()`, waited for."""
        *top, child = host
        return HostNodeLogprobs(reqs=self.reqs, num_nodes=self.num_nodes,
                                top=HostLogprobs.of(self.at_argmax, top), child=child.tolist())

    def walk_view(self, entry: int, host: HostNodeLogprobs) -> WalkLogprobs:
        n = self.num_nodes
        return WalkLogprobs(lp=self.lp[entry * n : (entry + 1) * n], child=host.child[entry])


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class WalkLogprobs:
    """What a sampled walk of an asking row needs to give its bonus token's logprob."""

    lp: torch.Tensor  # [N, V] float32 log-softmax at each node of this row (device)
    child: list[float]  # [N] node c's token under its parent's distribution (host)


@dataclass(frozen=True, slots=True, kw_only=True)
class HostNodeLogprobs:
    """`NodeLogprobs` on the host."""

    reqs: tuple[int, ...]  # [m]
    num_nodes: int
    top: HostLogprobs  # [m * N]
    child: list[list[float]]  # [m][N]

    def entry_of(self, row: int) -> int | None:
        """Row `row`'s index among the asking rows, None when it does not ask."""
        return self.reqs.index(row) if row in self.reqs else None

    def emitted(self, entry: int, path: Sequence[int], tokens: Sequence[int],
                bonus_lp: float | None) -> tuple[TokenLogprob, ...]:
        """The logprobs of a walk's new tokens (accepted drafts + bonus): token j came from
        node (0, *path)[j]; an accepted draft's value is its node's `child`, the bonus's the
        walk's (sampled) or its node's argmax (greedy: the bonus is that argmax)."""
        n, out = self.num_nodes, []
        for j, (node, tok) in enumerate(zip((0, *path), tokens)):
            e = self.top.entry(entry * n + node, tok)  # the top-K at the node
            if j < len(path):
                e = replace(e, logprob=self.child[entry][path[j]])
            elif bonus_lp is not None:
                e = replace(e, logprob=bonus_lp)
            out.append(e)
        return tuple(out)


def node_logprobs(
    verify: VerifyInput,
    logits: torch.Tensor,  # [bs * N, V] float32
    argmax: torch.Tensor,  # [bs, N] int64
    params: Sequence[SamplingParams],
) -> NodeLogprobs | None:
    """The asking rows' `NodeLogprobs` (None when no row asks). Device work only."""
    reqs = asking_rows(params)
    if not reqs:
        return None
    n, device = verify.num_nodes, logits.device
    tokens = verify.tokens  # [bs, N]
    if len(reqs) < verify.batch_size:
        idx = h2d_tensor(reqs, torch.int64, device)  # [m]
        logits = logits[(idx[:, None] * n + torch.arange(n, device=device)).reshape(-1)]
        argmax, tokens = argmax[idx], tokens[idx]
    m = len(reqs)
    lp = torch.log_softmax(logits.float(), dim=-1)  # [m * N, V]
    at_argmax = pick_logprobs(lp, argmax.reshape(-1), *repeated_rows(params, reqs, n))
    # node c's token under its parent's distribution: lp[i * N + parent(c), tokens[i, c]]
    # (the root, parent -1, reads its own row: a value never used)
    parents = h2d_tensor([[max(p, 0) for p in verify.parents[r]] for r in reqs], torch.int64,
                         device)  # [m, N]
    rows = torch.arange(m, device=device)[:, None] * n + parents  # [m, N]
    child = lp.reshape(-1)[(rows * lp.shape[-1] + tokens).reshape(-1)].view(m, n)
    return NodeLogprobs(reqs=reqs, num_nodes=n, lp=lp, at_argmax=at_argmax, child=child)


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
    gen: torch.Generator | None, lps: WalkLogprobs | None = None,
) -> tuple[list[int], int, float | None]:
    """-> (path, bonus, the bonus's logprob when `lps` is given: the row asks)."""
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
                return path, t, None if lps is None else lps.child[c]
            p = p / total
        if not moved:
            draw = torch.multinomial(p, 1, generator=gen)[0]
            if lps is None:
                return path, int(draw), None
            # The draw and its logprob in one read (the read `int(draw)` made anyway); float64
            # holds both exactly (token ids < 2^53).
            both = torch.stack([draw.double(), lps.lp[node, draw].double()]).tolist()
            return path, int(both[0]), both[1]
