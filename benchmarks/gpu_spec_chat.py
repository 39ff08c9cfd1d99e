"""Speculative vs plain decoding with real weights on the GPU: SmolLM2-135M-Instruct and the
EAGLE head tandem ships for it, chat prompts, greedy, bf16, FlashInfer + CUDA graphs.

On the device machine, once `benchmarks/gpu_train_eagle.sh` phases part0, part1a and gen (with
NUM_PROMPTS=0: import only) have put the imported model in /tmp/gc/smollm2:

    source .devbundle-fi/activate.sh; export PYTHONPATH=.:$PYTHONPATH
    python benchmarks/gpu_spec_chat.py --model /tmp/gc/smollm2 --out $OUT

Per engine (plain; speculative chain k=4 over the same model object):
- batch 1: the prompts one at a time; decode time per output token = (time of the last token -
  time of the first) / (tokens - 1), summed over prompts (prefill excluded);
- all prompts at once (continuous batching): output tokens per second, prefill included;
- tau and P(draft j accepted) of each phase; answers identical to plain (bf16: the two may part
  at near-ties, docs/architecture.md "Lossless"; float32 exactness is tested elsewhere).
Writes $OUT/gpu_spec_chat.json and prints a table.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT)]

import torch  # noqa: E402

from tandem.engine import EngineConfig, LLMEngine, SamplingParams  # noqa: E402
from tandem.spec import SpecConfig, SpecEngine  # noqa: E402
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


def all_at_once(eng: LLMEngine, prompts: list[list[int]], params: SamplingParams
                ) -> tuple[list[tuple[int, ...]], float]:
    t0 = time.perf_counter()
    outs = [tuple(c.output_ids) for c in eng.generate(prompts, params)]
    return outs, time.perf_counter() - t0


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
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--out", type=Path, default=Path("results"))
    ap.add_argument("--device", default="cuda", help="cpu: a dry run of the script's logic")
    ap.add_argument("--attention-backend", default=None,
                    help="default: flashinfer with CUDA graphs on cuda; torch (no graphs) "
                         "for the float32 exactness check")
    ap.add_argument("--skip-batch1", action="store_true",
                    help="all prompts at once only (the float32 check: eager steps are slow)")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    gpu = args.device == "cuda"
    backend = args.attention_backend or ("flashinfer" if gpu else "torch")
    cfg = EngineConfig(model=args.model, device=args.device, dtype=args.dtype,
                       attention_backend=backend, cuda_graphs=gpu and backend == "flashinfer",
                       max_num_seqs=64, max_model_len=1024,
                       kv_cache_bytes=(4 << 30) if gpu else (256 << 20))
    spec = SpecConfig(draft_model=args.draft_model, num_steps=4)
    name = torch.cuda.get_device_name() if gpu else "cpu"
    res: dict = {"env": {"device": name, "torch": torch.__version__,
                         "date": time.strftime("%Y-%m-%d"), "dtype": args.dtype,
                         "max_new_tokens": args.max_new_tokens}}
    with torch.inference_mode():
        spec_eng = SpecEngine.from_config(cfg, spec)
        tok = spec_eng.tokenizer
        plain = LLMEngine(cfg, spec_eng.model, tok)
        questions = [q.strip() for q in Path(args.prompts_file).read_text().splitlines()
                     if q.strip()]
        prompts = [tok.encode_chat([ChatMessage(role="user", content=q)]) for q in questions]
        params = SamplingParams(max_new_tokens=args.max_new_tokens)
        for eng in (plain, spec_eng):  # warm-up: Triton tuning, FlashInfer modules
            all_at_once(eng, prompts[:4], params)
        for name, eng in (("plain", plain), ("spec", spec_eng)):
            before = snapshot(spec_eng)
            row: dict = {}
            outs1: list[tuple[int, ...]] = []
            if not args.skip_batch1:
                outs1, dec_s, dec_n = one_at_a_time(eng, prompts, params)
                row = {"batch1_decode_ms_per_token": 1e3 * dec_s / dec_n, "batch1_tokens": dec_n}
                if name == "spec":
                    row["batch1_acceptance"] = stats_delta(spec_eng, before)
            before = snapshot(spec_eng)
            outs, wall = all_at_once(eng, prompts, params)
            row["all_tokens_per_s"] = sum(len(o) for o in outs) / wall
            row["all_wall_s"] = wall
            if name == "spec":
                row["all_acceptance"] = stats_delta(spec_eng, before)
            res[name] = row
            res[f"{name}_outputs"] = outs
            res[f"{name}_outputs_batch1"] = outs1
            print(name, json.dumps(row), flush=True)
        same = sum(a == b for a, b in zip(res["spec_outputs"], res["plain_outputs"]))
        res["identical_answers"] = f"{same}/{len(prompts)}"
        same1 = sum(a == b for a, b in zip(res["spec_outputs_batch1"],
                                           res["plain_outputs_batch1"]))
        res["identical_answers_batch1"] = ("-" if args.skip_batch1
                                           else f"{same1}/{len(prompts)}")
        res["divergences"] = divergences(plain, prompts, res["spec_outputs"],
                                         res["plain_outputs"])
        p, s = res["plain"], res["spec"]
        if not args.skip_batch1:
            res["speedup_batch1_decode"] = (p["batch1_decode_ms_per_token"]
                                            / s["batch1_decode_ms_per_token"])
        res["speedup_all_tokens_per_s"] = s["all_tokens_per_s"] / p["all_tokens_per_s"]
    (args.out / "gpu_spec_chat.json").write_text(json.dumps(res, indent=1))
    print(f"\n{res['env']}")
    if not args.skip_batch1:
        print(f"batch 1, decode ms/token: plain {p['batch1_decode_ms_per_token']:.3f}, "
              f"speculative {s['batch1_decode_ms_per_token']:.3f} (tau "
              f"{s['batch1_acceptance']['tau']:.2f}) -> {res['speedup_batch1_decode']:.2f}x")
    print(f"{len(prompts)} at once, tokens/s: plain {p['all_tokens_per_s']:.0f}, speculative "
          f"{s['all_tokens_per_s']:.0f} (tau {s['all_acceptance']['tau']:.2f}) -> "
          f"{res['speedup_all_tokens_per_s']:.2f}x; identical answers {res['identical_answers']} "
          f"(batch 1: {res['identical_answers_batch1']})")
    dv = res["divergences"]
    print(f"where they part ({dv['count']}): both tokens among plain's top 2 in "
          f"{dv['both_in_top2']}, top-2 gap <= {dv['max_rel_gap']:.4f} of the logit scale")


if __name__ == "__main__":
    main()
