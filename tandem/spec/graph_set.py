"""CUDA graphs for every k a k policy may choose (spec/adaptive.py): one `SpecGraphRunner` per
k besides `num_steps` (whose runner the engine captures first, policy or not), over the same
batch buckets and sharing its `GraphMemory` -- one graph pool and one verify-logits buffer.

Why: a round of k < num_steps run eagerly is launch-bound (15-35 ms on an H100 whatever the
model, against 1.9 ms for the graphed k = 4 round of the SmolLM2 shape), so a policy timing
the engine's rounds always found k = num_steps cheapest and never chose another. With every
k graphed the cost table (`cost_profile.py`) times what the policy will run.

What each k costs to hold (8B shape, buckets 1..128): its verify and extend planners (FlashInfer
prefill wrappers, 8 MiB int workspace + 8 MiB pinned host memory per bucket; k = 0 uses the
decode planner, one workspace for all buckets), each graph's hidden outputs, and capture time;
the logits, the largest output, live in the shared buffer.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence

import torch

from tandem.spec.config import SpecConfig
from tandem.spec.cuda_graphs import SpecGraphRunner

log = logging.getLogger(__name__)


def policy_ks(spec: SpecConfig) -> tuple[int, ...]:
    """The k besides spec.num_steps a policy may give a round: 0 .. num_steps - 1 for a chain;
    a tree drafts its num_steps levels or nothing (k = 0, a plain step)."""
    return tuple(range(spec.num_steps)) if spec.topk == 1 else (0,)


def capture_k_graphs(full: SpecGraphRunner, ks: Sequence[int], eager: bool = False
                     ) -> dict[int, SpecGraphRunner]:
    """One runner per k in `ks` (none for full's own k), captured now, sharing full's buckets
    and memory; eager=True captures nothing (CPU tests: bodies run at every replay).
    Largest k first: a smaller graph's intermediates fit in what the larger ones left free."""
    cuda = full.device.type == "cuda" and not eager
    if cuda:
        torch.cuda.synchronize(full.device)  # SYNC: start-up only (measuring the capture)
    t0, before = time.perf_counter(), torch.cuda.memory_allocated(full.device) if cuda else 0
    runners: dict[int, SpecGraphRunner] = {}
    for k in sorted(set(ks) - {full.num_drafts}, reverse=True):
        runner = SpecGraphRunner(full.runner, full.draft, full.spec, full.batch_sizes,
                                 full.max_kv_len, full.capture_layers, num_drafts=k,
                                 memory=full.memory, device_metadata=full.device_metadata)
        runner.capture(eager=eager)
        runners[k] = runner
    if cuda and runners:
        grown = torch.cuda.memory_allocated(full.device) - before
        log.info("spec graphs for k in %s: captured in %.1f s, %.0f MiB", sorted(runners),
                 time.perf_counter() - t0, grown / 2**20)
    return runners


def graphs_for(full: SpecGraphRunner | None, others: Mapping[int, SpecGraphRunner],
               num_drafts: int) -> SpecGraphRunner | None:
    """The runner of a round of `num_drafts` drafts: `full` at its own k, else the one
    captured for that k; None when there is none (the round runs eagerly)."""
    if full is not None and num_drafts == full.num_drafts:
        return full
    return others.get(num_drafts)


def verify_drafts(spec: SpecConfig, num_nodes: int) -> int:
    """The k of a round from its verify's node count: a tree of spec.tree_size nodes drafted
    num_steps levels; a chain of N nodes drafted N - 1."""
    return spec.num_steps if num_nodes == spec.tree_size else num_nodes - 1
