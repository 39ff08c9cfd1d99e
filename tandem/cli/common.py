"""Flag groups and config builders that several commands share, and the logging set-up: the
engine flags (complete, train-eagle, eval-eagle, serve) and the sampling flags (complete,
generate)."""

from __future__ import annotations

import argparse
import logging
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the engine imports torch: commands load it only when they run
    from tandem.engine import EngineConfig, SamplingParams


class _EngineFlag(argparse.Action):
    """Stores an engine flag's value and notes that the command line gave it: over a deployment
    config (`tandem serve --config`), the flags given replace the config's engine fields and the
    others leave them alone, which a flag's default alone cannot tell apart."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        setattr(namespace, self.dest, self.const if self.nargs == 0 else values)
        namespace.engine_flags_given = (*getattr(namespace, "engine_flags_given", ()), self.dest)


def add_engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    flag = _EngineFlag
    g.add_argument("--model", action=flag, default="default",
                   help="HF checkpoint directory, a preset (smollm2-135m, llama-3.1-8b, "
                        "llama-3.1-70b, qwen3-30b-a3b; needs --load-format dummy) or 'default' "
                        "(the bundled "
                        "SmolLM2-135M-Instruct, imported once from its GGUF). Default: %(default)s")
    g.add_argument("--load-format", action=flag, choices=["auto", "dummy"], default="auto",
                   help="'dummy' fills random weights of the model's shape. Default: %(default)s")
    g.add_argument("--dtype", action=flag, choices=["bfloat16", "float32", "float16"],
                   default="bfloat16", help="Weights and KV cache dtype. Default: %(default)s")
    g.add_argument("--device", action=flag, default="cpu",
                   help="torch device. Default: %(default)s")
    g.add_argument("--attention-backend", action=flag, choices=["auto", "torch", "flashinfer"],
                   default="auto", help="auto: FlashInfer on CUDA, the torch reference elsewhere. "
                                        "Default: %(default)s")
    g.add_argument("--page-size", action=flag, type=int, default=16,
                   help="Tokens per KV page. Default: %(default)s")
    g.add_argument("--num-pages", action=flag, type=int, default=None,
                   help="KV pages (default: as many as --kv-cache-mib holds)")
    g.add_argument("--kv-cache-mib", action=flag, type=int, default=256,
                   help="KV cache memory when --num-pages is not given. Default: %(default)s")
    g.add_argument("--max-num-seqs", action=flag, type=int, default=64,
                   help="Requests decoded together. Default: %(default)s")
    g.add_argument("--max-num-batched-tokens", action=flag, type=int, default=512,
                   help="Tokens per forward (chunked-prefill budget). Default: %(default)s")
    g.add_argument("--enable-prefix-caching", action=flag, nargs=0, const=True, default=False,
                   help="Reuse the KV pages of prompt prefixes computed before")
    p.set_defaults(engine_flags_given=())


def engine_config_from_args(args: argparse.Namespace, base: EngineConfig | None = None
                            ) -> EngineConfig:
    """The engine flags as a config. Over `base` (a deployment config's engine section) only the
    flags given on the command line replace its fields; the rest keep the config's values."""
    import dataclasses

    from tandem.engine import EngineConfig

    values = {
        "model": args.model, "load_format": args.load_format, "dtype": args.dtype,
        "device": args.device, "attention_backend": args.attention_backend,
        "page_size": args.page_size, "num_pages": args.num_pages,
        "kv_cache_bytes": args.kv_cache_mib << 20, "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "enable_prefix_caching": args.enable_prefix_caching,
    }
    if base is None:
        return EngineConfig(**values)
    given = {"kv_cache_bytes" if dest == "kv_cache_mib" else dest
             for dest in args.engine_flags_given}
    if "kv_cache_bytes" in given:  # the memory given sizes the pool, not the config's num_pages
        given.add("num_pages")
    return dataclasses.replace(base, **{k: v for k, v in values.items() if k in given})


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
