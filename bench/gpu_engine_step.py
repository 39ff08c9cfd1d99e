"""A plain engine step at batch 1 (scheduling, metadata, the decode graph, sampling and the
host read, the output): mean wall time of steps back to back, with the step's metadata copied
without a stream sync (`engine/h2d`, what the engine does) and, alternately, with blocking
copies (`build_metadata(..., device)` and `torch.tensor(..., device=...)`, what it did before
session 9). Dummy bf16 weights, FlashInfer, CUDA graphs.

    source .devbundle-fi/activate.sh; export PYTHONPATH=.:$PYTHONPATH
    python bench/gpu_engine_step.py --models llama-3.1-8b,smollm2-135m
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT)]

import torch  # noqa: E402

from tandem.engine import EngineConfig, LLMEngine, SamplingParams, build_metadata  # noqa: E402
from tandem.engine import h2d as real_h2d  # noqa: E402
from tandem.engine import llm as llm_module  # noqa: E402

BLOCKING = SimpleNamespace(  # the copies before session 9: each waits for the stream
    build_layout=lambda seqs, page_size, device: build_metadata(seqs, page_size, device),
    tensor=lambda values, dtype, device: torch.tensor(values, dtype=dtype, device=device),
)


def steps_ms(eng: LLMEngine, n: int) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        eng.step()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e3 / n


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="llama-3.1-8b,smollm2-135m")
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=10, help="A/B pairs of `--steps` steps")
    ap.add_argument("--steps", type=int, default=20)
    args = ap.parse_args()
    print(torch.cuda.get_device_name(), time.strftime("%Y-%m-%d"))
    for model in args.models.split(","):
        cfg = EngineConfig(model=model, load_format="dummy", device="cuda", dtype="bfloat16",
                           attention_backend="flashinfer", cuda_graphs=True, max_num_seqs=8,
                           max_model_len=args.ctx + 4096,
                           kv_cache_bytes=(4 << 30) if "8b" in model else (1 << 30))
        with torch.inference_mode():
            eng = LLMEngine.from_config(cfg)
            g = torch.Generator().manual_seed(0)
            prompt = torch.randint(3, eng.model_cfg.vocab_size, (args.ctx,), generator=g)
            eng.add_request(prompt.tolist(), SamplingParams(max_new_tokens=100_000,
                                                            ignore_eos=True))
            for _ in range(20):  # prefill, then warm decode steps
                eng.step()
            new, old = [], []
            for _ in range(args.rounds):
                llm_module.h2d = real_h2d
                new.append(steps_ms(eng, args.steps))
                llm_module.h2d = BLOCKING
                old.append(steps_ms(eng, args.steps))
            llm_module.h2d = real_h2d
        a, b = statistics.median(new), statistics.median(old)
        print(f"{model}: engine step at batch 1, ctx {args.ctx}: {a:.3f} ms without stream "
              f"syncs, {b:.3f} ms with blocking copies ({b - a:+.3f} ms)")
        del eng
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
