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


# Two tokens whose logits (the model's scores) are within this fraction of the best one's are
# a near-tie: bf16 keeps about 3 significant digits, and a verify forward over k+1 tokens rounds
# differently from k+1 one-token forwards, so a speculative and a plain run may pick either
# (docs/architecture.md, "Lossless"; the GPU test of the same allows the same margin).
NEAR_TIE = 0.02


def demo_dtype(device: str) -> str:
    """The demo's default dtype: float32 on the CPU, where speculative answers then equal the
    plain ones token for token (measured on a 2-core Xeon with AMX-bf16: the whole demo 44 s
    against 35 s in bf16; CPUs without bf16 instructions run bf16 slower still); bf16 on a GPU,
    where near-ties may show (explained in the table's notes)."""
    return "float32" if device == "cpu" else "bfloat16"


@dataclass(frozen=True, slots=True, kw_only=True)
class DemoOptions:
    transfer_backend: str = "mooncake"
    max_tokens: int = 96
    dtype: str | None = None  # None: demo_dtype of the config's device
    check: bool = True  # compare with the non-speculative target
    draft_model: str | None = None  # head directory; None = the shipped head


@dataclass(frozen=True, slots=True, kw_only=True)
class Parting:
    """Where a speculative answer first differs from the plain one: the two tokens there and the
    target's logits for them after the common prefix (one fresh forward)."""

    index: int  # of the first differing token
    plain_text: str  # the plain answer's token, as text
    spec_text: str  # the speculative answer's token, as text
    plain_logit: float
    spec_logit: float
    top_logit: float  # the best logit there

    @property
    def near_tie(self) -> bool:
        """Both tokens scored within NEAR_TIE of the best: either is the model's answer."""
        margin = NEAR_TIE * max(1.0, abs(self.top_logit))
        return min(self.plain_logit, self.spec_logit) >= self.top_logit - margin


@dataclass(frozen=True, slots=True, kw_only=True)
class DemoRow:
    question: str
    token_ids: tuple[int, ...]
    ttft_s: float
    tpot_s: float
    acceptance: float
    same_as_plain: bool | None
    first_difference: int | None
    parting: Parting | None = None  # where both answers go on after the first difference


def _deploy_config(opts: DemoOptions):
    from tandem.deploy.config import load_deploy

    cfg = load_deploy("local")
    return replace(cfg, transfer_backend=opts.transfer_backend,
                   engine=replace(cfg.engine, dtype=opts.dtype or demo_dtype(cfg.engine.device)),
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
              f"EAGLE chain k={cfg.spec.num_steps}, KV over {cfg.transfer_backend}, "
              f"{cfg.engine.dtype}\n")
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
            same, diff, parting = None, None, None
            if plain is not None:
                ref = plain[i]
                same = tuple(tokens) == ref
                if not same:
                    diff = next((j for j, (a, b) in enumerate(zip(tokens, ref)) if a != b),
                                min(len(tokens), len(ref)))
                    if diff < min(len(tokens), len(ref)):
                        parting = _parting(plain_engine, plain_prompts[i] + list(ref[:diff]),
                                           diff, ref[diff], tokens[diff])
            rows.append(DemoRow(question=q, token_ids=tuple(tokens), ttft_s=ttft, tpot_s=tpot,
                                acceptance=acc, same_as_plain=same, first_difference=diff,
                                parting=parting))
    finally:
        dep.shutdown()
    _print_table(rows, out, time.perf_counter() - t_start, cfg.engine.dtype)
    return rows


def _parting(engine, context: list[int], index: int, plain_tok: int, spec_tok: int) -> Parting:
    """How the target scored the two tokens where the answers parted (after `context`)."""
    logits = engine.next_token_logits(context)
    tok = engine.tokenizer
    return Parting(index=index, plain_text=tok.decode([plain_tok]),
                   spec_text=tok.decode([spec_tok]), plain_logit=float(logits[plain_tok]),
                   spec_logit=float(logits[spec_tok]), top_logit=float(logits.max()))


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


def _print_table(rows: list[DemoRow], out: TextIO, total_s: float, dtype: str) -> None:
    out.write("\n{:<44} {:>6} {:>8} {:>9} {:>6}  {}\n".format(
        "prompt", "tokens", "TTFT s", "TPOT ms", "tau", "same as non-speculative"))
    notes: list[tuple[str, Parting]] = []
    for r in rows:
        if r.same_as_plain is None:
            same = "not checked"
        elif r.same_as_plain:
            same = "yes"
        elif r.parting is None:  # one answer stopped where the other went on
            same = f"no, from token {r.first_difference} (one answer ended there)"
        else:
            notes.append((r.question, r.parting))
            kind = "near-tie" if r.parting.near_tie else "NOT a near-tie"
            same = f"no, from token {r.first_difference}: {kind} (note {len(notes)})"
        out.write(f"{r.question[:44]:<44} {len(r.token_ids):>6} {r.ttft_s:>8.2f} "
                  f"{r.tpot_s * 1e3:>9.1f} {r.acceptance:>6.2f}  {same}\n")
    out.write(f"\ntotal {total_s:.1f} s. tau = tokens per speculative round (accepted drafts + 1).\n")
    if notes:
        out.write("\n" + _explain(notes, dtype) + "\n")


def _explain(notes: list[tuple[str, Parting]], dtype: str) -> str:
    """The answers that part from the plain ones, in words: where, the two words and the
    model's scores for them, then what a near-tie means (or that anything else is a bug)."""
    lines = []
    for i, (question, p) in enumerate(notes, 1):
        kind = "a near-tie" if p.near_tie else "NOT a near-tie"
        lines.append(f"note {i}: {question!r}, token {p.index}: the plain answer has "
                     f"{p.plain_text!r}, the speculative one {p.spec_text!r}; the model scored "
                     f"them {p.plain_logit:.3f} and {p.spec_logit:.3f} -- {kind}.")
    if any(p.near_tie for _, p in notes):
        lines.append(
            f"A near-tie: the model rated both words almost equally (within {NEAR_TIE:.0%} of its "
            f"best score). In {dtype} the speculative run, which checks several drafted tokens "
            "in one forward pass, rounds its arithmetic slightly differently from the plain run "
            "(one token at a time), so the two runs picked different words at that point and "
            "continued differently. Both are answers the model itself gives; speculation does not change "
            "answers: in float32 (--dtype float32, the default on the CPU) they are the same "
            "token for token.")
    if not all(p.near_tie for _, p in notes):
        lines.append(
            "NOT a near-tie: the model clearly preferred the plain answer's word, so rounding "
            "does not explain the difference; this looks like a bug in speculative decoding -- "
            "please report it with this output.")
    return "\n".join(lines)
