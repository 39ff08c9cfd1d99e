"""Is plain greedy decoding the same from one process to the next? Batch 1 (one prompt at a
time, the one-row GEMV kernels), bf16, FlashInfer + CUDA graphs; prints a digest of the answers
and the GEMV configurations the process ran. Run it several times, with and without the
tuning record (`TANDEM_GEMV_TUNING_CACHE=0` times every process afresh):

    source .devbundle-fi/activate.sh; export PYTHONPATH=.:$PYTHONPATH
    for i in 1 2 3; do python benchmarks/gpu_determinism.py --model /tmp/gc/smollm2; done
"""

from __future__ import annotations

import argparse
import hashlib
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT)]

import torch  # noqa: E402

from tandem.engine import EngineConfig, LLMEngine, SamplingParams  # noqa: E402
from tandem.tokenizer import ChatMessage  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--prompts-file", default=str(ROOT / "tandem/assets/chat-prompts-50.txt"))
    ap.add_argument("--num-prompts", type=int, default=30)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    args = ap.parse_args()
    cfg = EngineConfig(model=args.model, device="cuda", dtype="bfloat16",
                       attention_backend="flashinfer", cuda_graphs=True, max_num_seqs=8,
                       max_model_len=1024, kv_cache_bytes=1 << 30)
    with torch.inference_mode():
        eng = LLMEngine.from_config(cfg)
        questions = [q.strip() for q in Path(args.prompts_file).read_text().splitlines()
                     if q.strip()][: args.num_prompts]
        params = SamplingParams(max_new_tokens=args.max_new_tokens)
        outs = []
        for q in questions:  # one at a time: batch-1 decode steps
            ids = eng.tokenizer.encode_chat([ChatMessage(role="user", content=q)])
            outs.append(tuple(eng.generate([ids], params)[0].output_ids))
    from tandem.engine.kernels import triton_gemv

    configs = sorted((repr(k), repr(v)) for k, v in triton_gemv.tuned_configs().items())
    print(f"answers {hashlib.md5(repr(outs).encode()).hexdigest()[:12]} "
          f"({sum(map(len, outs))} tokens); gemv configs "
          f"{hashlib.md5(repr(configs).encode()).hexdigest()[:12]} ({len(configs)} shapes)")


if __name__ == "__main__":
    main()
