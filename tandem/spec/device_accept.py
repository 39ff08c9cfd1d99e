"""Acceptance on the device: the round's walk (spec/accept.py) as tensor work queued without a
host read, so the draft-extend graph and the next round's drafting can follow it on the GPU
before the host reads what was accepted (one copy, `DeviceAcceptance.result`).

- Greedy, any tree (`launch_greedy_accept`): one kernel (`spec/kernels` greedy_accept).
- Sampled chains (`launch_sampled_chain_accept`): target-only rejection sampling, the rule of
  `accept._walk_sampled` for a node with one child. Draft j (token t_j, proposed at node j-1)
  is accepted with probability p_{j-1}(t_j) -- u_j < p_{j-1}(t_j), u_j uniform -- as long as
  every draft before it was; at the first rejected node a, the bonus is drawn from p_a with
  t_{a+1} removed (renormalised: `torch.multinomial` takes unnormalised rows), and when all k
  were accepted from p_k. P(emit t) = p(t) at every position, as in the walk. Greedy rows of
  the batch take the greedy rule (no randomness). Randomness per generator (a seeded
  request's own, or the engine's shared one for the rest): k uniforms a row, then one
  multinomial draw a row, so a seeded request draws the same numbers whatever shares its
  batch. The draws differ from the host walk's (which draws per tried child): seeded outputs
  are reproducible on either path, not equal between them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tandem.engine import kernels
from tandem.engine.d2h import HostCopy
from tandem.engine.h2d import tensor as h2d_tensor
from tandem.engine.logprobs import (HostLogprobs, LogprobRows, asking_rows, gather_logprobs,
                                    repeated_rows)
from tandem.engine.sampling import SamplingParams, target_probs
from tandem.spec import kernels as spec_kernels
from tandem.spec.phases import VerifyInput, VerifyResult


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class DeviceAcceptance:
    """Acceptance of a whole batch, computed on the device (greedy, or sampled chains); its
    host copy is in flight (`result` waits for it). Work queued after it -- the draft-extend
    graph, the next round's drafting -- runs on the GPU while the host reads and commits."""

    num_accepted: torch.Tensor  # [bs] int32 accepted drafts per request
    path: torch.Tensor  # [bs, depth] int32 accepted nodes in order, -1 past the end
    bonus: torch.Tensor  # [bs] int64 the target's token after the accepted path
    depth: int  # the deepest node any tree of the batch has
    # host copies of: [bs, 2 + 2 * depth] int64 rows (accepted count, bonus, path, path
    # tokens), then `logprobs.tensors()`
    copy: HostCopy
    # [m * (depth + 1)] logprobs of emitted positions 0..depth of each asking request (past
    # its accepted count + 1: filler); None when no request asks
    logprobs: LogprobRows | None = None

    def result(self) -> VerifyResult:
        # SYNC inside: the round's one host read -- waits for the acceptance kernel and the
        # copies, not for whatever was queued after them.
        rows_h, *lp_h = self.copy.wait()
        d = self.depth
        paths, new_tokens = [], []
        for row in rows_h.tolist():
            a = row[0]
            paths.append(tuple(row[2 : 2 + a]))
            new_tokens.append(tuple(row[2 + d : 2 + d + a]) + (row[1],))
        if self.logprobs is None:
            return VerifyResult(path_nodes=tuple(paths), new_tokens=tuple(new_tokens))
        host = HostLogprobs.of(self.logprobs, lp_h)
        entry = {r: i for i, r in enumerate(dict.fromkeys(host.rows))}  # row -> asking index
        logprobs = tuple(
            tuple(host.entry(entry[r] * (d + 1) + j, t) for j, t in enumerate(toks))
            if r in entry else () for r, toks in enumerate(new_tokens))
        return VerifyResult(path_nodes=tuple(paths), new_tokens=tuple(new_tokens),
                            logprobs=logprobs)


def launch_greedy_accept(verify: VerifyInput, logits: torch.Tensor,
                         params: Sequence[SamplingParams] = ()) -> DeviceAcceptance:
    """An all-greedy batch: the walk (`_walk_greedy` for every request) runs on the device --
    one Triton kernel on CUDA -- and one device->host copy of what the commit needs (accepted
    lengths, bonus tokens, paths, tokens, the logprobs of the rows of `params` that ask) is
    queued without waiting for it. Nothing here copies host data to the device synchronously.
    logits: [bs * N, V] float32, request-major."""
    n, bs = verify.num_nodes, verify.batch_size
    argmax = kernels.row_max(logits)[1].view(bs, n)  # (SpecGraphRunner.accept's argmax too)
    depth = max(max(d) for d in verify.depths)  # the longest path any tree allows
    parents = h2d_tensor(verify.parents, torch.int32, argmax.device)  # [bs, N]
    num, path, bonus = spec_kernels.greedy_accept(verify.tokens, argmax, parents, depth)
    return _read_back(verify, logits, params, num, path, bonus)


def _read_back(verify: VerifyInput, logits: torch.Tensor, params: Sequence[SamplingParams],
               num: torch.Tensor, path: torch.Tensor, bonus: torch.Tensor) -> DeviceAcceptance:
    """Acceptance's device outputs (num [bs] int32, path [bs, D] int32 -1 padded, bonus [bs]
    int64) with their host copy queued: rows [a, bonus, path, path tokens], and the emitted
    tokens' logprobs of the rows that ask."""
    path_tokens = verify.tokens.gather(1, path.long().clamp(min=0))  # [bs, D]
    rows = torch.cat([num.long()[:, None], bonus[:, None], path.long(), path_tokens], dim=1)
    lp = _emitted_logprobs(verify, logits, num, path, path_tokens, bonus, params)
    copy = HostCopy.start((rows, *(lp.tensors() if lp is not None else ())))
    return DeviceAcceptance(num_accepted=num, path=path, bonus=bonus, depth=path.shape[1],
                            copy=copy, logprobs=lp)


def _emitted_logprobs(
    verify: VerifyInput,
    logits: torch.Tensor,  # [bs * N, V] float32
    num: torch.Tensor,  # [bs] int32 accepted drafts
    path: torch.Tensor,  # [bs, D] int32 accepted nodes, -1 past the end
    path_tokens: torch.Tensor,  # [bs, D] int64 their tokens (filler past the end)
    bonus: torch.Tensor,  # [bs] int64
    params: Sequence[SamplingParams],
) -> LogprobRows | None:
    """Device path: the logprobs of emitted positions j = 0..D of the asking requests (None
    when none asks) -- token j is accepted draft j (j < num) or the bonus (j = num), from the
    distribution at node (0, *path)[j]; positions past num are filler the host never reads.
    Device work only: nothing about `num` is known on the host yet."""
    reqs = asking_rows(params)
    if not reqs:
        return None
    n, bs, d1 = verify.num_nodes, verify.batch_size, path.shape[1] + 1
    device = logits.device
    zero = torch.zeros(bs, 1, dtype=torch.int64, device=device)
    nodes = torch.cat([zero, path.long().clamp(min=0)], dim=1)  # [bs, D+1]
    j = torch.arange(d1, device=device)  # [D+1]
    toks = torch.where(j[None, :] < num.long()[:, None], torch.cat([path_tokens, zero], dim=1),
                       bonus[:, None])  # [bs, D+1]
    base = torch.arange(bs, device=device)  # [bs]
    if len(reqs) < bs:
        base = h2d_tensor(reqs, torch.int64, device)  # [m]
        nodes, toks = nodes[base], toks[base]
    flat = (base[:, None] * n + nodes).reshape(-1)  # [m * (D+1)] verify rows
    return gather_logprobs(logits[flat], toks.reshape(-1), *repeated_rows(params, reqs, d1))


def launch_device_accept(verify: VerifyInput, logits: torch.Tensor,
                         params: Sequence[SamplingParams],
                         generators: Sequence[torch.Generator]) -> DeviceAcceptance | None:
    """The batch's acceptance on the device where it applies -- every row greedy (any
    tree), or a batch of chains -- else None (sampled trees: the host walk). generators:
    [bs] each row's (`Sampler.or_shared`)."""
    if all(p.greedy for p in params):
        return launch_greedy_accept(verify, logits, params)
    if verify.is_chain:
        return launch_sampled_chain_accept(verify, logits, params, generators)
    return None


def launch_sampled_chain_accept(
    verify: VerifyInput,  # chains: node j's parent is j - 1
    logits: torch.Tensor,  # [bs * N, V] float32, request-major
    params: Sequence[SamplingParams],  # [bs]
    generators: Sequence[torch.Generator],  # [bs] each row's (rows may share one)
) -> DeviceAcceptance:
    """Acceptance of a batch of chains with sampled rows (module docstring), queued on the
    device; no host read. The greedy rows of the batch accept as `launch_greedy_accept`."""
    rows = [r for r, p in enumerate(params) if not p.greedy]  # [m] the sampled rows
    if not rows:
        return launch_greedy_accept(verify, logits, params)
    bs, n = verify.batch_size, verify.num_nodes
    k, device = n - 1, logits.device
    argmax = kernels.row_max(logits)[1].view(bs, n)  # [bs, N] int64
    drafts = verify.tokens[:, 1:]  # [bs, k] int64 draft j at column j - 1
    ok = drafts == argmax[:, :-1]  # [bs, k] the greedy rule
    idx = h2d_tensor(rows, torch.int64, device)  # [m]
    probs = _chain_probs(logits.view(bs, n, -1), rows, idx, params)  # [m, N, V] float32
    by_gen = _generator_groups(rows, generators, device)
    u = torch.empty(len(rows), k, dtype=torch.float32, device=device)  # [m, k]
    for gen, at, count in by_gen:
        _put(u, at, torch.rand(count, k, generator=gen, device=device))
    mine = drafts.index_select(0, idx)  # [m, k]
    ok[idx] = u < probs[:, :-1].gather(2, mine[:, :, None]).squeeze(2)  # draft j: p_{j-1}(t_j)
    run = ok.to(torch.int32).cumprod(dim=1)  # [bs, k] 1 while every draft so far accepted
    num = run.sum(dim=1, dtype=torch.int32)  # [bs] a
    bonus = argmax.gather(1, num.long()[:, None]).squeeze(1)  # [bs] greedy rows' bonus
    a = num.index_select(0, idx).long()  # [m]
    q = probs[torch.arange(len(rows), device=device), a]  # [m, V] p at the last accepted node
    if k > 0:  # remove the rejected draft t_{a+1} (rows that accepted all k keep p_k)
        t = mine.gather(1, a.clamp(max=k - 1)[:, None])  # [m, 1]
        q = q.scatter(1, t, torch.where((a < k)[:, None], 0.0, q.gather(1, t)))
        # p(t) rounded up to leave no mass (u < 1 accepts p(t) = 1): t is the answer, as in
        # the walk; the row gets a valid stand-in for the draw below
        empty = (q.sum(dim=1) <= 0)[:, None]  # [m, 1]
        q = torch.where(empty, torch.zeros_like(q).scatter(1, t, 1.0), q)
    draw = torch.empty(len(rows), dtype=torch.int64, device=device)  # [m]
    for gen, at, _ in by_gen:
        _put(draw, at, torch.multinomial(_take(q, at), 1, generator=gen).squeeze(1))
    bonus[idx] = draw
    nodes = torch.arange(1, n, dtype=torch.int32, device=device)  # [k] chain nodes 1..k
    path = torch.where(run.bool(), nodes, -1)  # [bs, k] int32 accepted nodes, -1 after
    return _read_back(verify, logits, params, num, path, bonus)


def _chain_probs(logits: torch.Tensor, rows: Sequence[int], idx: torch.Tensor,
                 params: Sequence[SamplingParams]) -> torch.Tensor:
    """logits [bs, N, V] -> [m, N, V] float32 `target_probs` at every node of the sampled
    `rows` (idx: the same on the device), one batched call per distinct setting
    (temperature, top_k, top_p, min_p). No host read."""
    groups: dict[tuple, list[int]] = {}
    for i, r in enumerate(rows):
        p = params[r]
        groups.setdefault((p.temperature, p.top_k, p.top_p, p.min_p), []).append(i)
    if len(groups) == 1:
        src = logits if len(rows) == logits.shape[0] else logits.index_select(0, idx)
        return target_probs(src, params[rows[0]])
    out = torch.empty(len(rows), *logits.shape[1:], dtype=torch.float32, device=logits.device)
    for members in groups.values():
        at = h2d_tensor(members, torch.int64, logits.device)  # positions among `rows`
        out[at] = target_probs(logits.index_select(0, idx.index_select(0, at)),
                               params[rows[members[0]]])
    return out


def _generator_groups(rows: Sequence[int], generators: Sequence[torch.Generator],
                      device: torch.device
                      ) -> list[tuple[torch.Generator, torch.Tensor | None, int]]:
    """The sampled rows' generators in first-use order, each with the positions (among
    `rows`) of the rows drawing from it -- None for all of them in order (one generator,
    the usual case), else an index tensor -- and how many they are."""
    order: dict[int, tuple[torch.Generator, list[int]]] = {}
    for i, r in enumerate(rows):
        order.setdefault(id(generators[r]), (generators[r], []))[1].append(i)
    if len(order) == 1:
        ((gen, _),) = order.values()
        return [(gen, None, len(rows))]
    return [(gen, h2d_tensor(at, torch.int64, device), len(at)) for gen, at in order.values()]


def _take(x: torch.Tensor, at: torch.Tensor | None) -> torch.Tensor:
    return x if at is None else x.index_select(0, at)


def _put(dst: torch.Tensor, at: torch.Tensor | None, src: torch.Tensor) -> None:
    if at is None:
        dst.copy_(src)
    else:
        dst[at] = src
