"""Flag groups and config builders that several commands share, and the logging set-up: the
engine flags (complete, train-eagle, eval-eagle, serve) and the sampling flags (complete,
generate)."""

from __future__ import annotations

import argparse
import logging
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the engine imports torch: commands load it only when they run
    from tandem.engine import EngineConfig, SamplingParams


def add_engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--model", default="default",
                   help="HF checkpoint directory, a preset (smollm2-135m, llama-3.1-8b, "
                        "qwen3-30b-a3b; needs --load-format dummy) or 'default' (the bundled "
                        "SmolLM2-135M-Instruct, imported once from its GGUF). Default: %(default)s")
    g.add_argument("--load-format", choices=["auto", "dummy"], default="auto",
                   help="'dummy' fills random weights of the model's shape. Default: %(default)s")
    g.add_argument("--dtype", choices=["bfloat16", "float32", "float16"], default="bfloat16",
                   help="Weights and KV cache dtype. Default: %(default)s")
    g.add_argument("--device", default="cpu", help="torch device. Default: %(default)s")
    g.add_argument("--attention-backend", choices=["auto", "torch", "flashinfer"], default="auto",
                   help="auto: FlashInfer on CUDA, the torch reference elsewhere. "
                        "Default: %(default)s")
    g.add_argument("--page-size", type=int, default=16, help="Tokens per KV page. Default: %(default)s")
    g.add_argument("--num-pages", type=int, default=None,
                   help="KV pages (default: as many as --kv-cache-mib holds)")
    g.add_argument("--kv-cache-mib", type=int, default=256,
                   help="KV cache memory when --num-pages is not given. Default: %(default)s")
    g.add_argument("--max-num-seqs", type=int, default=64,
                   help="Requests decoded together. Default: %(default)s")
    g.add_argument("--max-num-batched-tokens", type=int, default=512,
                   help="Tokens per forward (chunked-prefill budget). Default: %(default)s")
    g.add_argument("--enable-prefix-caching", action="store_true",
                   help="Reuse the KV pages of prompt prefixes computed before")


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    from tandem.engine import EngineConfig

    return EngineConfig(
        model=args.model, load_format=args.load_format, dtype=args.dtype, device=args.device,
        attention_backend=args.attention_backend,
        page_size=args.page_size, num_pages=args.num_pages, kv_cache_bytes=args.kv_cache_mib << 20,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        enable_prefix_caching=args.enable_prefix_caching,
    )


def add_sampling_args(p: argparse.ArgumentParser, *, client: bool = False) -> None:
    """`client`: the flags of a request to a server (`tandem generate`), whose unset
    --max-new-tokens leaves max_tokens unset, so the server's default applies."""
    g = p.add_argument_group("sampling")
    # Either way capped by the context: the answer then ends there with finish reason length
    # (docs/architecture.md, "Request semantics").
    if client:
        g.add_argument("--max-new-tokens", type=int, default=None,
                       help="At most this many new tokens; the context's end stops earlier. "
                            "Default: the server's (tandem serve --default-max-tokens)")
    else:
        g.add_argument("--max-new-tokens", type=int, default=128,
                       help="At most this many new tokens; the context's end stops earlier. "
                            "Default: %(default)s")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy. Default: %(default)s")
    g.add_argument("--top-k", type=int, default=0, help="0 = off. Default: %(default)s")
    g.add_argument("--top-p", type=float, default=1.0, help="Default: %(default)s")
    g.add_argument("--min-p", type=float, default=0.0, help="Default: %(default)s")
    g.add_argument("--seed", type=int, default=None, help="Per-request sampling seed")
    g.add_argument("--stop", action="append", default=[], help="Stop string (repeatable)")


def sampling_params_from_args(args: argparse.Namespace) -> SamplingParams:
    from tandem.engine import SamplingParams

    return SamplingParams(
        max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
        top_p=args.top_p, min_p=args.min_p, seed=args.seed, stop=tuple(args.stop),
    )



def configure_logging(level: str) -> None:
    """Root logging at `level` (a `logging` level name), one line per record."""
    logging.basicConfig(level=getattr(logging, level),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
