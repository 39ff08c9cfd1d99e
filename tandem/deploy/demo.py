"""`tandem demo`: the whole system on this machine. A local Ray cluster, 1 prefill + 1 decode
worker (SmolLM2-135M-Instruct with its EAGLE head), KV over Mooncake (or NIXL), the gRPC
router on 127.0.0.1; a handful of chat prompts go through the public API and stream back, then
a summary table: TTFT, TPOT, acceptance length, and whether each answer equals the
non-speculative one (the target alone, greedy, in this process)."""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, replace
from typing import TextIO

QUESTIONS = (
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in two sentences what a CPU does.",
    "Give me three tips for learning a new language.",
    "What is the difference between a list and a tuple in Python?",
)


@dataclass(frozen=True, slots=True, kw_only=True)
class DemoOptions:
    transfer_backend: str = "mooncake"
    max_tokens: int = 96
    dtype: str = "bfloat16"
    check: bool = True  # compare with the non-speculative target
    draft_model: str | None = None  # head directory; None = the shipped head


@dataclass(frozen=True, slots=True, kw_only=True)
class DemoRow:
    question: str
    token_ids: tuple[int, ...]
    ttft_s: float
    tpot_s: float
    acceptance: float
    same_as_plain: bool | None
    first_difference: int | None
    logit_gap: float | None = None  # at the first difference: plain token's logit - this one's


def _deploy_config(opts: DemoOptions):
    from tandem.deploy.config import load_deploy

    cfg = load_deploy("local")
    return replace(cfg, transfer_backend=opts.transfer_backend,
                   engine=replace(cfg.engine, dtype=opts.dtype),
                   spec=replace(cfg.spec, draft_model=opts.draft_model or cfg.spec.draft_model))


def _ask(stub, question: str, max_tokens: int, out: TextIO):
    from tandem.proto import router_pb2 as pb

    req = pb.GenerateRequest(messages=[pb.ChatMessage(role="user", content=question)],
                             sampling=pb.SamplingParams(max_tokens=max_tokens))
    t0 = time.perf_counter()
    tokens: list[int] = []
    final = None
    for msg in stub.Generate(req, timeout=300):
        tokens.extend(msg.token_ids)
        out.write(msg.text_delta)
        out.flush()
        if msg.finish_reason:
            final = msg
    out.write("\n")
    wall = time.perf_counter() - t0
    return tokens, final, wall


def run_demo(opts: DemoOptions, out: TextIO = sys.stdout) -> list[DemoRow]:
    import grpc

    from tandem.deploy.launcher import init_ray
    from tandem.deploy.serve import launch_and_build
    from tandem.engine.model_import import ensure_default_model
    from tandem.proto import router_pb2_grpc as pb_grpc
    from tandem.router.app import BackgroundServer
    from tandem.router.server import ServerConfig

    t_start = time.perf_counter()
    ensure_default_model()
    cfg = _deploy_config(opts)
    out.write(f"tandem demo: SmolLM2-135M-Instruct, 1 prefill + 1 decode worker (Ray actors), "
              f"EAGLE chain k={cfg.spec.num_steps}, KV over {cfg.transfer_backend}, {opts.dtype}\n")
    init_ray(num_cpus=4)
    dep, router = launch_and_build(cfg)
    rows: list[DemoRow] = []
    try:
        server = BackgroundServer(router, ServerConfig(host="127.0.0.1", port=0)).start()
        out.write(f"workers up and gRPC router on 127.0.0.1:{server.port} after "
                  f"{time.perf_counter() - t_start:.1f} s\n")
        answers = []
        with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            stub = pb_grpc.RouterStub(channel)
            for q in QUESTIONS:
                out.write(f"\n>>> {q}\n")
                answers.append(_ask(stub, q, opts.max_tokens, out))
        server.stop()
        plain, plain_engine, plain_prompts = (
            _plain_answers(cfg, opts.max_tokens) if opts.check else (None, None, None))
        for i, (q, (tokens, final, _wall)) in enumerate(zip(QUESTIONS, answers)):
            n = len(tokens)
            ttft = final.ttft_s if final is not None else float("nan")
            tpot = (final.latency_s - final.ttft_s) / (n - 1) if final and n > 1 else 0.0
            acc = final.spec_stats.mean_acceptance_length if final and final.HasField(
                "spec_stats") else 0.0
            same, diff, gap = None, None, None
            if plain is not None:
                ref = plain[i]
                same = tuple(tokens) == ref
                if not same:
                    diff = next((j for j, (a, b) in enumerate(zip(tokens, ref)) if a != b),
                                min(len(tokens), len(ref)))
                    if diff < min(len(tokens), len(ref)):
                        gap = _logit_gap(plain_engine, plain_prompts[i] + list(ref[:diff]),
                                         ref[diff], tokens[diff])
            rows.append(DemoRow(question=q, token_ids=tuple(tokens), ttft_s=ttft, tpot_s=tpot,
                                acceptance=acc, same_as_plain=same, first_difference=diff,
                                logit_gap=gap))
    finally:
        dep.shutdown()
    _print_table(rows, out, time.perf_counter() - t_start, opts)
    return rows


def _logit_gap(engine, context: list[int], plain_tok: int, other_tok: int) -> float:
    """How close the two candidates were where the answers parted: the target's logit of its
    own greedy token minus that of the speculative run's token, at that position."""
    logits = engine.next_token_logits(context)
    return float(logits[plain_tok] - logits[other_tok])


def _plain_answers(cfg, max_tokens: int):
    """The target alone (no speculation, no transfer), greedy, same dtype: (answers, the
    engine, the prompts)."""
    from tandem.engine import LLMEngine, SamplingParams
    from tandem.tokenizer import ChatMessage

    engine = LLMEngine.from_config(cfg.engine)
    tok = engine.tokenizer
    prompts = [tok.encode_chat([ChatMessage(role="user", content=q)]) for q in QUESTIONS]
    done = engine.generate(prompts, SamplingParams(max_new_tokens=max_tokens))
    return [c.output_ids for c in done], engine, prompts


def _print_table(rows: list[DemoRow], out: TextIO, total_s: float, opts: DemoOptions) -> None:
    out.write("\n{:<44} {:>6} {:>8} {:>9} {:>6}  {}\n".format(
        "prompt", "tokens", "TTFT s", "TPOT ms", "tau", "same as non-speculative"))
    for r in rows:
        if r.same_as_plain is None:
            same = "not checked"
        elif r.same_as_plain:
            same = "yes"
        elif r.logit_gap is not None:
            same = f"no, from token {r.first_difference} (logit gap {r.logit_gap:.3f})"
        else:
            same = f"no, from token {r.first_difference}"
        out.write(f"{r.question[:44]:<44} {len(r.token_ids):>6} {r.ttft_s:>8.2f} "
                  f"{r.tpot_s * 1e3:>9.1f} {r.acceptance:>6.2f}  {same}\n")
    out.write(f"\ntotal {total_s:.1f} s. tau = tokens per speculative round (accepted drafts + 1).\n")
    if opts.dtype != "float32" and any(r.same_as_plain is False for r in rows):
        out.write("bf16 note: a verify forward over k+1 tokens is not bit-identical to k+1 single-"
                  "token forwards, so bf16 greedy runs can part where the two best tokens' "
                  "logits are nearly tied (the gap shown; bf16 keeps ~3 significant digits). "
                  "`--dtype float32` makes them token-identical.\n")
