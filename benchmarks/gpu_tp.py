"""TP decode on GPUs: CUDA graphs with collectives inside, NCCL vs the symmetric-memory
all-reduce (tandem/engine/allreduce.py). Correctness first, then timings.

On the device machine (2 GPUs), from the repository root:

    source benchmarks/gpu_env.sh; PYTHONUNBUFFERED=1 python3 benchmarks/gpu_tp.py --out $OUT

    python3 benchmarks/gpu_tp.py --smoke --out /tmp/tp   # CPU, gloo, a tiny Llama: end to end

    # 4 GPUs, the 70B shape (one GPU cannot hold it: no TP=1 reference; one engine per rank):
    python3 benchmarks/gpu_tp.py --out $OUT --tp 4 --model llama-3.1-70b --skip-tp1 \
        --custom-only --batch 1 64 --kv-bytes-tp2 8589934592

Phase 1 (one process, GPU 0): TP=1 engine with graphs -- greedy tokens and prompt logits (the
reference), whole step() and graph replay at each batch size. Phase 2 (one process per GPU,
NCCL): two TP=2 engines on the same dummy weights, `all_reduce: nccl` and `all_reduce: auto`.
  - all-reduce us per call (NCCL, one-shot, two-shot) at the batches' message sizes
    ([batch, hidden] bf16), eager and replayed in a CUDA graph; each method's sum vs NCCL's,
    and rank 0's vs rank 1's;
  - graph replay logits vs eager logits of the same padded decode batch (each engine);
  - prompt logits NCCL vs custom vs TP=1 (max |diff|); greedy tokens of TP=2 graphs (both
    engines) and TP=2 eager vs TP=1, equal except where the two runs part at a bf16 near-tie
    (both tokens in the top 2, gap <= 2% of the logit scale: tests/gpu/test_spec_graphs.py);
  - whole step() median (the engine's default overlap scheduling) and graph replay at each
    batch, next to the per-GPU floor (weight + KV bytes per GPU / copy bandwidth, same run).
Prints a table last; writes $OUT/gpu_tp.json.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

import torch  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

TINY = {  # --smoke: a Llama small enough for CPU ranks, shaped for TP=2 and TP=4
    "architectures": ["LlamaForCausalLM"], "vocab_size": 512, "hidden_size": 128,
    "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 8,
    "num_key_value_heads": 4, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
    "max_position_embeddings": 4096, "tie_word_embeddings": False, "eos_token_id": 2,
}
NEAR_TIE = 0.02  # tests/gpu/test_spec_graphs.py: two runs may part only within 2% of the scale


def log(*args: object) -> None:
    print(f"[{time.strftime('%H:%M:%S')}]", *args, flush=True)


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def engine(args, dev: torch.device, par, all_reduce: str, kv_bytes: int):
    from tandem.engine import EngineConfig, LLMEngine

    cuda = dev.type == "cuda"
    cfg = EngineConfig(model=args.model, load_format="dummy", device=str(dev),
                       dtype="bfloat16" if cuda else "float32",
                       attention_backend="flashinfer" if cuda else "torch", cuda_graphs=cuda,
                       max_num_seqs=max(args.batch), max_model_len=args.ctx + 512,
                       kv_cache_bytes=kv_bytes, max_num_batched_tokens=8192,
                       all_reduce=all_reduce)
    t0 = time.perf_counter()
    eng = LLMEngine.from_config(cfg, par)
    return eng, time.perf_counter() - t0


def prompts(vocab: int, n: int = 4) -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(3, vocab, (9 + 23 * i,), generator=g).tolist() for i in range(n)]


def greedy(eng, ps, new: int) -> list[list[int]]:
    from tandem.engine import SamplingParams

    return [c.output_ids for c in eng.generate(ps, SamplingParams(max_new_tokens=new,
                                                                  ignore_eos=True))]


def partings(eng, ps, got, want) -> list[dict]:
    """Where each run of `got` first parts from `want`, and how close the two tokens were
    (every rank calls this alike: next_token_logits runs a forward)."""
    from tandem.spec.evaluate import parting_gap

    rows = []
    for i, (p, a, b) in enumerate(zip(ps, got, want)):
        d = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), None)
        if d is None:
            rows.append(dict(prompt=i, equal=True))
            continue
        tie = parting_gap(eng, p + list(b[:d]), (a[d], b[d]))
        rows.append(dict(prompt=i, equal=False, at=d, rel_gap=tie.rel_gap,
                         both_in_top2=tie.both_in_top2,
                         near_tie=tie.both_in_top2 and tie.rel_gap <= NEAR_TIE))
    return rows


# ---- timing -------------------------------------------------------------------------------

def median_ms(fn, dev: torch.device, iters: int, warmup: int = 3) -> float:
    """Median wall ms of fn() with a device sync after each call (events need CUDA)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        sync(dev)
        t0 = time.perf_counter()
        fn()
        sync(dev)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def bench_steps(eng, args, bw: float, quiet: bool = False) -> list[dict]:
    """Whole step() (per-step wall time, median and mean over back-to-back steps) and graph
    replay at each batch size, with the per-GPU floor."""
    from gpu_engine import kv_bytes_per_token, weight_bytes_per_step

    from tandem.engine import SamplingParams

    dev, vocab = eng.device, eng.model_cfg.vocab_size
    w_bytes, per_tok = weight_bytes_per_step(eng), kv_bytes_per_token(eng)
    g = torch.Generator().manual_seed(0)
    rows = []
    for bs in args.batch:
        ids = [eng.add_request(torch.randint(3, vocab, (args.ctx,), generator=g).tolist(),
                               SamplingParams(max_new_tokens=400, ignore_eos=True))
               for _ in range(bs)]
        reqs = [eng.scheduler.requests[i] for i in ids]
        while any(not r.output_ids for r in reqs):  # prefill
            eng.step()
        for _ in range(5):
            eng.step()
        sync(dev)
        times, t_all = [], time.perf_counter()
        for _ in range(args.steps):
            t0 = time.perf_counter()
            eng.step()  # its host read (a step late under overlap scheduling)
            times.append((time.perf_counter() - t0) * 1e3)
        mean_ms = (time.perf_counter() - t_all) * 1e3 / args.steps
        kv_len = sum(r.num_tokens for r in reqs) / bs
        row = dict(batch=bs, ctx=round(kv_len), overlap=getattr(eng, "overlap", None),
                   step_median_ms=statistics.median(times), step_mean_ms=mean_ms,
                   floor_ms=(w_bytes + bs * kv_len * per_tok) / bw * 1e3 if bw else None,
                   weight_gb=w_bytes / 1e9, kv_gb=bs * kv_len * per_tok / 1e9)
        if eng.graphs is not None:
            from tandem.engine.cuda_graphs import padded_batch_size

            padded = padded_batch_size(bs, eng.graphs.batch_sizes)
            eng.step()  # the latest plan is of this size (replay_only needs it)
            row["graph_ms"] = median_ms(lambda: eng.graphs.replay_only(padded), dev, 30)
            if args.profile and bs in (1, 8):  # every rank replays (the collectives meet)
                from gpu_engine import profile_replays

                where = Path(tempfile.mkdtemp()) if quiet else args.out
                row["profile"] = profile_replays(lambda: eng.graphs.replay_only(padded),
                                                 where, f"{args.label} batch {bs}")
        rows.append(row)
        if not quiet:
            log(row)
        for i in ids:
            eng.abort(i)
        eng.step()  # drains an in-flight step (overlap)
    return rows


def spec_rounds(plain, args) -> list[dict]:
    """The EAGLE round on the TP engine's target (chain k=4, a random EAGLE-1 head over a 32k
    draft vocabulary -- 8k for smaller vocabularies --, its speculative graphs): rounds back to
    back at batch 1 and 8, median ms. Random weights accept nothing: the speedup is computed
    (tau x plain step / round, in `table`). The head shards over the TP ranks (spec/head.py
    `draft_tp`); `--draft-ab` also times it replicated, on the same ranks."""
    rows = _spec_rounds(plain, args, shard=True)
    if args.draft_ab:
        rows += _spec_rounds(plain, args, shard=False)
    if args.verify_ab:  # verify and extend planned on the host (FlashInfer), the head sharded
        os.environ["TANDEM_DEVICE_VERIFY"] = "0"
        try:
            rows += _spec_rounds(plain, args, shard=True)
        finally:
            os.environ.pop("TANDEM_DEVICE_VERIFY")
    return rows


def _spec_rounds(plain, args, shard: bool) -> list[dict]:
    from tandem.engine import SamplingParams
    from tandem.engine.loader import DTYPES
    from tandem.engine.parallel import ParallelGroup
    from tandem.spec import DraftHeadConfig, SpecConfig, SpecEngine, dummy_head

    cfg, dev = plain.model_cfg, plain.device
    vocab = 32768 if cfg.vocab_size > 100_000 else min(8192, cfg.vocab_size)
    head = dummy_head(DraftHeadConfig.like_target(cfg, "eagle", draft_vocab_size=vocab),
                      plain.model, DTYPES[plain.cfg.dtype], dev, args.ctx + 512,
                      tp=None if shard else ParallelGroup())
    eng = SpecEngine(plain.cfg, SpecConfig(num_steps=4), plain.model, head)
    draft = f"sharded over {head.tp.size}" if head.tp.size > 1 else "replicated"
    if os.environ.get("TANDEM_DEVICE_VERIFY") == "0":
        draft += ", verify planned"
    g, rows = torch.Generator().manual_seed(1), []
    for bs in sorted({1, min(8, plain.cfg.max_num_seqs)}):
        ids = [eng.add_request(torch.randint(3, cfg.vocab_size, (args.ctx,), generator=g).tolist(),
                               SamplingParams(max_new_tokens=400, ignore_eos=True))
               for _ in range(bs)]
        for _ in range(100):  # prefill: every request seeded
            if all(i in eng.seeds for i in ids):
                break
            eng.step()
        else:
            raise RuntimeError(f"spec_rounds: {bs} requests not all seeded after 100 steps")
        for _ in range(3):
            eng.step()
        # One round alone, without drafting ahead: with it a step's timed span would leave out
        # the round's drafting (queued by the step before, finished at the sync before t0).
        eng.set_draft_ahead(False)
        eng.step()
        times = []
        for _ in range(args.steps):
            sync(dev)
            t0 = time.perf_counter()
            eng.step()  # one round (its host read ends it)
            times.append((time.perf_counter() - t0) * 1e3)
        # Back to back (one drain at each end), drafting ahead on and off (spec/ahead.py): the
        # steady-state round, host work overlapping the GPU's.
        loop = {}
        for ahead in (True, False, True):
            eng.set_draft_ahead(ahead)
            sync(dev)
            t0 = time.perf_counter()
            for _ in range(args.steps):
                eng.step()
            sync(dev)
            loop["ahead" if ahead else "no_ahead"] = (time.perf_counter() - t0) * 1e3 / args.steps
        rows.append(dict(batch=bs, round_ms=statistics.median(times), draft_vocab=vocab,
                         draft=draft, graphs=eng.spec_graphs is not None, loop_ms=loop["ahead"],
                         loop_no_ahead_ms=loop["no_ahead"], ahead_used=eng.draft_ahead.used,
                         ahead_dropped=eng.draft_ahead.dropped))
        if args.profile and bs == 1 and dev.type == "cuda":  # every rank steps (collectives)
            from gpu_engine import profile_replays

            where = Path(tempfile.mkdtemp()) if plain.model.par.tp.rank else args.out
            rows[-1]["profile"] = profile_replays(eng.step, where,
                                                  f"{args.label} EAGLE round batch 1 "
                                                  f"(draft {draft})")
        for i in ids:
            eng.abort(i)
    del eng
    return rows


def copy_bandwidth(dev: torch.device) -> float:
    if dev.type != "cuda":
        return 0.0
    n = 2 << 30
    src = torch.randint(0, 255, (n,), dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src), dev, 10)
    return 2 * n / (ms * 1e-3)


# ---- phase 1: TP=1 --------------------------------------------------------------------------

def apply_ab(args) -> None:
    """A/B switches of this run, in every process (the ranks are spawned)."""
    if args.decode_cuda_cores:  # FlashInfer's decode kernel instead of its prefill kernel
        from tandem.engine.attention import flashinfer_backend

        flashinfer_backend.DecodeWrappers.__init__.__defaults__ = (False,)


def phase_tp1(args, ref_path: str) -> dict:
    from tandem.engine import ParallelContext

    apply_ab(args)
    dev = torch.device("cuda:0" if not args.smoke else "cpu")
    bw = copy_bandwidth(dev)
    eng, build_s = engine(args, dev, ParallelContext(), "nccl", args.kv_bytes_tp1)
    ps = prompts(eng.model_cfg.vocab_size)
    tokens = greedy(eng, ps, args.new_tokens)
    logits = torch.stack([eng.next_token_logits(p) for p in ps]).cpu()  # [P, V] float32
    torch.save({"tokens": tokens, "logits": logits}, ref_path)
    res = dict(copy_bytes_per_s=bw, build_s=build_s, steps=bench_steps(eng, args, bw))
    del eng
    gc.collect()
    return res


# ---- phase 2: TP=2 --------------------------------------------------------------------------

def bench_all_reduce(fast, group, dev, batches: list[int], hidden: int) -> list[dict]:
    """us per call of each method at [batch, hidden] bf16, eager and in a CUDA graph; each
    custom sum vs NCCL's, and every rank's result vs rank 0's."""
    import torch.distributed as dist

    from tandem.engine.allreduce import METHODS, NCCL, time_in_graph

    rows = []
    for bs in batches:
        g = torch.Generator(device=dev).manual_seed(100 + group.rank)
        x = torch.randn(bs, hidden, device=dev, generator=g).to(fast.dtype)
        want = fast.run(x, NCCL)
        row = dict(batch=bs, bytes=x.numel() * x.element_size())
        for m in METHODS:
            got = fast.run(x, m)
            parts = [torch.empty_like(got) for _ in range(group.size)]
            dist.all_gather(parts, got, group=group.handle)
            row[f"{m}_max_diff_vs_nccl"] = float((got.float() - want.float()).abs().max())
            row[f"{m}_ranks_equal"] = all(torch.equal(parts[0], p) for p in parts)
            eager_ms = median_ms(lambda m=m: [fast.run(x, m) for _ in range(20)], dev, 7) / 20
            row[f"{m}_eager_us"] = eager_ms * 1e3
            row[f"{m}_graph_us"] = time_in_graph(lambda m=m: fast.run(x, m))
        rows.append(row)
        if group.rank == 0:
            log(row)
    return rows


def flag_stress(fast, dev, hidden: int, calls: int = 48, replays: int = 30) -> dict:
    """The flag one-shot against NCCL under churn: `calls` all-reduces of mixed sizes (1 to
    64 rows, unaligned to its programs) captured in one CUDA graph and replayed `replays`
    times with fresh inputs each time, then the same eagerly; every output must equal NCCL's
    bitwise (two ranks: one rounding of a + b). A race on the slots or flags shows up as a
    mismatch (or a hang, bounded by the caller's timeout)."""
    from tandem.engine.allreduce import FLAG_ONE_SHOT, NCCL

    rows = ([1, 3, 8, 64, 2, 5, 17, 1, 33, 4] * calls)[:calls]
    xs = [torch.empty(r, hidden, dtype=fast.dtype, device=dev) for r in rows]
    g = torch.Generator(device=dev).manual_seed(7 + fast.group.rank)

    def refill() -> None:
        for x in xs:
            x.copy_(torch.randn(x.shape, device=dev, generator=g))

    refill()
    [fast.run(x, FLAG_ONE_SHOT) for x in xs]  # compile, warm
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = [fast.run(x, FLAG_ONE_SHOT) for x in xs]
    bad, checked = 0, 0
    for _ in range(replays):
        refill()
        graph.replay()
        want = [fast.run(x, NCCL) for x in xs]
        bad += sum(not torch.equal(o, w) for o, w in zip(outs, want))
        checked += len(xs)
        eager = [fast.run(x, FLAG_ONE_SHOT) for x in xs]
        bad += sum(not torch.equal(o, w) for o, w in zip(eager, want))
        checked += len(xs)
    sync(dev)
    return dict(checked=checked, mismatched=bad)


def graph_vs_eager(eng, sizes=(1, 3, 8)) -> list[dict]:
    """Replay vs eager forward of the same padded decode batch (pages of this engine)."""
    from tandem.engine.attention import SeqSlice, build_metadata
    from tandem.engine.cuda_graphs import pad_decode_slices, padded_batch_size
    from tandem.engine.runner import ForwardBatch

    rows, dev = [], eng.device
    for n in sizes:
        padded = padded_batch_size(n, eng.graphs.batch_sizes)
        pages = eng.allocator.alloc(4 * n)
        slices = [SeqSlice(page_ids=pages[4 * i : 4 * i + 4], num_cached=5 + 7 * i, num_new=1)
                  for i in range(n)]
        lay = build_metadata(pad_decode_slices(slices, padded), eng.cfg.page_size, dev)
        g = torch.Generator().manual_seed(n)
        ids = torch.randint(3, eng.model_cfg.vocab_size, (padded,), generator=g).to(dev)
        batch = ForwardBatch(input_ids=ids, positions=lay.positions, attn=lay.attn,
                             logits_indices=torch.arange(n, device=dev))
        got = eng.graphs.run(batch)
        want = eng.graphs.eager(batch)  # the same kernels (device-planned graphs: not FlashInfer)
        rows.append(dict(batch=n, graph_batch=padded, bitwise=bool(torch.equal(got, want)),
                         max_abs_diff=float((got - want).abs().max()),
                         top1_equal=bool(torch.equal(got.argmax(-1), want.argmax(-1)))))
        eng.allocator.free(pages)
    return rows


def join_ranks(rank: int, world: int, port: int, smoke: bool):
    """This process as rank `rank` of `world` (NCCL on GPU `rank`; gloo on the CPU with
    --smoke) -> (device, the world's ParallelGroup)."""
    import torch.distributed as dist

    from tandem.engine import ParallelGroup

    dev = torch.device("cpu" if smoke else f"cuda:{rank}")
    if smoke:
        torch.set_num_threads(1)
    else:
        torch.cuda.set_device(dev)
    dist.init_process_group("gloo" if smoke else "nccl",
                            init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    return dev, ParallelGroup(rank=rank, size=world, handle=dist.group.WORLD)


def phase_tp2(rank: int, args, port: int, ref_path: str, out_path: str) -> None:
    from tandem.engine import ParallelContext

    apply_ab(args)
    dev, group = join_ranks(rank, args.tp, port, args.smoke)
    par = ParallelContext(tp=group, ep=group)
    res: dict = {"rank": rank}

    def section(name, fn):
        t0 = time.perf_counter()
        try:
            res[name] = fn()
        except Exception as exc:  # later sections still report
            import traceback

            traceback.print_exc()
            res[name] = {"error": repr(exc)}
        if rank == 0:  # printed and saved as they come: a later hang loses nothing
            log(f"{name} ({time.perf_counter() - t0:.1f} s): {json.dumps(res[name], default=str)}")
            Path(out_path).write_text(json.dumps(res, default=str))

    with torch.inference_mode():
        bw = copy_bandwidth(dev)
        res["copy_bytes_per_s"] = bw
        custom, res["build_s_custom"] = engine(args, dev, par, "auto", args.kv_bytes_tp2)
        if args.custom_only:  # one engine (a 70B-shaped pair does not fit an H100 per rank)
            nccl = custom
        else:
            nccl, res["build_s_nccl"] = engine(args, dev, par, "nccl", args.kv_bytes_tp2)
        fast = custom.model.par.tp.fast
        res["custom_attached"] = fast is not None
        res["graph_batch_sizes"] = {k: e.graphs.batch_sizes if e.graphs else None
                                    for k, e in (("custom", custom), ("nccl", nccl))}
        if fast is not None:
            t = fast.table
            res["table"] = dict(sizes=t.sizes, methods=t.methods, us=t.us, chosen=t.chosen)
            if rank == 0:
                log("start-up table:\n" + t.describe())
            section("flag_stress", lambda: flag_stress(fast, dev, custom.model_cfg.hidden_size))
            section("all_reduce", lambda: bench_all_reduce(
                fast, custom.model.par.tp, dev, args.batch, custom.model_cfg.hidden_size))
        if custom.graphs is not None:
            section("graph_vs_eager_custom", lambda: graph_vs_eager(custom))
            section("graph_vs_eager_nccl", lambda: graph_vs_eager(nccl))
        if args.skip_tp1:  # no single-GPU reference (a model one GPU cannot hold)
            section("steps_custom", lambda: bench_steps(custom, args, bw, quiet=rank > 0))
            section("spec_rounds", lambda: spec_rounds(custom, args))
            _leave(rank, res, out_path)
        ref = torch.load(ref_path)
        ps = prompts(custom.model_cfg.vocab_size)

        def logits_check() -> dict:
            lc = torch.stack([custom.next_token_logits(p) for p in ps]).cpu()
            ln = torch.stack([nccl.next_token_logits(p) for p in ps]).cpu()
            return dict(custom_vs_nccl=float((lc - ln).abs().max()),
                        custom_bitwise_nccl=bool(torch.equal(lc, ln)),
                        nccl_vs_tp1=float((ln - ref["logits"]).abs().max()),
                        custom_vs_tp1=float((lc - ref["logits"]).abs().max()),
                        logit_scale=float(ref["logits"].abs().max()))

        section("prompt_logits", logits_check)

        def tokens_check() -> dict:
            runs = {"custom_graphs": greedy(custom, ps, args.new_tokens),
                    "nccl_graphs": greedy(nccl, ps, args.new_tokens)}
            graphs, nccl.graphs = nccl.graphs, None  # the same engine, eager decode
            runs["nccl_eager"] = greedy(nccl, ps, args.new_tokens)
            nccl.graphs = graphs
            out = {k: partings(nccl, ps, v, ref["tokens"]) for k, v in runs.items()}
            out["custom_graphs_vs_nccl_graphs_equal"] = runs["custom_graphs"] == runs["nccl_graphs"]
            out["nccl_graphs_vs_nccl_eager_equal"] = runs["nccl_graphs"] == runs["nccl_eager"]
            return out

        section("greedy", tokens_check)
        if not args.custom_only:
            section("steps_nccl", lambda: bench_steps(nccl, args, bw, quiet=rank > 0))
        section("steps_custom", lambda: bench_steps(custom, args, bw, quiet=rank > 0))
        section("spec_rounds", lambda: spec_rounds(custom, args))
    _leave(rank, res, out_path)


def _leave(rank: int, res: dict, out_path: str) -> None:
    if rank == 0:
        Path(out_path).write_text(json.dumps(res, default=str))
    # No destroy_process_group: ncclCommDestroy hangs on a communicator that CUDA graphs
    # captured (pytorch#115388; seen here on 2 H200s: both ranks hung after their last
    # section). The results are written; leave without tearing down.
    sys.stdout.flush()
    os._exit(0)


# ---- driver ---------------------------------------------------------------------------------

def table(results: dict) -> None:
    tp1, tp2 = results.get("tp1", {}), results.get("tp2", {})
    print(f"\n{results['env']}")
    print("all-reduce us/call (eager | graph):")
    for r in tp2.get("all_reduce") or []:
        if isinstance(r, dict):
            print(f"  batch {r['batch']:3d} ({r['bytes']:7d} B): " + "  ".join(
                f"{m} {r[m + '_eager_us']:6.1f} | {r[m + '_graph_us']:6.1f}"
                for m in ("nccl", "one_shot", "two_shot")))
    for key in ("table", "graph_vs_eager_custom", "graph_vs_eager_nccl", "prompt_logits",
                "greedy"):
        print(f"{key}: {tp2.get(key)}")
    print("\n           batch  ctx  step med  step mean  graph ms  floor ms  step/floor")
    n = results["env"].get("tp", 2)
    for name, rows in (("TP=1", tp1.get("steps")), (f"TP={n} nccl", tp2.get("steps_nccl")),
                       (f"TP={n} custom", tp2.get("steps_custom"))):
        for r in rows if isinstance(rows, list) else []:
            floor = r["floor_ms"] or float("nan")
            print(f"{name:<11} {r['batch']:5d} {r['ctx']:4d} {r['step_median_ms']:9.3f} "
                  f"{r['step_mean_ms']:10.3f} {r.get('graph_ms', float('nan')):9.3f} "
                  f"{floor:9.3f} {r['step_median_ms'] / floor:10.2f}x")
    plain = {r["batch"]: r["step_median_ms"] for r in tp2.get("steps_custom") or []
             if isinstance(r, dict)}
    for r in tp2.get("spec_rounds") or []:
        if isinstance(r, dict) and "round_ms" in r:
            base = plain.get(r["batch"])
            speed = f"{3 * base / r['round_ms']:.2f}x" if base else "n/a"
            print(f"EAGLE round TP={n}, batch {r['batch']}: {r['round_ms']:.3f} ms alone "
                  f"(chain k=4, draft vocab {r['draft_vocab']}, draft {r.get('draft', '?')}); "
                  f"computed speedup at tau 3: {speed}")
            if "loop_ms" in r and base:  # the steady state: what a served stream gets
                print(f"  back to back: {r['loop_ms']:.3f} ms drafting ahead "
                      f"({3 * base / r['loop_ms']:.2f}x; used {r['ahead_used']}, dropped "
                      f"{r['ahead_dropped']}), {r['loop_no_ahead_ms']:.3f} ms without "
                      f"({3 * base / r['loop_no_ahead_ms']:.2f}x)")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=Path("results"))
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--kv-bytes-tp1", type=int, default=14 << 30)
    ap.add_argument("--kv-bytes-tp2", type=int, default=8 << 30)
    ap.add_argument("--smoke", action="store_true", help="CPU + gloo, a tiny Llama")
    ap.add_argument("--profile", action="store_true",
                    help="kernel times of the batch-1 and batch-8 graph replays (CUPTI), "
                         "appended to $OUT/profiles.txt")
    ap.add_argument("--decode-cuda-cores", action="store_true",
                    help="A/B: FlashInfer's CUDA-core decode kernel (use_tensor_cores=False)")
    ap.add_argument("--label", default="tp",
                    help="names this run in profiles.txt (e.g. fused / unfused)")
    ap.add_argument("--tp", type=int, default=2, help="ranks (GPUs) of the TP engine")
    ap.add_argument("--draft-ab", action="store_true",
                    help="also time the EAGLE round with the draft head replicated")
    ap.add_argument("--verify-ab", action="store_true",
                    help="also time the EAGLE round with verify and extend planned on the host")
    ap.add_argument("--skip-tp1", action="store_true",
                    help="no TP=1 reference (a model one GPU cannot hold, e.g. llama-3.1-70b)")
    ap.add_argument("--custom-only", action="store_true",
                    help="one TP engine (the custom all-reduce), not a second NCCL-only one")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp())
    if args.smoke:
        (tmp / "tiny").mkdir()
        (tmp / "tiny" / "config.json").write_text(json.dumps(TINY))
        args.model, args.ctx, args.batch, args.steps, args.new_tokens = (
            str(tmp / "tiny"), 32, [1, 2], 4, 6)
        args.kv_bytes_tp1 = args.kv_bytes_tp2 = 16 << 20
    env = dict(torch=torch.__version__, date=time.strftime("%Y-%m-%d"), model=args.model,
               ctx=args.ctx, batch=args.batch, tp=args.tp)
    if torch.cuda.is_available() and not args.smoke:
        env["device"] = torch.cuda.get_device_name()
    results: dict = {"env": env}
    ref_path, out_path = str(tmp / "ref.pt"), str(args.out / "gpu_tp_ranks.json")
    log(env)
    if not args.skip_tp1:
        results["tp1"] = phase_tp1(args, ref_path)  # in this process: GPU 0, freed after
    (args.out / "gpu_tp.json").write_text(json.dumps(results, indent=1, default=str))
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    try:
        mp.start_processes(phase_tp2, args=(args, port, ref_path, out_path), nprocs=args.tp,
                           start_method="spawn")
    finally:  # what the ranks finished, even when one failed
        if Path(out_path).exists():
            results["tp2"] = json.loads(Path(out_path).read_text())
            (args.out / "gpu_tp.json").write_text(json.dumps(results, indent=1, default=str))
    table(results)


if __name__ == "__main__":
    with torch.inference_mode():
        main()
