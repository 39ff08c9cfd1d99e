"""The `StepCostTable` of one speculative engine: read from `SpecConfig.cost_table`, or from
the cache of an earlier start (same model shape, dtype, device, draft head, num_steps, tandem
and policy version), or measured now by timing the engine's own steps -- with its real CUDA
graphs on a GPU, a few eager steps on the CPU -- for a grid of batch sizes and every k in
0 .. num_steps, and cached under $TANDEM_CACHE/spec-cost/ (as the GEMV tuning is). On a GPU
every k is timed through its own graphs (`SpecEngine.k_graphs`, captured before the policy
is made), so the table prices the rounds the policy will run. It also prices the plain engine's
own step (`SpecEngine.plain_step`: overlapped where the engine overlaps), which the plain regime
runs where no round pays (`AdaptivePolicy.plain_wins`).

Owns: the profiling requests it adds to the engine (removed again before it returns) and the
cost files it writes. What a profiled cost covers: a whole engine step -- the round's forwards
(drafting, verify, draft-extend), its host read, and the commit's stop checks -- or a whole
plain step (whose host work overlaps the GPU's where the engine overlaps)."""

from __future__ import annotations

import hashlib
import logging
import os
import re
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Protocol

import torch

from tandem import __version__
from tandem.engine.cache_root import default_cache_root
from tandem.engine.parallel import ParallelGroup
from tandem.messages import SamplingParams
from tandem.spec.adaptive import AdaptivePolicy, FixedK
from tandem.spec.cost_table import POLICY_VERSION, StepCostTable
from tandem.spec.config import SpecConfig
from tandem.spec.phases import DraftSeed
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

    def plain_step(self) -> list: ...

    def leave_overlap(self) -> list: ...


log = logging.getLogger(__name__)

CACHE_ENV = "TANDEM_SPEC_COST_CACHE"  # "0": profile every start, never read or write a file
GPU_BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64, 128)
CPU_BATCH_SIZES = (1, 2, 4)
# Profiling prompt: 64 token ids every vocabulary has. Each sample starts fresh requests
# from it, so every k and the plain step are timed over the same contexts, ~64-170 tokens
# (a chat prompt and its answer): requests kept through every sample had grown by ~500
# tokens before the plain steps, timed last, and priced them up to 1.6x their service at
# 16-64 rows on H200s (session 25).
_PROMPT = tuple(range(1, 65))
_ARRIVING = tuple(range(1, 33))  # a prompt arriving while they decode (its price: `arrival`)
ARRIVAL_BATCH = 8  # the batch size the arrival is priced at (the largest profiled up to it)


def adaptive_policy(eng: SpecEngine) -> AdaptivePolicy:
    """The engine's adaptive policy over its cost table (given, cached or profiled now)."""
    return AdaptivePolicy(table=cost_table(eng), max_k=eng.spec.num_steps,
                          measured=eng.head.cfg.acceptance)


def cost_table(eng: SpecEngine) -> StepCostTable:
    """The table every rank of the worker uses alike: the ranks step together (collectives in
    every forward), so they must choose the same k and regime from the same numbers. They
    profile together when any lacks a cached table, and take each cost's largest over ranks."""
    if eng.spec.cost_table is not None:
        return StepCostTable.from_json(Path(eng.spec.cost_table).read_text())
    ranks = eng.model.par.every_rank
    path = cache_file(eng)
    table = _cached(path, eng.spec.num_steps)
    if ranks.all_reduce_max(int(table is None), eng.device):
        cuda = eng.device.type == "cuda"
        # CPU: 3 samples of 2 steps (one sample priced a batch-1 k=3 round 48% over k=2 and
        # equal to k=4 on a 2-core VM; start-up profiling ~12 s -> ~35 s, cached after)
        table = profile(eng, repeats=5 if cuda else 2, samples=5 if cuda else 3)
        if path is not None:
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
                tmp.write_text(table.to_json())
                os.replace(tmp, path)  # atomic: a concurrent start reads the old or this one
            except OSError as exc:
                log.warning("spec cost table: cannot cache it in %s (%s)", path, exc)
    assert table is not None
    return _agreed(table, ranks, eng.device)


def _cached(path: Path | None, num_steps: int) -> StepCostTable | None:
    if path is None or not path.is_file():
        return None
    try:
        table = StepCostTable.from_json(path.read_text())
        return table if table.max_k == num_steps else None
    except (OSError, ValueError, KeyError) as exc:
        log.warning("spec cost table %s unreadable (%s): profiling again", path, exc)
        return None


def _agreed(table: StepCostTable, ranks: ParallelGroup, device: torch.device) -> StepCostTable:
    """Each cost the largest over `ranks` (the slowest rank sets the pace of a step)."""
    if ranks.size == 1:
        return table
    width = table.max_k + 1
    flat = ranks.max_over_ranks([s for row in table.seconds for s in row] + list(table.plain)
                                + [table.arrival], device)
    n = len(table.batch_sizes)
    rows = tuple(tuple(flat[i * width:(i + 1) * width]) for i in range(n))
    return StepCostTable(batch_sizes=table.batch_sizes, seconds=rows,
                         plain=tuple(flat[n * width:-1]), arrival=flat[-1])


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
            batch_sizes: tuple[int, ...] | None = None, samples: int = 1) -> StepCostTable:
    """Time whole engine steps at each batch size over fresh requests (aborted after): for
    every k in 0 .. num_steps, `repeats` steps back to back (after two warm-ups; the least
    mean of `samples` such runs, each sample over requests of its own and every k in turn)
    with the policy forced to k; then plain engine steps (`plain_step`) over fresh requests
    again. A step's
    time covers all it does -- the round (drafting, verify, draft-extend), its host read, the
    commit's stop checks and detokenizing -- since a plain step overlaps that host work with
    the GPU and a round does not, pricing rounds alone made them look cheaper than they run.
    At one batch size (`ARRIVAL_BATCH`) it also prices a prompt arriving (`_arrival`).
    Returns the measured table's monotone envelope (`StepCostTable.envelope`)."""
    if batch_sizes is None:
        batch_sizes = GPU_BATCH_SIZES if eng.device.type == "cuda" else CPU_BATCH_SIZES
    sizes = tuple(b for b in batch_sizes if b <= _max_batch(eng, repeats, samples)) or (1,)
    sched = eng.spec_scheduler
    policy = sched.policy
    seconds, plain = [], []
    # the arriving request needs a free sequence slot next to the batch (and the pages that
    # the larger batches leave free)
    room = min(ARRIVAL_BATCH, eng.cfg.max_num_seqs - 1, sizes[-1] - 1 if len(sizes) > 1 else 0)
    arrival_at = max((b for b in sizes if b <= room), default=None)
    arrival = 0.0
    # Rounds are timed without verifying ahead (spec/ahead.py). On an H200 these short runs
    # priced batch-1 rounds that verify ahead at 1.61 ms, twice, against 1.32 for what they
    # serve. Timed without it, they priced 1.32 (session 23; the cause is not known yet:
    # TANDEM_PROFILE_VERIFY_AHEAD=1 times them verifying ahead, to find it).
    ahead = getattr(eng, "draft_ahead", None)
    verify_batch = ahead.verify_batch if ahead is not None else 0
    if ahead is not None and os.environ.get("TANDEM_PROFILE_VERIFY_AHEAD") != "1":
        ahead.verify_batch = 0
    try:
        for b in sizes:
            # Each sample times every k in turn (the least per k kept), over requests of its
            # own: a drift of the host's speed touches every k alike, and every k (and the
            # plain step below) runs over the same contexts.
            row = [float("inf")] * (eng.spec.num_steps + 1)
            by_rounds = 0.0
            for sample in range(samples):
                # Seeded under a fixed k: a policy whose plain regime holds would never seed
                sched.policy = FixedK(eng.spec.num_steps)
                req_ids = _seeded_requests(eng, b)
                try:
                    for k in range(len(row)):
                        sched.policy = FixedK(k)
                        before = ahead.counts() if ahead is not None else {}
                        took = _time_steps(eng, eng.step, repeats)
                        row[k] = min(row[k], took)
                        after = ahead.counts() if ahead is not None else {}
                        log.debug("spec cost, batch %d, k %d: %.3f ms; queued ahead since: %s",
                                  b, k, took * 1e3, {n: after[n] - before[n] for n in after})
                    if sample == 0 and b == arrival_at:  # (still under k = num_steps)
                        by_rounds = _arrival(eng, eng.step, repeats)
                finally:
                    for rid in req_ids:
                        eng.abort(rid)
            sched.policy = FixedK(eng.spec.num_steps)
            req_ids = _seeded_requests(eng, b)
            try:
                sched.policy = policy
                for rid in req_ids:  # plain from here: the plain engine's own steps
                    sched.drop_seed(rid)
                plain.append(_time_steps(eng, eng.plain_step, max(4, 4 * repeats), samples))
                if b == arrival_at:
                    by_plain = _arrival(eng, eng.plain_step, repeats)
                    arrival = max(0.0, by_rounds - by_plain)
                    log.info("spec cost, batch %d: a prompt arriving adds %.2f ms to a round, "
                             "%.2f ms to a plain step", b, by_rounds * 1e3, by_plain * 1e3)
                eng.leave_overlap()
            finally:
                for rid in req_ids:
                    eng.abort(rid)
            seconds.append(tuple(row))
            log.info("spec cost, batch %d: %s ms; plain step %.2f ms", b,
                     ", ".join(f"{s * 1e3:.2f}" for s in row), plain[-1] * 1e3)
    finally:
        sched.policy = policy
        eng.leave_overlap()
        if ahead is not None:
            ahead.verify_batch = verify_batch
    eng.spec_stats = SpecStats()  # the profiling rounds are no request's acceptance
    log.info("spec cost: a prompt arriving costs %.2f ms more under rounds (batch %s)",
             arrival * 1e3, arrival_at)
    measured = StepCostTable(batch_sizes=sizes, seconds=tuple(seconds), plain=tuple(plain),
                             arrival=arrival)
    table = measured.envelope()
    if table != measured:
        log.info("spec cost table: entries above one of more work taken down to it (noise)")
    return table


def _growth(eng: SpecEngine, repeats: int, samples: int = 1) -> int:
    """Tokens a profiling request may gain: in one sample, every k's steps (2 warm-ups +
    the timed ones) commit at most k + 1 each, then an arrival's steps; or, made plain, its
    plain steps one each and an arrival's."""
    arrivals = (1 + 2 * max(2, repeats)) * (eng.spec.num_steps + 2)  # `_arrival`, both ways
    k_steps = sum(k + 1 for k in range(eng.spec.num_steps + 1)) * (2 + repeats)
    plain_steps = 2 + samples * max(4, 4 * repeats)
    return max(k_steps, plain_steps) + 1 + arrivals


def _max_batch(eng: SpecEngine, repeats: int, samples: int = 1) -> int:
    """Requests of the profiling prompt that fit the pool as they grow, with a round's slots
    each. (`_arrival` adds one more request only at a batch size with room for it.)"""
    tokens = len(_PROMPT) + _growth(eng, repeats, samples) + eng.spec.slots_per_round + 2
    return min(eng.cfg.max_num_seqs, eng.allocator.num_free // -(-tokens // eng.cfg.page_size))


def _seeded_requests(eng: SpecEngine, n: int) -> list[str]:
    """n greedy requests of the profiling prompt, stepped until each holds a draft seed."""
    params = SamplingParams(max_new_tokens=1 << 20, ignore_eos=True)
    req_ids = [eng.add_request(_PROMPT, params, f"__spec_cost_{i}") for i in range(n)]
    while not all(rid in eng.seeds for rid in req_ids):
        eng.step()
    return req_ids


def _syncer(eng: SpecEngine) -> Callable[[], None]:
    """What waits for the engine's device (SYNC: profiling only)."""
    return torch.cuda.synchronize if eng.device.type == "cuda" else (lambda: None)


def _arrival(eng: SpecEngine, step: Callable[[], list], repeats: int) -> float:
    """Seconds a step of `step` takes longer when a prompt (`_ARRIVING`) arrives in it than
    when none does: each timed alone (drained before and after), the least of `repeats`
    each; the arriving request is aborted after its step."""
    sync = _syncer(eng)
    params = SamplingParams(max_new_tokens=1 << 20, ignore_eos=True)

    def alone(arriving: bool) -> float:
        rid = eng.add_request(_ARRIVING, params, "__spec_cost_arriving") if arriving else None
        sync()
        t0 = time.perf_counter()
        step()
        sync()
        took = time.perf_counter() - t0
        eng.leave_overlap()  # (reads the step in flight, if any, before the abort)
        if rid is not None:
            eng.abort(rid)
        return took

    alone(True)  # warm-up: a first prompt step of this shape (its graph, its plans)
    with_prompt = min(alone(True) for _ in range(max(2, repeats)))
    without = min(alone(False) for _ in range(max(2, repeats)))
    return with_prompt - without


def _time_steps(eng: SpecEngine, step: Callable[[], list], n: int, samples: int = 1) -> float:
    """Seconds per call of `step`: the least mean of `samples` runs of `n` calls back to back,
    after two warm-up calls. The least, not the median: what disturbs a run (a first use's
    compilation or capture, a collection, another process) only ever adds time. (On an H100
    a single run of 5 priced a batch-1 round of one draft at 2.95 ms and one of four at 1.99.)"""
    sync = _syncer(eng)
    for _ in range(2):
        step()
    sync()
    best = float("inf")
    for _ in range(samples):
        t0 = time.perf_counter()
        for _ in range(n):
            step()
        sync()
        best = min(best, (time.perf_counter() - t0) / n)
    return best
