"""CUDA graphs of the draft's prefill over a prompt step's rows (on by default with the
target's prompt graphs; TANDEM_DRAFT_PREFILL_GRAPHS=0 turns them off).

A speculative prompt step replays the target's graph of its rows (`DecodeGraphRunner`, one
decode query per prompt token), samples, then runs the draft over the same chunk: pairs
(f_t, x_{t+1}), the last x of a completed prompt being the token just sampled. Eagerly that
draft forward is a FlashInfer plan and a few dozen launches from Python; here it is one
replay per row count, queued before the step's host read:

- the features are read from the target graph's own output buffers (its hidden states, or the
  EAGLE-3 layers' streams) and the attention plan from its planner's buffers, which hold this
  step's rows (the draft's KV shares the target's page ids and slots);
- the token ids go into a buffer of their own: the next prompt tokens from the host, and each
  sampled token scattered into its row on the device (no host read before the replay).

Owns: the token-id buffer [R_max] int64 and the graphs (in the speculative graphs' memory
pool). Every replay reads the target graph's latest outputs, so it must follow the target's
replay of the same row count, before any other target replay.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import torch

from tandem.engine.cuda_graphs import DecodeGraphRunner
from tandem.engine.runner import ForwardOutput
from tandem.spec.draft_runner import DraftRunner

ENV = "TANDEM_DRAFT_PREFILL_GRAPHS"


def wanted() -> bool:
    return os.environ.get(ENV, "1") != "0"


class DraftPrefillGraphs:
    def __init__(self, draft: DraftRunner, target: DecodeGraphRunner, pool: Any) -> None:
        if not target.device_metadata:
            raise ValueError("draft prefill graphs: the target graphs must plan on the device")
        self.draft, self.target, self.pool = draft, target, pool
        device = target.positions.device
        self._ids = torch.zeros(target.batch_sizes[-1], dtype=torch.int64, device=device)
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor] | None] = {}

    def _body(self, rows: int, src: ForwardOutput) -> torch.Tensor:  # -> hidden [rows, H]
        features = self.draft.head.target_features(src.hidden, src.aux_hidden)  # [rows, F]
        return self.draft.forward_planned(self._ids[:rows], features,
                                          self.target.positions[:rows],
                                          self.target.captured_plan(rows))

    def capture(self, eager: bool = False) -> None:
        """One graph per row count of the target's graphs, largest first; eager=True captures
        nothing (each run runs the body: the CPU tests' mode)."""
        for rows in reversed(self.target.batch_sizes):
            src = self.target.captured_outputs(rows)
            if eager or src is None:
                self._graphs[rows] = None
                continue
            self._body(rows, src)  # compiles and tunes outside the capture
            torch.cuda.synchronize(self._ids.device)  # SYNC: start-up only
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                hidden = self._body(rows, src)
            self._graphs[rows] = (graph, hidden)

    def run(self, rows: int, src: ForwardOutput, next_ids: Sequence[int],
            sampled_rows: torch.Tensor, sampled: torch.Tensor) -> torch.Tensor:
        """The draft over the `rows` rows the target graph just ran: src its outputs
        (`DecodeGraphRunner.run_forward(copy=False)`), next_ids [rows] the next token of every
        row (anything at the sampled rows), sampled_rows [n] int64 and sampled [n] int64 on
        the device: the rows whose next token was just sampled, and those tokens -> the draft
        hidden [rows, H], valid until the next replay."""
        host = torch.tensor(list(next_ids), dtype=torch.int64)
        if self._ids.is_cuda:
            host = host.pin_memory()
        self._ids[:rows].copy_(host, non_blocking=True)
        self._ids.index_copy_(0, sampled_rows, sampled)
        captured = self._graphs[rows]
        if captured is None:  # eager mode
            return self._body(rows, src)
        graph, hidden = captured
        assert src.hidden.data_ptr() == self.target.captured_outputs(rows).hidden.data_ptr()
        graph.replay()
        return hidden
