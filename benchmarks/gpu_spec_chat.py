"""Speculative vs plain decoding with real weights on the GPU: SmolLM2-135M-Instruct and the
EAGLE head tandem ships for it, chat prompts, greedy (or sampled: --temperature), bf16,
FlashInfer + CUDA graphs.

On the device machine, once `benchmarks/gpu_train_eagle.sh` phases part0, part1a and gen (with
NUM_PROMPTS=0: import only) have put the imported model in /tmp/gc/smollm2:

    source .devbundle-fi/activate.sh; export PYTHONPATH=.:$PYTHONPATH
    python benchmarks/gpu_spec_chat.py --model /tmp/gc/smollm2 --out $OUT

Per engine (plain; speculative chain k=4 over the same model object; adaptive: k chosen per
step from the cost table it profiles at start-up, spec/adaptive.py):
- batch 1: the prompts one at a time; decode time per output token = (time of the last token -
  time of the first) / (tokens - 1), summed over prompts (prefill excluded);
- each --concurrency level C: every prompt, at most C in flight (a new one starts as one ends,
  like `tandem bench`'s closed-loop clients): output tokens per second, prefill included;
- tau and P(draft j accepted) per phase; answers next to plain's (bf16: the two may part at
  near-ties, docs/architecture.md "Lossless"; float32 exactness is tested elsewhere).
Writes $OUT/gpu_spec_chat.json and prints a table.
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import gc
import io
import itertools
import json
import os
import pstats
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT)]

import torch  # noqa: E402

from tandem.engine import EngineConfig, LLMEngine, SamplingParams  # noqa: E402
from tandem.spec import SpecConfig, SpecEngine  # noqa: E402
from tandem.spec.adaptive import AdaptivePolicy  # noqa: E402
from tandem.spec.evaluate import parting_gap  # noqa: E402
from tandem.spec.shipped import SHIPPED_HEADS  # noqa: E402
from tandem.tokenizer import ChatMessage  # noqa: E402


def one_at_a_time(eng: LLMEngine, prompts: list[list[int]], params: SamplingParams
                  ) -> tuple[list[tuple[int, ...]], float, int]:
    """-> (outputs, decode seconds summed over prompts, decode tokens summed)."""
    outs, decode_s, decode_tokens = [], 0.0, 0
    for p in prompts:
        rid = eng.add_request(p, params)
        first = last = None
        toks: list[int] = []
        while eng.has_unfinished():
            for o in eng.step():
                if o.req_id == rid and o.new_token_ids:
                    now = time.perf_counter()
                    first = now if first is None else first
                    last = now
                    toks += o.new_token_ids
        outs.append(tuple(toks))
        if first is not None and len(toks) > 1:
            decode_s += last - first
            decode_tokens += len(toks) - 1
    return outs, decode_s, decode_tokens


def policy_state(eng: LLMEngine) -> dict | None:
    """The adaptive policy's state (None for other engines): the engine-wide acceptance
    estimate, the served/priced scales of both regimes and the mean output length -- what
    `plain_wins` decides from."""
    pol = getattr(getattr(eng, "spec_scheduler", None), "policy", None)
    if not isinstance(pol, AdaptivePolicy):
        return None
    return {"overall": [round(p, 3) for p in pol.overall],
            "plain_scale": round(pol.plain_scale, 3), "round_scale": round(pol.round_scale, 3),
            "output_len": round(pol.output_len, 1),
            # served / priced per grid point of the cost table, served arrival extras, and
            # the (regime is rounds, grid point) pairs tried once unserved (spec/served.py)
            "prices": pol.prices.summary(), "arrival_ms": round(pol.arrival_cost * 1e3, 3),
            "explored": sorted(pol.explored), "explored_k": sorted(pol.explored_k),
            # draftings queued ahead that the next round used / had to drop (a change of k,
            # of the batch, or a plain step in between drops it: spec/ahead.py)
            "ahead_used": eng.draft_ahead.used, "ahead_dropped": eng.draft_ahead.dropped}


def closed_loop(eng: LLMEngine, prompts: list[list[int]], params: SamplingParams,
                concurrency: int) -> tuple[list[tuple[int, ...]], float, dict]:
    """Every prompt, at most `concurrency` in flight (a new one starts as one ends, as
    `tandem bench`'s closed-loop clients do) -> (outputs in prompt order, wall seconds, the
    median seconds from a request's add to its first token and from its first to its last,
    and where the steps' time went: `step_summary`)."""
    outs: list[tuple[int, ...]] = [()] * len(prompts)
    waiting = list(enumerate(prompts))
    running: dict[str, int] = {}
    toks: dict[str, list[int]] = {}
    added: dict[str, float] = {}
    first: dict[str, float] = {}
    ttft, decode = [], []
    # (seconds, requests held, a prompt arrived, kind: "plain" for the plain engine or the
    # plain regime, "round" where drafts were verified, "k0" for a speculative step that
    # verified none -- a k = 0 round; the round's k where the policy says, else -1)
    steps: list[tuple[float, int, bool, str, int]] = []
    spec = isinstance(eng, SpecEngine)
    t0 = time.perf_counter()
    while waiting or running:
        arrived = False
        while waiting and len(running) < concurrency:
            i, p = waiting.pop(0)
            rid = eng.add_request(p, params)
            running[rid], toks[rid], added[rid] = i, [], time.perf_counter()
            arrived = True
        held = len(eng.scheduler.requests)
        rounds = eng.spec_stats.num_rounds if spec else 0
        s0 = time.perf_counter()
        outputs = eng.step()
        took = time.perf_counter() - s0
        kind = "plain"
        if spec and eng.spec_stats.num_rounds > rounds:
            kind = "round"
        elif spec and not any(eng.spec_scheduler.is_plain(r) for r in eng.scheduler.requests):
            kind = "k0"
        steps.append((took, held, arrived, kind, round_k(eng) if kind == "round" else -1))
        for o in outputs:
            if o.req_id in running:
                now = time.perf_counter()
                if o.new_token_ids and o.req_id not in first:
                    first[o.req_id] = now
                    ttft.append(now - added[o.req_id])
                toks[o.req_id] += o.new_token_ids
                if o.finished:
                    outs[running.pop(o.req_id)] = tuple(toks.pop(o.req_id))
                    decode.append(now - first.get(o.req_id, now))
    times = {"ttft_p50_s": statistics.median(ttft) if ttft else None,
             "first_to_last_p50_s": statistics.median(decode) if decode else None,
             "steps": step_summary(steps)}
    return outs, time.perf_counter() - t0, times


def profile_run(eng: LLMEngine, prompts: list[list[int]], params: SamplingParams,
                concurrency: int, path: Path) -> None:
    """One closed-loop run under cProfile: its functions by own time and by cumulative time."""
    prof = cProfile.Profile()
    prof.enable()
    closed_loop(eng, prompts, params, concurrency)
    prof.disable()
    text = io.StringIO()
    stats = pstats.Stats(prof, stream=text)
    stats.sort_stats("tottime").print_stats(45)
    stats.sort_stats("cumulative").print_stats(70)
    path.write_text(text.getvalue())


def round_k(eng: SpecEngine) -> int:
    """k of the round a step just ran: num_steps without a policy, the adaptive policy's last
    unsplit plan (0 where it split), a fixed policy's k; -1 where the policy does not say."""
    pol = eng.spec_scheduler.policy
    if pol is None:
        return eng.spec.num_steps
    return getattr(pol, "last_k", getattr(pol, "k", -1))


def step_summary(steps: list[tuple[float, int, bool, str, int]]) -> dict:
    """Where a closed loop's time went: its steps, those right after a prompt arrived (whose
    step prefills it) and the others, each with count, mean ms and mean requests held; the
    others also by kind (plain, round, k0: see `closed_loop`)."""
    def part(rows) -> dict:
        rows = list(rows)
        n = len(rows)
        return {"steps": n, "mean_ms": 1e3 * sum(r[0] for r in rows) / n if n else 0.0,
                "total_s": sum(r[0] for r in rows),
                "mean_held": sum(r[1] for r in rows) / n if n else 0.0}

    other = [r for r in steps if not r[2]]
    arrival = [r for r in steps if r[2]]
    # Arrivals by kind too: "plain" is a prompt step of the plain engine or regime, "round" or
    # "k0" the speculative prompt step (target and draft prefill), the dearer one.
    return {"all": part(steps), "arrival": part(arrival),
            "other": part(other),
            "other_by_kind": {k: part(r for r in other if r[3] == k)
                              for k in sorted({r[3] for r in other})},
            "arrival_by_kind": {k: part(r for r in arrival if r[3] == k)
                                for k in sorted({r[3] for r in arrival})},
            # the served price of each k, next to the cost table's (k0: a split step)
            "other_rounds_by_k": {f"k{k}": part(r for r in other if r[3] == "round"
                                                and r[4] == k)
                                  for k in sorted({r[4] for r in other if r[3] == "round"})},
            # plain steps (engine or regime) without an arrival, by requests held: {held:
            # [steps, mean ms]}, what `matched_step_ratio` pairs across engines
            "plain_by_held": {h: [len(ms), 1e3 * sum(ms) / len(ms)] for h, ms in sorted(
                _by_held(r for r in other if r[3] == "plain").items())}}


def _by_held(rows) -> dict[int, list[float]]:
    out: dict[int, list[float]] = {}
    for r in rows:
        out.setdefault(r[1], []).append(r[0])
    return out


def matched_step_ratio(a: dict, b: dict) -> float | None:
    """Mean plain-step time of run `a` over run `b` at the same numbers of requests held
    (`plain_by_held`, keys may be str after JSON), each held count weighted by the fewer
    steps either ran there: the step's own cost, apart from how a run's tail went."""
    num = den = 0.0
    for h, (n, ms) in a.items():
        if h in b:
            w = min(n, b[h][0])
            num, den = num + w * ms, den + w * b[h][1]
    return num / den if den else None


class GcMeter:
    """Python's garbage collections while it is installed (gc.callbacks): count per
    generation and milliseconds, read and reset per run."""

    def __init__(self) -> None:
        self.counts, self.ms, self._t0 = [0, 0, 0], 0.0, 0.0
        gc.callbacks.append(self._cb)

    def _cb(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        else:
            self.counts[info["generation"]] += 1
            self.ms += 1e3 * (time.perf_counter() - self._t0)

    def take(self) -> dict:
        out = {"collections": list(self.counts), "ms": round(self.ms, 3)}
        self.counts, self.ms = [0, 0, 0], 0.0
        return out


def stats_delta(eng: SpecEngine, before: tuple[int, int, list[int]]) -> dict:
    st = eng.spec_stats
    rounds = st.num_rounds - before[0]
    tokens = st.num_tokens - before[1]
    acc = [a - b for a, b in zip(st.accepted_at, before[2] + [0] * len(st.accepted_at))]
    return {"tau": tokens / rounds if rounds else 0.0, "rounds": rounds,
            "p_accept": [a / rounds if rounds else 0.0 for a in acc]}


def snapshot(eng: SpecEngine) -> tuple[int, int, list[int]]:
    st = eng.spec_stats
    return st.num_rounds, st.num_tokens, list(st.accepted_at)


def divergences(plain: LLMEngine, prompts: list[list[int]], got: list[tuple[int, ...]],
                want: list[tuple[int, ...]]) -> dict:
    """Where speculative and plain answers part: the plain model's two best logits there
    (`spec.evaluate.parting_gap`). A bf16 near-tie is a gap of a small fraction of the logit
    scale with both tokens among the two."""
    ties = []
    for p, g, w in zip(prompts, got, want):
        d = next((i for i, (a, b) in enumerate(zip(g, w)) if a != b), None)
        if d is not None:
            ties.append(parting_gap(plain, list(p) + list(w[:d]), (g[d], w[d])))
    gaps = sorted(t.rel_gap for t in ties)
    return {"count": len(ties), "both_in_top2": sum(t.both_in_top2 for t in ties),
            "max_rel_gap": max(gaps, default=0.0), "rel_gaps": gaps}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True, help="imported SmolLM2-135M-Instruct directory")
    ap.add_argument("--draft-model", default=str(SHIPPED_HEADS["default"]))
    ap.add_argument("--prompts-file", default=str(ROOT / "tandem/assets/chat-prompts-50.txt"))
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="0: greedy (the default); > 0: sampled rounds (rejection sampling, "
                         "spec/device_accept.py), answers then differ between engines")
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--out", type=Path, default=Path("results"))
    ap.add_argument("--device", default="cuda", help="cpu: a dry run of the script's logic")
    ap.add_argument("--attention-backend", default=None,
                    help="default: flashinfer with CUDA graphs on cuda; torch (no graphs) "
                         "for the float32 exactness check")
    ap.add_argument("--concurrency", default="1,4,16,50",
                    help="closed-loop levels: at most C prompts in flight (default 1,4,16,50)")
    ap.add_argument("--engines", default="plain,spec,adaptive",
                    help="plain; spec (chain k=4 every step); adaptive (k per step, "
                         "spec/adaptive.py); tree (--tree's shape every step); spec_m, "
                         "adaptive_m: spec / adaptive with prompts merged into the round's "
                         "verify forward (TANDEM_MERGED_ARRIVALS=1); spec_va: spec verifying "
                         "the next round ahead at every batch size (TANDEM_VERIFY_AHEAD); "
                         "adaptive_s: adaptive over spec's model, as --adaptive-shares-model "
                         "(both in one process: does its own copy cost it?)")
    ap.add_argument("--tree", default="4,16",
                    help="the tree engine's TOPK,NODES (depth 4): 4,16 or 2,8")
    ap.add_argument("--repeats", type=int, default=3,
                    help="runs of each engine per level, interleaved; the median is reported")
    ap.add_argument("--skip-batch1", action="store_true",
                    help="no per-token decode timing one prompt at a time (eager is slow)")
    ap.add_argument("--pin-cpus", default="",
                    help="run on these CPUs only (os.sched_setaffinity), e.g. 0-7 or 0,2,4: "
                         "the host step time drifts run to run in one process (one NUMA "
                         "node's cores: `lscpu` lists them). Not one CPU: "
                         "pinned to one (session 20, H200) plain batch-1 decode took 1.12 "
                         "ms/token against 0.66 unpinned")
    ap.add_argument("--adaptive-shares-model", action="store_true",
                    help="the adaptive engine over the spec engine's weights, as the plain "
                         "one is (default: its own copy, as a server loads it)")
    ap.add_argument("--cprofile", default="",
                    help="levels (e.g. c16), comma-separated: after its repeats, one more run "
                         "of each engine under cProfile (OUT/cprofile_<engine>_<level>.txt: "
                         "host time by function; the run is untimed)")
    ap.add_argument("--gc-freeze", action="store_true",
                    help="gc.freeze() after the warm-up: start-up's objects leave the "
                         "collector's generations")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.pin_cpus:
        cpus = set()
        for part in args.pin_cpus.split(","):
            lo, _, hi = part.partition("-")
            cpus.update(range(int(lo), int(hi or lo) + 1))
        os.sched_setaffinity(0, cpus)
    meter = GcMeter()
    gpu = args.device == "cuda"
    backend = args.attention_backend or ("flashinfer" if gpu else "torch")
    levels = [int(c) for c in args.concurrency.split(",")]
    names = args.engines.split(",")
    cfg = EngineConfig(model=args.model, device=args.device, dtype=args.dtype,
                       attention_backend=backend, cuda_graphs=gpu and backend == "flashinfer",
                       max_num_seqs=64, max_model_len=1024,
                       kv_cache_bytes=(4 << 30) if gpu else (256 << 20))
    spec = SpecConfig(draft_model=args.draft_model, num_steps=4)
    dev_name = torch.cuda.get_device_name() if gpu else "cpu"
    res: dict = {"env": {"device": dev_name, "torch": torch.__version__,
                         "date": time.strftime("%Y-%m-%d"), "dtype": args.dtype,
                         "max_new_tokens": args.max_new_tokens, "levels": levels,
                         "temperature": args.temperature, "top_p": args.top_p}}
    with torch.inference_mode():
        spec_eng = SpecEngine.from_config(cfg, spec)
        tok = spec_eng.tokenizer
        engines: dict[str, LLMEngine] = {"spec": spec_eng,
                                         "plain": LLMEngine(cfg, spec_eng.model, tok)}
        if "tree" in names:  # tree drafting over the same target (its own draft KV)
            topk, nodes = (int(v) for v in args.tree.split(","))
            engines["tree"] = SpecEngine(cfg, dataclasses.replace(
                spec, topk=topk, num_draft_tokens=nodes), spec_eng.model,
                spec_eng.head, tokenizer=tok)
        if "spec_m" in names:  # spec with prompts merged into the round's verify forward
            engines["spec_m"] = SpecEngine(cfg, spec, spec_eng.model, spec_eng.head,
                                           tokenizer=tok)
            engines["spec_m"].merge_arrivals = True
        if "spec_va" in names:  # spec verifying the next round ahead at every batch size
            engines["spec_va"] = SpecEngine(cfg, spec, spec_eng.model, spec_eng.head,
                                            tokenizer=tok)
            engines["spec_va"].draft_ahead.verify_batch = cfg.max_num_seqs
        if "adaptive_m" in names:  # the same for adaptive (its profile prices merged arrivals)
            os.environ["TANDEM_MERGED_ARRIVALS"] = "1"
            engines["adaptive_m"] = SpecEngine(cfg, dataclasses.replace(spec, adaptive=True),
                                               spec_eng.model, spec_eng.head, tokenizer=tok)
            del os.environ["TANDEM_MERGED_ARRIVALS"]
            assert engines["adaptive_m"].merge_arrivals
        if "adaptive_s" in names:  # adaptive over spec's model and pools, as plain is
            engines["adaptive_s"] = SpecEngine(cfg, dataclasses.replace(spec, adaptive=True),
                                               spec_eng.model, spec_eng.head, tokenizer=tok)
        if "adaptive" in names:  # its own engine: profiles its cost table at start-up
            engines["adaptive"] = (SpecEngine(
                cfg, dataclasses.replace(spec, adaptive=True), spec_eng.model, spec_eng.head,
                tokenizer=tok) if args.adaptive_shares_model else SpecEngine.from_config(
                cfg, dataclasses.replace(spec, adaptive=True)))
            table = engines["adaptive"].spec_scheduler.policy.table
            res["adaptive_table"] = json.loads(table.to_json())
            print(f"adaptive cost table (ms): batch: k = 0..K | plain step; a prompt arriving "
                  f"under rounds costs {table.arrival * 1e3:.2f} ms more", flush=True)
            for b, row, p in itertools.zip_longest(table.batch_sizes, table.seconds,
                                                   table.plain):
                print(f"  {b:4d}: {' '.join(f'{x * 1e3:6.3f}' for x in row)} | "
                      f"{p * 1e3 if p else float('nan'):6.3f}", flush=True)
        questions = [q.strip() for q in Path(args.prompts_file).read_text().splitlines()
                     if q.strip()]
        prompts = [tok.encode_chat([ChatMessage(role="user", content=q)]) for q in questions]
        params = SamplingParams(max_new_tokens=args.max_new_tokens,
                                temperature=args.temperature, top_p=args.top_p)
        for name in names:  # warm-up: Triton tuning, FlashInfer modules
            closed_loop(engines[name], prompts[:4], params, 4)  # (outputs, wall, times) unused
        if args.gc_freeze:
            gc.collect()
            gc.freeze()
        res["env"].update(pin_cpus=args.pin_cpus, gc_freeze=args.gc_freeze,
                          gc_frozen=gc.get_freeze_count(), gc_tracked=len(gc.get_objects()))
        meter.take()
        # Interleaved: every measurement runs each engine in turn (the order rotated on each
        # repeat), so a drift of the machine (clocks, a busy host) touches every engine alike;
        # each engine reports its median repeat (its runs are kept beside it).
        phases = ([] if args.skip_batch1 else ["b1"]) + [f"c{c}" for c in levels]
        rows: dict[str, dict] = {name: {} for name in names}
        for phase in phases:
            for rep in range(args.repeats):
                k = rep % len(names)
                for name in names[k:] + names[:k]:
                    eng = engines[name]
                    is_spec = isinstance(eng, SpecEngine)
                    before = snapshot(eng) if is_spec else None
                    state0 = policy_state(eng)
                    if phase == "b1":
                        outs, dec_s, dec_n = one_at_a_time(eng, prompts, params)
                        lvl = {"decode_ms_per_token": 1e3 * dec_s / dec_n, "tokens": dec_n,
                               "tokens_per_s": dec_n / dec_s}
                    else:
                        outs, wall, times = closed_loop(eng, prompts, params, int(phase[1:]))
                        lvl = {"tokens_per_s": sum(len(o) for o in outs) / wall,
                               "wall_s": wall, **times}
                    if is_spec:
                        lvl["acceptance"] = stats_delta(eng, before)
                        lvl["ahead"] = eng.draft_ahead.counts()  # totals so far (spec/ahead.py)
                    if state0 is not None:  # what the adaptive policy decided from, and learnt
                        lvl["policy"] = {"before": state0, "after": policy_state(eng)}
                    lvl["gc"] = meter.take()
                    lvl["outputs"] = outs
                    rows[name].setdefault(phase, []).append(lvl)
            if phase in args.cprofile.split(","):  # one more run each, host time by function
                for name in names:
                    profile_run(engines[name], prompts, params, int(phase[1:]),
                                args.out / f"cprofile_{name}_{phase}.txt")
            for name in names:  # the median run (the lower one of an even count) stands
                runs = rows[name][phase]
                mid = sorted(runs, key=lambda r: r["tokens_per_s"])[(len(runs) - 1) // 2]
                res[f"{name}_outputs_{'batch1' if phase == 'b1' else phase}"] = \
                    mid.pop("outputs")
                mid["runs"] = [r["tokens_per_s"] for r in runs]
                mid["runs_gc"] = [r["gc"] for r in runs]
                if phase != "b1":
                    mid["runs_plain_by_held"] = [r["steps"]["plain_by_held"] for r in runs]
                rows[name][phase] = mid
            print(phase, json.dumps({n: round(rows[n][phase]["tokens_per_s"], 1)
                                     for n in names}), flush=True)
            for name in names:
                if "policy" in rows[name][phase]:
                    print(f"  {name} policy, the median run's start -> end: "
                          f"{rows[name][phase]['policy']}", flush=True)
        for name in names:
            row = rows[name]
            if "b1" in row:
                b1 = row.pop("b1")
                row["batch1_decode_ms_per_token"] = b1["decode_ms_per_token"]
                row["batch1_tokens"] = b1["tokens"]
                row["batch1_runs_tokens_per_s"] = b1["runs"]
                if "acceptance" in b1:
                    row["batch1_acceptance"] = b1["acceptance"]
            res[name] = row
            print(name, json.dumps(row), flush=True)
        summary = {}
        for name in names:
            if name == "plain" or "plain" not in names:
                continue
            p, s = res["plain"], res[name]
            sm: dict = {}
            if not args.skip_batch1:
                sm["batch1_decode_speedup"] = (p["batch1_decode_ms_per_token"]
                                               / s["batch1_decode_ms_per_token"])
            for c in levels:
                same = sum(a == b for a, b in zip(res[f"{name}_outputs_c{c}"],
                                                  res[f"plain_outputs_c{c}"]))
                # Per repeat (runs of one repeat ran back to back): the host's drift between
                # repeats (+-20% on some H200 hosts) cancels in these ratios, not in the medians'.
                paired = [a / b for a, b in zip(s[f"c{c}"]["runs"], p[f"c{c}"]["runs"])]
                sm[f"c{c}"] = {"tokens_per_s_ratio": s[f"c{c}"]["tokens_per_s"]
                               / p[f"c{c}"]["tokens_per_s"],
                               "paired_ratios": paired,
                               "paired_ratio_median": statistics.median(paired),
                               # plain steps at equal held counts, per repeat: a plain
                               # regime's step over the plain engine's (None: no plain steps)
                               "plain_step_ratios": [matched_step_ratio(x, y) for x, y in zip(
                                   s[f"c{c}"]["runs_plain_by_held"],
                                   p[f"c{c}"]["runs_plain_by_held"])],
                               "identical_answers": f"{same}/{len(prompts)}"}
            c = levels[-1]
            sm["divergences"] = divergences(engines["plain"], prompts,
                                            res[f"{name}_outputs_c{c}"],
                                            res[f"plain_outputs_c{c}"])
            summary[name] = sm
        res["summary"] = summary
    (args.out / "gpu_spec_chat.json").write_text(json.dumps(res, indent=1))
    print(f"\n{res['env']}")
    head = f"{'engine':<9} {'b1 ms/tok':>9} " + " ".join(f"{'c=' + str(c) + ' tok/s':>12}"
                                                           for c in levels)
    print(head)
    for name in names:
        r = res[name]
        b1 = f"{r['batch1_decode_ms_per_token']:9.3f}" if "batch1_decode_ms_per_token" in r \
            else f"{'-':>9}"
        cells = []
        for c in levels:
            cell = f"{r[f'c{c}']['tokens_per_s']:.0f}"
            if name in summary:
                cell += f" {summary[name][f'c{c}']['tokens_per_s_ratio']:.2f}x"
            cells.append(f"{cell:>12}")
        print(f"{name:<9} {b1} " + " ".join(cells))
    def by_kind(st: dict, key: str) -> str:
        kinds = st.get(key, {})
        text = " ".join(f"{k} {v['steps']}x{v['mean_ms']:.2f}" for k, v in kinds.items())
        return f" ({text})" if len(kinds) > 1 else ""

    def steps_cell(st: dict) -> str:
        a, o = st["arrival"], st["other"]
        return (f"{a['steps']}x{a['mean_ms']:.2f}ms@{a['mean_held']:.1f}"
                f"{by_kind(st, 'arrival_by_kind')} | "
                f"{o['steps']}x{o['mean_ms']:.2f}ms@{o['mean_held']:.1f}"
                f"{by_kind(st, 'other_by_kind')}")

    print("steps per level (after a prompt arrived | the others: count x mean ms @ requests "
          "held):")
    for name in names:
        print(f"  {name}: " + "; ".join(f"c={c} {steps_cell(res[name][f'c{c}']['steps'])}"
                                        for c in levels))
    def by_k(st: dict) -> str:
        return " ".join(f"{k} {v['steps']}x{v['mean_ms']:.2f}ms@{v['mean_held']:.1f}"
                        for k, v in st.get("other_rounds_by_k", {}).items()) or "-"

    print("rounds by k (not after an arrival): " + "; ".join(
        f"{name} " + " | ".join(f"c={c} {by_k(res[name][f'c{c}']['steps'])}" for c in levels)
        for name in names if name != "plain"))
    print("TTFT p50 ms (add -> first token) per level: " + "; ".join(
        f"{name} " + " ".join(f"{1e3 * (res[name][f'c{c}']['ttft_p50_s'] or 0):.1f}"
                              for c in levels) for name in names))
    print("garbage collections per level (gen 0/1/2 count, ms; the median run): " + "; ".join(
        f"{name} " + " ".join(
            "{}/{}/{} {:.1f}".format(*res[name][f'c{c}']['gc']['collections'],
                                     res[name][f'c{c}']['gc']['ms']) for c in levels)
        for name in names))
    for name, sm in summary.items():
        print(f"{name} / plain per repeat, median (min-max): " + "; ".join(
            f"c={c} {sm[f'c{c}']['paired_ratio_median']:.2f}x "
            f"({min(sm[f'c{c}']['paired_ratios']):.2f}-{max(sm[f'c{c}']['paired_ratios']):.2f})"
            for c in levels))
    for name, sm in summary.items():
        print(f"{name} plain steps over plain's at equal requests held, per repeat: " + "; ".join(
            f"c={c} " + " ".join("-" if x is None else f"{x:.3f}"
                                 for x in sm[f'c{c}']['plain_step_ratios']) for c in levels))
    for name, sm in summary.items():
        taus = " ".join(f"c={c}: {res[name][f'c{c}']['acceptance']['tau']:.2f}" for c in levels)
        same = " ".join(f"c={c}: {sm[f'c{c}']['identical_answers']}" for c in levels)
        dv = sm["divergences"]
        b1 = (f"batch 1 decode {sm['batch1_decode_speedup']:.2f}x; "
              if "batch1_decode_speedup" in sm else "")
        print(f"{name}: {b1}tau {taus}; identical answers {same}; where they part at "
              f"c={levels[-1]} ({dv['count']}): both among plain's top 2 in "
              f"{dv['both_in_top2']}, top-2 gap <= {dv['max_rel_gap']:.4f} of the logit scale")


if __name__ == "__main__":
    main()
