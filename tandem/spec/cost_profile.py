"""The `StepCostTable` of one speculative engine: read from `SpecConfig.cost_table`, or from
the cache of an earlier start (same model shape, dtype, device, draft head, num_steps, tandem
and policy version), or measured now by timing the engine's own rounds -- with its real CUDA
graphs on a GPU, a few eager rounds on the CPU -- for a grid of batch sizes and every k in
0 .. num_steps, and cached under $TANDEM_CACHE/spec-cost/ (as the GEMV tuning is). On a GPU
every k is timed through its own graphs (`SpecEngine.k_graphs`, captured before the policy
is made), so the table prices the rounds the policy will run. It also prices the plain engine's
own step (`SpecEngine.plain_step`: overlapped where the engine overlaps), which the plain regime
runs where no round pays (`AdaptivePolicy.plain_wins`).

Owns: the profiling requests it adds to the engine (removed again before it returns) and the
cost files it writes. What a profiled cost covers: one round's forwards (drafting, verify,
draft-extend) and its one host read; not the stop checks of the commit, which cost the same
per committed token whatever k is."""

from __future__ import annotations

import hashlib
import logging
import os
import re
import statistics
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

import torch

from tandem import __version__
from tandem.engine.cache_root import default_cache_root
from tandem.messages import SamplingParams
from tandem.spec.adaptive import POLICY_VERSION, AdaptivePolicy, StepCostTable
from tandem.spec.config import SpecConfig
from tandem.spec.phases import DraftSeed, RoundInput
from tandem.spec.scheduler import SpecScheduler
from tandem.spec.stats import SpecStats


class SpecEngine(Protocol):
    """What profiling uses of `spec.engine.SpecEngine` (typed here: the engine imports this
    module, and a module cycle is against the import contracts)."""

    device: torch.device
    spec: SpecConfig
    cfg: Any  # EngineConfig
    model: Any  # DecoderLM: .par, its process groups
    model_cfg: Any  # ModelConfig
    head: Any  # EagleHead: .cfg
    allocator: Any  # PageAllocator: .num_free
    spec_scheduler: SpecScheduler
    spec_stats: SpecStats

    @property
    def seeds(self) -> Mapping[str, DraftSeed]: ...

    def add_request(self, prompt_ids, params: SamplingParams, req_id: str | None = None
                    ) -> str: ...

    def step(self) -> list: ...

    def abort(self, req_id: str) -> bool: ...

    def _spec_round(self, inp: RoundInput) -> tuple: ...

    def plain_step(self) -> list: ...

    def leave_overlap(self) -> list: ...


log = logging.getLogger(__name__)

CACHE_ENV = "TANDEM_SPEC_COST_CACHE"  # "0": profile every start, never read or write a file
GPU_BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64, 128)
CPU_BATCH_SIZES = (1, 2, 4)
_PROMPT = tuple(range(1, 9))  # profiling prompt: 8 token ids every vocabulary has


def adaptive_policy(eng: SpecEngine) -> AdaptivePolicy:
    """The engine's adaptive policy over its cost table (given, cached or profiled now)."""
    return AdaptivePolicy(table=cost_table(eng), max_k=eng.spec.num_steps)


def cost_table(eng: SpecEngine) -> StepCostTable:
    if eng.spec.cost_table is not None:
        return StepCostTable.from_json(Path(eng.spec.cost_table).read_text())
    path = cache_file(eng)
    if path is not None and path.is_file():
        try:
            table = StepCostTable.from_json(path.read_text())
            if table.max_k == eng.spec.num_steps:
                return table
        except (OSError, ValueError, KeyError) as exc:
            log.warning("spec cost table %s unreadable (%s): profiling again", path, exc)
    table = profile(eng, repeats=5 if eng.device.type == "cuda" else 2)
    if path is not None:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
            tmp.write_text(table.to_json())
            os.replace(tmp, path)  # atomic: a concurrent start reads the old file or this one
        except OSError as exc:
            log.warning("spec cost table: cannot cache it in %s (%s)", path, exc)
    return table


def cache_file(eng: SpecEngine) -> Path | None:
    """$TANDEM_CACHE/spec-cost/<device>-<digest of what the costs depend on>.json."""
    if os.environ.get(CACHE_ENV) == "0":
        return None
    dev = eng.device
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    par = eng.model.par
    key = repr((eng.model_cfg, eng.head.cfg, eng.cfg.dtype, eng.cfg.attention_backend,
                eng.cfg.cuda_graphs, eng.cfg.page_size, eng.spec.num_steps,
                par.tp.size, par.dp.size, __version__, POLICY_VERSION))
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    safe = re.sub(r"[^A-Za-z0-9._-]+", "_", name)
    return default_cache_root() / "spec-cost" / f"{safe}-{digest}.json"


def profile(eng: SpecEngine, repeats: int,
            batch_sizes: tuple[int, ...] | None = None) -> StepCostTable:
    """Time `repeats` rounds (median, after one warm-up) at each batch size and k."""
    if batch_sizes is None:
        batch_sizes = GPU_BATCH_SIZES if eng.device.type == "cuda" else CPU_BATCH_SIZES
    sizes = tuple(b for b in batch_sizes if b <= _max_batch(eng)) or (1,)
    req_ids = _seeded_requests(eng, max(sizes))
    try:
        sched = eng.spec_scheduler
        reqs = sched.reserve(exclude=frozenset())  # pages for one round of every request
        reqs = [r for r in reqs if r.req_id in req_ids]
        seconds = []
        for b in sizes:
            row = [_time_round(eng, sched.round_input(reqs[:b], k), repeats)
                   for k in range(eng.spec.num_steps + 1)]
            seconds.append(tuple(row))
            log.info("spec cost, batch %d: %s ms", b, ", ".join(f"{s * 1e3:.2f}" for s in row))
        plain = _time_plain_steps(eng, [r.req_id for r in reqs], sizes, repeats)
        log.info("plain step cost: %s ms", ", ".join(f"{s * 1e3:.2f}" for s in plain))
    finally:
        eng.leave_overlap()
        for rid in req_ids:
            eng.abort(rid)
    eng.spec_stats = SpecStats()  # the profiling rounds are no request's acceptance
    return StepCostTable(batch_sizes=sizes, seconds=tuple(seconds), plain=plain)


def _max_batch(eng: SpecEngine) -> int:
    """Requests of the profiling prompt that fit the pool with a round's slots each."""
    per_req = -(-(len(_PROMPT) + eng.spec.slots_per_round + 2) // eng.cfg.page_size)
    return min(eng.cfg.max_num_seqs, eng.allocator.num_free // per_req)


def _seeded_requests(eng: SpecEngine, n: int) -> list[str]:
    """n greedy requests of the profiling prompt, stepped until each holds a draft seed."""
    params = SamplingParams(max_new_tokens=1 << 20, ignore_eos=True)
    req_ids = [eng.add_request(_PROMPT, params, f"__spec_cost_{i}") for i in range(n)]
    while not all(rid in eng.seeds for rid in req_ids):
        eng.step()
    return req_ids


def _time_plain_steps(eng: SpecEngine, req_ids: list[str], sizes: tuple[int, ...],
                      repeats: int) -> tuple[float, ...]:
    """Seconds of one plain engine step (`plain_step`: no draft model, overlapped where the
    engine overlaps) over each batch size, steps timed back to back: the profiling requests
    lose their seeds (they are aborted afterwards), and the batch shrinks from the largest
    size down by aborting requests."""
    sync = torch.cuda.synchronize if eng.device.type == "cuda" else (lambda: None)
    for rid in req_ids:
        eng.spec_scheduler.drop_seed(rid)
    live, out = list(req_ids), {}
    steps = max(4, 4 * repeats)
    for b in sorted(sizes, reverse=True):
        while len(live) > b:
            eng.abort(live.pop())
        eng.plain_step()  # warm-up (and under overlap: one step in flight)
        sync()
        t0 = time.perf_counter()
        for _ in range(steps):
            eng.plain_step()
        sync()
        out[b] = (time.perf_counter() - t0) / steps
    return tuple(out[b] for b in sizes)


def _time_round(eng: SpecEngine, inp: RoundInput, repeats: int) -> float:
    """Median seconds of `_spec_round(inp)`: a round writes only its own reserved slots and
    commits nothing, so it can run again on the same input."""
    sync = torch.cuda.synchronize if eng.device.type == "cuda" else (lambda: None)
    with torch.inference_mode():
        eng._spec_round(inp)  # warm-up
        times = []
        for _ in range(repeats):
            sync()
            t0 = time.perf_counter()
            eng._spec_round(inp)
            sync()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)
