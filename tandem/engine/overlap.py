"""Overlap scheduling for plain decode: the host plans step n+1 while step n runs on the GPU.

Without it a step is schedule -> build metadata -> plan -> launch -> sample -> read the tokens
(a host sync) -> stop checks, and the GPU idles through every host part. With it, `LLMEngine`
launches step n+1 before it reads step n's tokens:

    step() = schedule(n+1) -> launch(n+1) -> read(n) -> stop checks(n) -> outputs of n

- A token sampled in step n stays on the device. Its request ends `all_ids` with a `PENDING`
  placeholder (`Request.num_pending`), so the scheduler plans its next decode row as usual; that
  row's input id is gathered on the device from step n's sampled tokens (`feed_input_ids`).
- The host reads step n's tokens one step later (`InflightStep.read`, queued at launch). A
  request that step n ends (EOS, a stop token or string, an error) already has a row in step
  n+1: that row is wasted and its result dropped (`is_live`). A request whose pending token
  takes it to `max_new_tokens` or the context limit is not scheduled again
  (`Request.pending_reaches_length`), so max_tokens=1 costs nothing extra. A request aborted
  between steps is dropped the same way.
- Pages freed while a step is in flight (a finish, an abort, a preemption) may go to another
  request in the next step at once: every GPU write to them is queued on the same stream after
  the in-flight step's, so the late writes of a wasted row land before any new owner's.
  (Workers whose pages also receive KV transfers do not use this: it is the plain engine's.)
- A preempted request with a pending token waits in the queue until that token is read.

Outputs are the same tokens as without overlap (tests/unit/test_overlap.py); only when they
are returned moves: `step()` returns step n's outputs from the call that launches n+1, and an
engine with a step in flight has unfinished work (`has_unfinished`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from tandem.engine import h2d
from tandem.engine.request import PENDING, Request
from tandem.engine.sampling import SampledRead
from tandem.engine.scheduler import ScheduledChunk


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class InflightStep:
    """A launched step whose sampled tokens the host has not read yet."""

    reqs: tuple[Request, ...]  # [n] the sampling rows' requests, row order
    tokens: torch.Tensor  # [n] int64 on the device: the sampled tokens (next step's inputs)
    errors: tuple[str, ...]  # [n] "" or why the row's sampling failed (known on the host)
    read: SampledRead  # the host copies of tokens (and logprobs), queued at launch
    rows: Mapping[str, int]  # req_id -> row in `tokens`


def feed_input_ids(
    chunks: Sequence[ScheduledChunk],
    num_rows: int,  # >= the batch's tokens; rows past them (graph padding) get id 0
    prev: InflightStep | None,
    device: torch.device,
) -> torch.Tensor:
    """[num_rows] int64 input ids on `device`: the chunks' token ids, each `PENDING` one taken
    from `prev.tokens` on the device (no host sync: the ids and the rows to gather travel
    together in one non-blocking copy)."""
    ids = [t for c in chunks for t in c.token_ids]
    ids += [0] * (num_rows - len(ids))
    if PENDING not in ids:
        return h2d.tensor(ids, torch.int64, device)
    if prev is None:
        raise ValueError("feed_input_ids: a pending token but no step in flight")
    src = [-1] * num_rows  # [num_rows] row of prev.tokens, -1 = the host id
    pos = 0
    for c in chunks:
        for j, t in enumerate(c.token_ids):
            if t == PENDING:
                if c.req_id not in prev.rows:
                    raise ValueError(f"feed_input_ids: '{c.req_id}' has a pending token that "
                                     "the step in flight did not sample")
                src[pos + j] = prev.rows[c.req_id]
        pos += len(c.token_ids)
    both = h2d.tensor([ids, src], torch.int64, device)  # [2, num_rows]
    gathered = prev.tokens.index_select(0, both[1].clamp(min=0))  # [num_rows]
    return torch.where(both[1] >= 0, gathered, both[0])


def is_live(requests: Mapping[str, Request], req: Request) -> bool:
    """Whether a row's result still belongs to a running request (not finished or aborted
    while its step was in flight)."""
    return requests.get(req.req_id) is req and not req.finished
