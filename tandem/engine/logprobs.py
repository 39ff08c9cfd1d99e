"""Log-probabilities of returned tokens, computed on the device in the pass that chose them.

The rule is messages/logprobs.py's: the log-softmax of the target's raw logits (float32) at the
token's position, whatever the sampling settings. `gather_logprobs` computes, for some rows of a
batch, the chosen token's logprob and the top-K alternatives; the result stays on the device and
crosses to the host with the step's tokens, in the step's one read (`d2h.HostCopy`), so asking
for logprobs adds no host sync. Rows whose request did not ask are left out, and a batch where
none asks computes nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tandem.messages import SamplingParams, TokenLogprob


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class LogprobRows:
    """Logprobs of m chosen tokens (on the device until copied); `rows` says which rows of the
    caller's batch they are of."""

    rows: tuple[int, ...]  # [m] the caller's row of each entry
    num_top: tuple[int, ...]  # [m] alternatives each entry's request wants (<= K)
    chosen: torch.Tensor  # [m] float32 logprob of the chosen token
    top_ids: torch.Tensor  # [m, K] int64 the K most likely tokens, logprob descending
    top_logprobs: torch.Tensor  # [m, K] float32 their logprobs

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """What crosses to the host (`HostLogprobs.of` takes their host copies back)."""
        return self.chosen, self.top_ids, self.top_logprobs


@dataclass(frozen=True, slots=True, kw_only=True)
class HostLogprobs:
    """`LogprobRows` read on the host, as Python values."""

    rows: tuple[int, ...]  # [m]
    num_top: tuple[int, ...]  # [m]
    chosen: list[float]  # [m]
    top_ids: list[list[int]]  # [m][K]
    top_logprobs: list[list[float]]  # [m][K]

    @staticmethod
    def of(lp: LogprobRows, host: Sequence[torch.Tensor]) -> HostLogprobs:
        """`host`: the host copies of `lp.tensors()` (already waited for)."""
        chosen, top_ids, top_lp = host
        return HostLogprobs(rows=lp.rows, num_top=lp.num_top, chosen=chosen.tolist(),
                            top_ids=top_ids.tolist(), top_logprobs=top_lp.tolist())

    def entry(self, i: int, token_id: int) -> TokenLogprob:
        """Entry i as the `TokenLogprob` of `token_id` (the token entry i was computed for)."""
        k = self.num_top[i]
        return TokenLogprob(token_id=token_id, logprob=self.chosen[i],
                            top_ids=tuple(self.top_ids[i][:k]),
                            top_logprobs=tuple(self.top_logprobs[i][:k]))

    def per_row(self, token_ids: Sequence[int]) -> list[TokenLogprob | None]:
        """[n] for a batch of n rows whose chosen tokens are `token_ids`: a row's entry, or None
        where its request did not ask."""
        out: list[TokenLogprob | None] = [None] * len(token_ids)
        for i, row in enumerate(self.rows):
            out[row] = self.entry(i, token_ids[row])
        return out


def asking_rows(params: Sequence[SamplingParams]) -> tuple[int, ...]:
    """The rows whose request asks for logprobs."""
    return tuple(i for i, p in enumerate(params) if p.logprobs)


def repeated_rows(params: Sequence[SamplingParams], rows: Sequence[int], times: int
                  ) -> tuple[list[int], list[int]]:
    """(num_top, rows) for `times` consecutive entries per row of `rows` -- the speculative
    layouts of [m * times] entries, one per verify node or emitted position."""
    return ([params[r].top_logprobs for r in rows for _ in range(times)],
            [r for r in rows for _ in range(times)])


def gather_logprobs(
    logits: torch.Tensor,  # [m, V] float logits of the distributions the tokens came from
    token_ids: torch.Tensor,  # [m] int64 the chosen tokens
    num_top: Sequence[int],  # [m] alternatives each wants
    rows: Sequence[int],  # [m] the caller's row of each (carried along, see LogprobRows)
) -> LogprobRows:
    """Device work only (no host sync): log-softmax in float32, then `pick_logprobs`."""
    return pick_logprobs(torch.log_softmax(logits.float(), dim=-1), token_ids, num_top, rows)


def pick_logprobs(
    lp: torch.Tensor,  # [m, V] float32 log-softmax rows
    token_ids: torch.Tensor,  # [m] int64 the chosen tokens
    num_top: Sequence[int],  # [m]
    rows: Sequence[int],  # [m]
) -> LogprobRows:
    """The chosen tokens' values and the top-K of each row, K = max(num_top). Device work only."""
    chosen = lp.gather(-1, token_ids[:, None]).squeeze(-1)  # [m]
    k = min(max(num_top, default=0), lp.shape[-1])
    if k > 0:
        top_lp, top_ids = lp.topk(k, dim=-1)  # [m, K] each, sorted descending
    else:
        top_lp = lp.new_empty(lp.shape[0], 0)
        top_ids = torch.empty(lp.shape[0], 0, dtype=torch.int64, device=lp.device)
    return LogprobRows(rows=tuple(rows), num_top=tuple(num_top), chosen=chosen,
                       top_ids=top_ids, top_logprobs=top_lp)
