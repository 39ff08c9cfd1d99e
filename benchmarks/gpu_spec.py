"""EAGLE on the GPU: correctness first, then what one speculative round costs, piece by piece,
next to one plain decode step of the same batch.

On the device machine, from the repository root (1 GPU):

    source .devbundle/activate.sh; export PYTHONPATH=.:$PYTHONPATH
    python benchmarks/gpu_spec.py --out $OUT

Sections (each one's failure is caught, printed and recorded; later ones still run):
1. `check_fp32`: SmolLM2-shaped dummy model in float32 (torch reference attention, on the GPU):
   speculative greedy == plain greedy, token for token, with real drafting (random head:
   nothing accepted) and with scripted drafts that force every acceptance pattern (none,
   partial, all; chain, and a tree whose accepted path is not its first siblings).
2. per model (`smollm2-135m`, `llama-3.1-8b` presets, dummy bf16 weights, FlashInfer), per
   draft shape (chain k=4; a tree), per batch (1, 16):
   - bf16 check: scripted forced acceptance, speculative vs plain greedy (informative: bf16
     verify and decode numerics may part at near-ties; exactness is asserted in float32);
   - timings (CUDA events, warm-up, median of N): plain decode step (graph replay; and as a
     step with planning and the host sync), one draft forward, the whole drafting, verify
     (k+1 or tree tokens), acceptance, draft-extend, their sum, and a whole engine round
     (alone, and back to back: `spec_step_loop_ms`); the CUDA-graph versions of drafting
     (all k-1 steps in one graph), verify and draft-extend when the engine has them (the extend graph first checked
     against the eager extend: same top-k ids, hidden close);
   - speedup at tau = 2, 3, 4: tau * t_plain / t_round. Random weights accept (almost)
     nothing, so tau is an input here and the speedup is COMPUTED from the measured costs.
Prints a table last; every number goes to $OUT/gpu_spec.json (written after each section).
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT)]

import torch  # noqa: E402

from tandem.engine import EngineConfig, LLMEngine, ParallelContext, SamplingParams  # noqa: E402
from tandem.engine.attention import SeqSlice, build_metadata  # noqa: E402
from tandem.engine.cuda_graphs import pad_decode_slices, padded_batch_size  # noqa: E402
from tandem.engine.loader import DTYPES, build_model, resolve_model  # noqa: E402
from tandem.engine.runner import ForwardBatch  # noqa: E402
from tandem.spec import (  # noqa: E402
    DraftHeadConfig,
    DraftInput,
    SpecConfig,
    SpecEngine,
    VerifyInput,
    accept,
    draft_extend,
    dummy_head,
    make_extend_input,
    propose,
    target_features,
)
from tandem.spec.accept import launch_greedy_accept  # noqa: E402
from tandem.spec.evaluate import parting_gap  # noqa: E402
from tandem.spec.slices import verify_slices  # noqa: E402

DEV = torch.device("cuda")
DRAFT_VOCAB = -1  # --draft-vocab
CONFIGS: frozenset[str] | None = None  # --configs: the draft configurations to run (None: all)
PROFILE = False  # --profile: where a round's host and GPU time go (cProfile + a CUPTI trace)
OUT_DIR = Path("results")  # --out
RESULTS: dict = {"notes": [
    "Random (dummy) weights accept (almost) no drafts: speedups are computed as "
    "tau * t_plain / t_round from the measured costs at assumed tau = 2, 3, 4.",
    "*_ms fields are medians of CUDA-event spans; spans of eager phases include the host work "
    "between the events (the stream is idle when the first event is recorded); *_graph_ms "
    "replay-only fields are pure GPU time.",
]}
CHAIN = SpecConfig(num_steps=4)
TREE = SpecConfig(num_steps=4, topk=4, num_draft_tokens=16)
TREE8 = SpecConfig(num_steps=4, topk=2, num_draft_tokens=8)
# Wider and deeper trees, run only when --configs names them (`<name>_dv<N>k`): float32 tau of
# the shipped SmolLM2 head over a 16k draft vocabulary on the 50 chat prompts (session 21,
# CPU): 16 nodes of topk 8 2.88 (topk 4: 2.82), 32 nodes 3.12, 48 nodes over 6 steps 3.34.
WIDE_TREES = {"tree16t8": SpecConfig(num_steps=4, topk=8, num_draft_tokens=16),
              "tree32t8": SpecConfig(num_steps=4, topk=8, num_draft_tokens=32),
              "tree48s6": SpecConfig(num_steps=6, topk=8, num_draft_tokens=48)}


def log(*args: object) -> None:
    print(f"[{time.strftime('%H:%M:%S')}]", *args, flush=True)


def save(out: Path) -> None:
    (out / "gpu_spec.json").write_text(json.dumps(RESULTS, indent=1, default=str))


def event_ms(fn: Callable[[], object], iters: int, warmup: int = 2) -> float:
    """Median span (ms) of fn between two CUDA events, the stream drained before each call so
    the span covers fn's host work and its kernels. (Wall clock on a CPU dry run.)"""
    for _ in range(warmup):
        fn()
    times = []
    if DEV.type != "cuda":
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)
    for _ in range(iters):
        torch.cuda.synchronize()  # the stream drained: the span starts with fn
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def loop_ms(fn: Callable[[], object], iters: int, warmup: int = 2) -> float:
    """Mean wall time (ms) of `iters` back-to-back calls, the stream drained before the first
    and after the last: what a call costs when calls pipeline (host work of the next one
    overlapping the GPU work of this one)."""
    for _ in range(warmup):
        fn()
    if DEV.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    if DEV.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e3 / iters


def guarded(name: str, fn: Callable[[], object], sink: dict, out: Path) -> object:
    t0 = time.perf_counter()
    try:
        sink[name] = fn()
    except Exception as exc:  # keep going: later cases still report
        traceback.print_exc()
        sink[name] = {"error": repr(exc), "traceback": traceback.format_exc()[-4000:]}
    log(f"{name}: {time.perf_counter() - t0:.1f} s")
    save(out)
    return sink[name]


# ---- engines -----------------------------------------------------------------------------------

def engine_cfg(model: str, dtype: str, backend: str, graphs: bool, max_len: int, kv_bytes: int,
               max_seqs: int = 16) -> EngineConfig:
    if DEV.type != "cuda":  # CPU dry run of this script's logic
        backend, graphs = "torch", False
    return EngineConfig(model=model, load_format="dummy", device=DEV.type, dtype=dtype,
                        attention_backend=backend, cuda_graphs=graphs, max_num_seqs=max_seqs,
                        max_model_len=max_len, kv_cache_bytes=kv_bytes,
                        max_num_batched_tokens=8192)


def build_target_and_head(cfg: EngineConfig):
    model_cfg, path = resolve_model(cfg)
    max_len = min(cfg.max_model_len or model_cfg.max_context, model_cfg.max_context)
    model = build_model(model_cfg, path, cfg, ParallelContext(), max_len)
    head = dummy_head(DraftHeadConfig.like_target(model_cfg, "eagle"), model, DTYPES[cfg.dtype],
                      DEV, max_len)
    return model, head


class ScriptedSpecEngine(SpecEngine):
    """Drafts come from the plain greedy reference (`refs`, per request id): request r's round
    t gets its first m = (r + t) % (depth + 1) drafts right, so every acceptance pattern
    occurs. Tree configs get a comb: two siblings per level, the continuing one second (so an
    accepted path is never nodes 1, 2, ... and the KV compaction runs), extra wrong children
    of the root up to the tree size."""

    def __init__(self, *a, refs: dict[str, list[int]], **kw) -> None:
        super().__init__(*a, **kw)
        self.refs, self.round_of = refs, 0
        self.accepted: list[int] = []

    def _propose(self, req_ids: list[str], inp: DraftInput, num_drafts: int = 0
                 ) -> VerifyInput:
        del num_drafts  # always num_steps here (no k policy)
        n = self.spec.tree_size
        depth = self.spec.num_steps if self.spec.topk == 1 else min(self.spec.num_steps,
                                                                      (n - 1) // 2)
        last = inp.last_tokens.tolist()
        vocab = self.model_cfg.vocab_size
        tokens, parents, depths = [], [], []
        for r, rid in enumerate(req_ids):
            done = len(self.scheduler.requests[rid].output_ids)
            ref = self.refs[rid][done:] + [0] * (depth + 1)
            m = (r + self.round_of) % (depth + 1)
            wrong = [(ref[i] + 1 + i) % vocab for i in range(depth)]
            good = [ref[i] if i < m else wrong[i] for i in range(depth)]
            if self.spec.topk == 1:
                toks, par = good, list(range(depth))
            else:
                toks, par, cur = [], [], 0
                for lvl in range(depth):
                    toks += [(wrong[lvl] + 7) % vocab, good[lvl]]
                    par += [cur, cur]
                    cur = len(toks)  # the second sibling continues
                while len(toks) < n - 1:
                    toks.append((ref[0] + 3 + len(toks)) % vocab)
                    par.append(0)
            dep = [0]
            for p in par:
                dep.append(dep[p] + 1)
            tokens.append([last[r], *toks])
            parents.append((-1, *par))
            depths.append(tuple(dep))
        self.round_of += 1
        return VerifyInput(page_ids=inp.page_ids, num_cached=inp.num_cached,
                           tokens=torch.tensor(tokens, dtype=torch.int64, device=self.device),
                           parents=tuple(parents), depths=tuple(depths))

    def _commit(self, reqs, result, nxt, num_drafts):
        self.accepted += list(result.num_accepted)
        return super()._commit(reqs, result, nxt, num_drafts)


def _prompts(n: int, vocab: int, lo: int, hi: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (int(torch.randint(lo, hi + 1, (1,), generator=g)),),
                          generator=g).tolist() for _ in range(n)]


def _compare(got: list[tuple[int, ...]], want: list[tuple[int, ...]]) -> dict:
    first = []
    for g, w in zip(got, want):
        d = next((i for i, (a, b) in enumerate(zip(g, w)) if a != b), None)
        first.append(d if d is not None or len(g) == len(w) else min(len(g), len(w)))
    return {"equal": sum(f is None for f in first), "of": len(first),
            "first_divergence": first}


def spec_vs_plain(cfg: EngineConfig, model, head, spec: SpecConfig, prompts: list[list[int]],
                  new_tokens: int, scripted: bool) -> dict:
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    plain = LLMEngine(cfg, model)
    want = [c.output_ids for c in plain.generate(prompts, params)]
    if scripted:
        refs = {f"r{i}": list(w) for i, w in enumerate(want)}
        eng: SpecEngine = ScriptedSpecEngine(cfg, spec, model, head, refs=refs)
    else:
        eng = SpecEngine(cfg, spec, model, head)
    ids = [eng.add_request(p, params, req_id=f"r{i}") for i, p in enumerate(prompts)]
    reqs = {i: eng.scheduler.requests[i] for i in ids}
    while eng.has_unfinished():
        eng.step()
    got = [tuple(reqs[i].output_ids) for i in ids]
    res = _compare(got, want)
    # Where they part: the plain model's two best logits there (a bf16 near-tie is a gap of
    # a few hundredths of the logit scale, with both outputs among the two).
    res["divergence_top2"] = [
        None if d is None else asdict(parting_gap(plain, list(p) + list(w[:d]), (g[d], w[d])))
        for p, g, w, d in zip(prompts, got, want, res["first_divergence"])
        if d is None or (d < len(g) and d < len(w))]
    del plain
    res["tau"] = eng.spec_stats.mean_acceptance_length
    res["spec_graphs"] = getattr(eng, "spec_graphs", None) is not None
    if scripted:
        acc = eng.accepted
        res["accepted_hist"] = {a: acc.count(a) for a in sorted(set(acc))}
    res["ok"] = res["equal"] == res["of"]
    del eng
    gc.collect()
    return res



def check_fp32() -> dict:
    """Exact equality in float32 (torch reference attention on the GPU, no graphs)."""
    cfg = engine_cfg("smollm2-135m", "float32", "torch", False, 1024, 256 << 20, max_seqs=8)
    model, head = build_target_and_head(cfg)
    prompts = _prompts(3, model.cfg.vocab_size, 5, 40, seed=1)
    out = {}
    for name, spec in (("chain4", CHAIN), ("tree", TREE)):
        for scripted in (False, True):
            key = f"{name}_{'scripted' if scripted else 'real_draft'}"
            try:
                out[key] = spec_vs_plain(cfg, model, head, spec, prompts, 24, scripted)
            except Exception as exc:
                traceback.print_exc()
                out[key] = {"error": repr(exc), "ok": False}
            log("fp32", key, out[key])
    del model, head
    gc.collect()
    torch.cuda.empty_cache()
    return out


def check_kernels(iters: int) -> dict:
    """The bookkeeping kernels (tandem/spec/kernels): Triton == torch twin on random trees,
    and each one's time at batch 16 (Triton launch vs the twin's many small ops)."""
    import random

    from tandem.spec.kernels import torch_ops, triton_ops

    res: dict = {"equal": 0, "cases": 0}
    rng = random.Random(0)
    timing_args: dict = {}
    for case in range(8):  # few shapes: each new (depth, N) compiles new kernel variants
        b, n = (16, 16) if case == 0 else (rng.randint(1, 64), rng.choice([5, 16]))
        par = [[-1] + [rng.randrange(j) if case % 2 else j - 1 for j in range(1, n)]
               for _ in range(b)]
        depth = max(_depth(p) for p in par)
        tokens = torch.randint(0, 3, (b, n), device=DEV)
        target = torch.randint(0, 3, (b, n), device=DEV)
        parents = torch.tensor(par, dtype=torch.int32, device=DEV)
        nc = torch.randint(0, 2000, (b,), device=DEV)
        table = (torch.randperm(b * 200, device=DEV).view(b, 200) + 1).to(torch.int32)
        sizes = [n * (c + n) for c in nc.tolist()]
        offsets = torch.tensor([sum(sizes[:r]) for r in range(b)], device=DEV)
        acc_args = (tokens, target, parents, depth)
        num, path, bonus = triton_ops.greedy_accept(*acc_args)
        ext_args = (tokens, path, num, bonus, nc, table, 16)
        mask_args = (parents, nc, offsets, sum(sizes), int(nc.max()))
        ok = all(torch.equal(a, w) for a, w in zip(triton_ops.greedy_accept(*acc_args),
                                                    torch_ops.greedy_accept(*acc_args)))
        ok &= all(torch.equal(a, w) for a, w in zip(triton_ops.extend_inputs(*ext_args),
                                                    torch_ops.extend_inputs(*ext_args)))
        ok &= torch.equal(triton_ops.tree_mask(*mask_args), torch_ops.tree_mask(*mask_args))
        res["equal"] += int(ok)
        res["cases"] += 1
        if case == 0:
            timing_args = {"greedy_accept": acc_args, "extend_inputs": ext_args,
                           "tree_mask": mask_args}
    res["ok"] = res["equal"] == res["cases"]
    for name, args in timing_args.items():
        for impl, mod in (("triton", triton_ops), ("torch", torch_ops)):
            res[f"{name}_{impl}_ms_bs16_n16"] = event_ms(lambda m=mod, a=args: getattr(m, name)(*a),
                                                         iters)
    return res


def _depth(parents: list[int]) -> int:
    d = [0] * len(parents)
    for j, p in enumerate(parents):
        d[j] = 0 if p < 0 else d[p] + 1
    return max(d)


# ---- timing one configuration ------------------------------------------------------------------

# How the timed requests choose tokens (--temperature, --top-p): greedy by default; sampled
# rounds accept by rejection sampling on the device (spec/device_accept.py).
SAMPLING: dict = {}


def _fill(eng: SpecEngine, bs: int, ctx: int, seed: int) -> list[str]:
    """bs requests with ctx-token prompts, prefilled and seeded, a few rounds in."""
    vocab = eng.model_cfg.vocab_size
    g = torch.Generator().manual_seed(seed)
    ids = [eng.add_request(torch.randint(3, vocab, (ctx,), generator=g).tolist(),
                           SamplingParams(max_new_tokens=100_000, ignore_eos=True, **SAMPLING))
           for _ in range(bs)]
    for _ in range(200):
        if all(i in eng.seeds for i in ids):
            break
        eng.step()
    for _ in range(3):
        eng.step()
    return ids


def _plain_decode_batch(eng: SpecEngine, req_ids: list[str], rows: int) -> ForwardBatch:
    """The decode step plain greedy would run for these requests now (nothing committed):
    each last token at position num_computed, padded to the graph's size."""
    reqs = [eng.scheduler.requests[r] for r in req_ids]
    slices = [SeqSlice(page_ids=r.page_ids, num_cached=r.num_computed, num_new=1) for r in reqs]
    lay = build_metadata(pad_decode_slices(slices, rows), eng.cfg.page_size, DEV)
    ids = [r.output_ids[-1] for r in reqs] + [0] * (rows - len(reqs))
    return ForwardBatch(input_ids=torch.tensor(ids, device=DEV), positions=lay.positions,
                        attn=lay.attn, logits_indices=torch.arange(len(reqs), device=DEV))


def _round_input(eng: SpecEngine, req_ids: list[str]) -> DraftInput:
    reqs = [eng.scheduler.requests[r] for r in req_ids]
    for r in reqs:  # pages for everything a round writes (a no-op when already there)
        ok, _ = eng.scheduler.reserve(r, r.num_computed + eng.spec.slots_per_round, set(req_ids))
        assert ok
    return DraftInput.from_seeds([eng.seeds[r] for r in req_ids], [r.page_ids for r in reqs])


def time_config(eng: SpecEngine, bs: int, ctx: int, iters: int) -> dict:
    spec = eng.spec
    req_ids = _fill(eng, bs, ctx, seed=bs)
    reqs = [eng.scheduler.requests[r] for r in req_ids]
    row: dict = {"batch": bs, "ctx": round(sum(r.num_tokens for r in reqs) / bs),
                 "num_steps": spec.num_steps, "topk": spec.topk, "tree_size": spec.tree_size}
    # The whole round as the engine runs it (its one host read waits for acceptance; the
    # draft-extend graph may still run when step() returns, so the span ends on an event).
    row["spec_step_ms"] = event_ms(eng.step, iters)
    # Back-to-back rounds, one drain at the end: the steady-state cost of a round when the
    # host prepares the next round while the GPU finishes this one's extend.
    row["spec_step_loop_ms"] = loop_ms(eng.step, iters)
    # The same with drafting ahead off (spec/ahead.py): each round drafts in its own step.
    was = eng.draft_ahead.enabled
    eng.set_draft_ahead(False)
    row["spec_step_loop_noahead_ms"] = loop_ms(eng.step, iters)
    eng.set_draft_ahead(was)
    # ... and with the next round's verify not queued ahead (drafting ahead alone).
    ahead = eng.draft_ahead
    vb, ahead.verify_batch = ahead.verify_batch, 0
    row["spec_step_loop_noverify_ms"] = loop_ms(eng.step, iters)
    ahead.verify_batch = vb
    row["draft_ahead"] = {"enabled": was, "verify_batch": vb, **ahead.counts()}
    # Plain decode of the same batch.
    rows = padded_batch_size(bs, eng.graphs.batch_sizes) if eng.graphs else None
    if rows is not None:
        batch = _plain_decode_batch(eng, req_ids, rows)
        # Plan this bucket first: replay_only reuses the latest plan, and the planner's buffers
        # are shared by every bucket (a stale plan of batch 1 under the graph of 16 was the
        # illegal memory access of 2026-11-26; replay_only now refuses it).
        eng.graphs.run(batch)
        row["plain_graph_ms"] = event_ms(lambda: eng.graphs.replay_only(rows), iters)

        def plain_step():
            b = _plain_decode_batch(eng, req_ids, rows)
            return eng.graphs.run(b).argmax(-1).tolist()  # SYNC: as a plain step does

        row["plain_step_ms"] = event_ms(plain_step, iters)
        row["plain_eager_ms"] = event_ms(lambda: eng.runner.forward(batch), max(3, iters // 4))
        # Paired: a plain step and a whole round alternately, so that drift of the card's
        # clocks between two separate measurements does not enter their ratio (separately
        # measured rows of session 3 differed by 0.5 ms in their plain step alone).
        pairs = [(event_ms(plain_step, 1, warmup=0), event_ms(eng.step, 1, warmup=0))
                 for _ in range(iters)]
        row["paired_plain_step_ms"] = statistics.median(p for p, _ in pairs)
        row["paired_spec_step_ms"] = statistics.median(r for _, r in pairs)
    # The round's pieces, eager (the speculative graphs off while they run).
    graphs = getattr(eng, "spec_graphs", None)
    eng.spec_graphs = None
    try:
        row.update(_eager_pieces(eng, req_ids, iters))
    finally:
        eng.spec_graphs = graphs
    inp, verify = row.pop("_inp"), row.pop("_verify")
    # The CUDA-graph versions, when the engine has them (tandem/spec/cuda_graphs.py).
    if graphs is not None:
        row.update(_graph_timings(eng, graphs, inp, verify, iters, req_ids))
    t_plain = row.get("plain_step_ms")
    if t_plain:
        row["speedup"] = {str(t): t * t_plain / row["spec_step_ms"] for t in (2, 3, 4)}
        row["speedup_loop"] = {str(t): t * t_plain / row["spec_step_loop_ms"] for t in (2, 3, 4)}
        row["speedup_paired"] = {str(t): t * row["paired_plain_step_ms"]
                                 / row["paired_spec_step_ms"] for t in (2, 3, 4)}
        if "spec_step_eager_ms" in row:
            row["speedup_eager_round"] = {str(t): t * t_plain / row["spec_step_eager_ms"]
                                          for t in (2, 3, 4)}
    if PROFILE and DEV.type == "cuda":
        row["profile"] = profile_round(eng, f"{eng.spec.num_steps}_{eng.spec.topk}_bs{bs}"
                                       f"_v{eng.head.cfg.draft_vocab_size or 0}")
    for r in req_ids:
        eng.abort(r)
    log(row)
    return row


def profile_round(eng: SpecEngine, tag: str, rounds: int = 30) -> dict:
    """Where a round's time goes: cProfile of `rounds` back-to-back engine rounds (host time
    by function, into OUT_DIR/profiles.txt) and a CUPTI trace of 4 rounds (OUT_DIR/trace_*.json.gz:
    the GPU's idle gaps and the host calls that open them)."""
    import cProfile
    import gzip
    import io
    import pstats

    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(rounds):
        eng.step()
    torch.cuda.synchronize()
    prof.disable()
    buf = io.StringIO()
    stats = pstats.Stats(prof, stream=buf)
    stats.sort_stats("tottime").print_stats(30)
    stats.sort_stats("cumulative").print_stats(45)
    with open(OUT_DIR / "profiles.txt", "a") as f:
        f.write(f"\n== {tag}: {rounds} rounds\n" + buf.getvalue())
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA],
                 with_stack=True) as tp:
        for _ in range(4):
            eng.step()
        torch.cuda.synchronize()
    raw = OUT_DIR / f"trace_{tag}.json"
    tp.export_chrome_trace(str(raw))
    with open(raw, "rb") as src, gzip.open(str(raw) + ".gz", "wb") as dst:
        dst.write(src.read())
    raw.unlink()
    # Kernel tables (profiles.txt): the whole round, its verify graph alone, the plain decode
    # graph of the same bucket -- what each kernel costs and how many launch.
    from gpu_engine import profile_replays

    tables = {"round": profile_replays(eng.step, OUT_DIR, f"{tag} round")}
    rows = eng.spec_graphs.bucket(len(eng.seeds)) if eng.spec_graphs else None
    for name, fn in (("verify", lambda: eng.spec_graphs.replay_phase_only("verify", rows)),
                     ("plain", lambda: eng.graphs.replay_only(rows))):
        try:
            tables[name] = profile_replays(fn, OUT_DIR, f"{tag} {name} graph replay")
        except Exception as exc:  # noqa: BLE001 -- a table missing is not fatal
            tables[name] = repr(exc)
    return {"trace": raw.name + ".gz", "kernels": tables}


def _eager_pieces(eng: SpecEngine, req_ids: list[str], iters: int) -> dict:
    spec = eng.spec
    reqs = [eng.scheduler.requests[r] for r in req_ids]
    row: dict = {}
    inp = _round_input(eng, req_ids)
    params = [r.params for r in reqs]
    gens = [r.generator for r in reqs]
    if spec.num_steps > 1:
        step_seqs = [SeqSlice(page_ids=p, num_cached=nc + (spec.topk if spec.topk > 1 else 0),
                              num_new=spec.topk) for p, nc in zip(inp.page_ids, inp.num_cached)]
        if spec.topk == 1:
            lay = build_metadata(step_seqs, eng.cfg.page_size, DEV)
            tok, hid = inp.topk_ids[:, 0], inp.hidden

            def one_step():
                h = eng.draft.forward(tok, hid, lay)
                return eng.head.topk(h, 1)
        else:  # the second draft forward of a tree (K nodes per request, causal over them)
            lay = build_metadata(step_seqs, eng.cfg.page_size, DEV)
            tok = inp.topk_ids.reshape(-1)
            hid = inp.hidden.repeat_interleave(spec.topk, dim=0)

            def one_step():
                h = eng.draft.forward(tok, hid, lay)
                return eng.head.topk(h, spec.topk)
        row["draft_step_ms"] = event_ms(one_step, iters)
    row["propose_ms"] = event_ms(lambda: propose(eng.draft, inp, spec), iters)
    verify = propose(eng.draft, inp, spec)
    row["verify_ms"] = event_ms(lambda: eng._verify_forward(verify), iters)
    out = eng._verify_forward(verify)
    row["accept_ms"] = event_ms(lambda: accept(verify, out.logits, params, gens), iters)
    result = accept(verify, out.logits, params, gens)
    feats = target_features(out, eng.head)
    row["extend_ms"] = event_ms(
        lambda: draft_extend(eng.draft, make_extend_input(verify, result, feats), spec.topk),
        iters)
    row["round_sum_ms"] = (row["propose_ms"] + row["verify_ms"] + row["accept_ms"]
                           + row["extend_ms"])
    row["_inp"], row["_verify"] = inp, verify
    return row


def _extend_graph_timings(eng: SpecEngine, graphs, verify: VerifyInput, rows: int,
                          iters: int) -> dict:
    """The draft-extend graph: equal to the eager ragged extend (top-k ids exactly, hidden
    close: other row counts may round differently in bf16), its call (planning + input copies
    + replay) and its replay alone."""
    res: dict = {}
    out = eng._verify_forward(verify)
    feats = target_features(out, eng.head).clone()
    pending = launch_greedy_accept(verify, out.logits)
    result = pending.result()
    args = (verify, pending.num_accepted, pending.path, pending.bonus, feats)
    got = graphs.extend(*args)
    want = draft_extend(eng.draft, make_extend_input(verify, result, feats), eng.spec.topk)
    res["extend_graph_topk_equal"] = bool(torch.equal(got.topk_ids, want.topk_ids))
    res["extend_graph_vs_eager_rel_err"] = float((got.hidden.float() - want.hidden.float()).norm()
                                                 / want.hidden.float().norm())
    res["extend_graph_accepted"] = list(result.num_accepted)
    res["extend_graph_call_ms"] = event_ms(lambda: graphs.extend(*args), iters)
    graphs.extend(*args)  # the latest extend plan is of this bucket again
    res["extend_graph_ms"] = event_ms(lambda: graphs.replay_phase_only("extend", rows), iters)
    return res


def _graph_timings(eng: SpecEngine, graphs, inp: DraftInput, verify: VerifyInput,
                   iters: int, req_ids: list[str]) -> dict:
    """Graph replays alone (pure GPU time), graphed phases with their planning, and a whole
    engine round with the speculative graphs switched off (the eager round, same engine)."""
    res: dict = {}
    rows = graphs.bucket(inp.batch_size)
    res["graph_bucket"] = rows
    if graphs.can_propose(inp):
        res["propose_graph_ms"] = event_ms(lambda: graphs.propose(inp), iters)
        got = graphs.propose(inp).tokens
        want = propose(eng.draft, inp, eng.spec).tokens
        res["propose_graph_equals_eager"] = bool(torch.equal(got, want))
        graphs.propose(inp)  # the drafting buffers hold this bucket's inputs again
        res["propose_replay_ms"] = event_ms(lambda: graphs.replay_phase_only("propose", rows), iters)
    tree = getattr(eng, "tree_graphs", None)
    if tree is not None and tree.can_propose(inp):  # tree drafting graph (spec/tree_graphs.py)
        res["propose_graph_ms"] = event_ms(lambda: tree.propose(inp), iters)
        got = tree.propose(inp)
        want = propose(eng.draft, inp, eng.spec)
        res["propose_graph_equals_eager"] = bool(torch.equal(got.tokens, want.tokens)
                                                 and got.parents == want.parents)
        tbucket = tree.bucket(inp.batch_size)
        res["propose_replay_ms"] = event_ms(lambda: tree.replay_only(tbucket), iters)
    if graphs.can_verify(verify):
        res["verify_graph_call_ms"] = event_ms(lambda: graphs.verify(verify), iters)
        g_logits = graphs.verify(verify).logits.clone()
        # The same forward eagerly (same mask mode; FlashInfer's eager prefill wrapper).
        lay = build_metadata(verify_slices(verify, masked=graphs.masked), eng.cfg.page_size, DEV)
        e_logits = eng.runner.forward(ForwardBatch(
            input_ids=verify.tokens.reshape(-1), positions=lay.positions, attn=lay.attn,
            logits_indices=torch.arange(g_logits.shape[0], device=DEV),
            capture_layers=eng.capture)).logits
        res["verify_graph_vs_eager_rel_err"] = float((g_logits - e_logits).norm()
                                                     / e_logits.norm())
        res["verify_graph_argmax_agree"] = float(
            (g_logits.argmax(-1) == e_logits.argmax(-1)).float().mean())
        graphs.verify(verify)  # the latest verify plan is of this bucket again
        res["verify_graph_ms"] = event_ms(lambda: graphs.replay_phase_only("verify", rows), iters)
    if graphs.can_extend(verify) and all(p.greedy for p in
                                         (eng.scheduler.requests[r].params for r in req_ids)):
        res.update(_extend_graph_timings(eng, graphs, verify, rows, iters))
    saved, eng.spec_graphs = eng.spec_graphs, None
    try:
        res["spec_step_eager_ms"] = event_ms(eng.step, iters)
    finally:
        eng.spec_graphs = saved
    return res


def bench_model(model_name: str, ctx: int, iters: int, kv_bytes: int, batches: tuple[int, ...],
                out: Path) -> dict:
    res: dict = {}
    cfg = engine_cfg(model_name, "bfloat16", "flashinfer", True, ctx + 512, kv_bytes)
    t0 = time.perf_counter()
    model, head = build_target_and_head(cfg)
    res["build_s"] = time.perf_counter() - t0
    runs = [("chain4", CHAIN, head), ("tree", TREE, head)]
    # The same chain with the head restricted to a draft vocabulary (tandem draft-vocab): each
    # draft step reads draft_vocab lm_head rows instead of the whole vocabulary.
    dv = DRAFT_VOCAB if DRAFT_VOCAB >= 0 else (8192 if model.cfg.vocab_size < 100_000 else 32768)
    if 0 < dv < model.cfg.vocab_size:
        sub = dummy_head(DraftHeadConfig.like_target(model.cfg, "eagle", draft_vocab_size=dv),
                         model, DTYPES[cfg.dtype], DEV, cfg.max_model_len)
        runs.append((f"chain4_dv{dv // 1024}k", CHAIN, sub))
        runs.append((f"tree_dv{dv // 1024}k", TREE, sub))  # 4 x 4, 16 nodes
        runs.append((f"tree8_dv{dv // 1024}k", TREE8, sub))  # 4 x 2, 8 nodes
        runs += [(f"{n}_dv{dv // 1024}k", spec, sub) for n, spec in WIDE_TREES.items()]
    for name, spec, head in runs:
        wide = name.split("_")[0] in WIDE_TREES
        if (CONFIGS is None and wide) or (CONFIGS is not None and name not in CONFIGS):
            continue
        prompts = _prompts(4, model.cfg.vocab_size, 8, 60, seed=2)

        def check(spec=spec, prompts=prompts, model=model, head=head):
            return spec_vs_plain(cfg, model, head, spec, prompts, 16, scripted=True)

        guarded(f"{name}_bf16_scripted_check", check, res, out)
        try:
            t0 = time.perf_counter()
            eng = SpecEngine(cfg, spec, model, head)
            res[f"{name}_engine_s"] = time.perf_counter() - t0
        except Exception as exc:
            traceback.print_exc()
            res[f"{name}_engine"] = {"error": repr(exc)}
            continue
        for bs in batches:
            guarded(f"{name}_bs{bs}", lambda eng=eng, bs=bs: time_config(eng, bs, ctx, iters),
                    res, out)
        del eng
        gc.collect()
        torch.cuda.empty_cache()
    del model, head
    gc.collect()
    torch.cuda.empty_cache()
    return res


# ---- driver ------------------------------------------------------------------------------------

def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=Path("results"))
    ap.add_argument("--ctx", type=int, default=512, help="prompt tokens per sequence")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--models", default="smollm2-135m,llama-3.1-8b")
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--skip-fp32", action="store_true")
    ap.add_argument("--device", default="cuda", help="cpu: a dry run of the script's logic")
    ap.add_argument("--draft-vocab", type=int, default=-1,
                    help="also time the chain with a head over this many draft tokens "
                         "(-1: 8192 below a 100k vocabulary, else 32768; 0: skip)")
    ap.add_argument("--configs", default="",
                    help="comma list of the draft configurations to run, e.g. chain4,chain4_dv32k "
                         "(default: all: chain4, tree, chain4_dv<N>k)")
    ap.add_argument("--profile", action="store_true",
                    help="per timed row: cProfile of 30 rounds (profiles.txt) and a CUPTI trace "
                         "of 4 (trace_*.json.gz)")
    ap.add_argument("--verify-plan", default="",
                    help="FlashInfer plan options for the verify and tree graphs, for an A/B "
                         "(comma list of uniform_q_len, disable_split_kv; default: none)")
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="the timed requests' temperature (0: greedy); > 0 times sampled rounds")
    ap.add_argument("--top-p", type=float, default=1.0)
    args = ap.parse_args()
    SAMPLING.update(temperature=args.temperature, top_p=args.top_p)
    if args.verify_plan:
        from tandem.engine.attention.flashinfer_backend import PrefillGraphWrappers

        opts = frozenset(o for o in args.verify_plan.split(",") if o)
        unknown = opts - {"uniform_q_len", "disable_split_kv"}
        if unknown:
            ap.error(f"--verify-plan: unknown option(s) {sorted(unknown)}")
        PrefillGraphWrappers.plan_options = opts
    global DEV, DRAFT_VOCAB, CONFIGS, PROFILE, OUT_DIR
    DEV = torch.device(args.device)
    DRAFT_VOCAB = args.draft_vocab
    CONFIGS = frozenset(c for c in args.configs.split(",") if c) or None
    PROFILE, OUT_DIR = args.profile, args.out
    args.out.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    try:
        import flashinfer
        import triton

        name = torch.cuda.get_device_name() if DEV.type == "cuda" else "cpu"
        RESULTS["env"] = dict(device=name, torch=torch.__version__, verify_plan=args.verify_plan,
                              flashinfer=flashinfer.__version__, triton=triton.__version__,
                              date=time.strftime("%Y-%m-%d"), sampling=SAMPLING)
    except Exception as exc:
        RESULTS["env"] = {"error": repr(exc)}
    log(RESULTS["env"])
    if DEV.type == "cuda":
        guarded("check_kernels", lambda: check_kernels(args.iters), RESULTS, args.out)
    if not args.skip_fp32:
        guarded("check_fp32", check_fp32, RESULTS, args.out)
    batches = tuple(int(b) for b in args.batches.split(","))
    for model_name in args.models.split(","):
        kv = (8 << 30) if "8b" in model_name else (2 << 30)
        guarded(model_name, lambda m=model_name: bench_model(m, args.ctx, args.iters, kv, batches,
                                                             args.out), RESULTS, args.out)
    RESULTS["wall_s"] = time.perf_counter() - t_start
    save(args.out)
    print_table()


def _f(x: object, fmt: str = "{:8.3f}") -> str:
    return fmt.format(x) if isinstance(x, (int, float)) else f"{'-':>8}"


def print_table() -> None:
    print("\n" + " | ".join(f"{k} {v}" for k, v in (RESULTS.get("env") or {}).items()))
    for note in RESULTS["notes"]:
        print("note:", note)
    print("bookkeeping kernels (Triton == torch twin):", RESULTS.get("check_kernels"))
    fp32 = RESULTS.get("check_fp32")
    if isinstance(fp32, dict):
        for k, v in fp32.items():
            if isinstance(v, dict):
                print(f"fp32 spec == plain, {k}: {v.get('equal')}/{v.get('of')} "
                      f"{'OK' if v.get('ok') else 'FAIL'} tau={_f(v.get('tau'), '{:.2f}')} "
                      f"{v.get('accepted_hist', '')} {v.get('error', '')}")
    cols = ("plain_graph_ms", "plain_step_ms", "draft_step_ms", "propose_ms", "verify_ms",
            "accept_ms", "extend_ms", "round_sum_ms", "spec_step_ms", "spec_step_loop_ms",
            "spec_step_loop_noverify_ms", "spec_step_loop_noahead_ms",
            "propose_replay_ms", "propose_graph_ms", "verify_graph_ms", "extend_graph_ms",
            "extend_graph_call_ms", "spec_step_eager_ms")
    short = ("plain_g", "plain", "d_step", "propose", "verify", "accept", "extend", "sum",
             "round", "round_l", "round_nv", "round_na", "prop_r", "prop_g", "verif_g", "ext_g",
             "ext_gc", "round_e")
    print("\ncolumns (ms): plain_g = plain decode graph replay (GPU); plain = plain step with "
          "planning + host sync; d_step/propose/verify/accept/extend/sum = eager pieces of a "
          "round; round = a whole engine round (spec graphs on when captured); round_l = "
          "rounds back to back (mean); round_nv / round_na = the same without verifying / "
          "drafting ahead; prop_r/prop_g/verif_g/ext_g = replay of the drafting "
          "graph (all k-1 steps) / graphed drafting with its input copies / verify replay / "
          "draft-extend replay; ext_gc "
          "= draft-extend graph call (planning + copies + replay); round_e = a whole round "
          "with the spec graphs off. speedup = tau * plain / round (computed, tau assumed; "
          "then the same with round_l, and with a plain step and a round timed alternately: "
          "paired).")
    print(f"{'model':<13} {'cfg':<7} {'bs':>3} " + " ".join(f"{s:>8}" for s in short)
          + "   speedup tau=2/3/4")
    for model_name in ("smollm2-135m", "llama-3.1-8b"):
        res = RESULTS.get(model_name)
        if not isinstance(res, dict):
            continue
        for key, row in res.items():
            if isinstance(row, dict) and "batch" in row:
                sp = row.get("speedup") or {}
                spl = row.get("speedup_loop") or {}
                spp = row.get("speedup_paired") or {}
                print(f"{model_name:<13} {key.rsplit('_bs', 1)[0]:<11} {row['batch']:>3} "
                      + " ".join(_f(row.get(c)) for c in cols) + "   "
                      + "/".join(_f(sp.get(t), "{:.2f}") for t in ("2", "3", "4")) + "  loop "
                      + "/".join(_f(spl.get(t), "{:.2f}") for t in ("2", "3", "4"))
                      + "  paired " + "/".join(_f(spp.get(t), "{:.2f}") for t in ("2", "3", "4")))
            elif isinstance(row, dict) and ("error" in row or "equal" in row):
                print(f"{model_name:<13} {key}: "
                      + (f"ERROR {row['error']}" if "error" in row else
                         f"{row['equal']}/{row['of']} equal, first divergence "
                         f"{row['first_divergence']}, accepted {row.get('accepted_hist')}, "
                         f"there top-2 {row.get('divergence_top2')}"))
    print(f"\nwall {RESULTS.get('wall_s', 0):.0f} s; JSON in gpu_spec.json")


if __name__ == "__main__":
    with torch.inference_mode():  # as serving runs: the kernels' dispatch keeps Triton
        main()
