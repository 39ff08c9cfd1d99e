"""The client behind `tandem generate`: build a `GenerateRequest`, stream its text to a terminal,
print usage and timing at the end, and turn gRPC failures into one line naming the status code.

Plain functions over a synchronous gRPC channel; the CLI only parses flags into a
`ClientConfig` and a request.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

import grpc

from tandem.proto import router_pb2 as pb
from tandem.proto import router_pb2_grpc as pb_grpc
from tandem.router.validate import SamplingInput

FINISH_NAMES = {pb.FINISH_REASON_STOP: "stop", pb.FINISH_REASON_LENGTH: "length",
                pb.FINISH_REASON_ABORT: "abort"}


@dataclass(frozen=True, slots=True, kw_only=True)
class ClientConfig:
    target: str  # host:port
    auth_token: str | None = None
    tls: bool = False  # with the system's root certificates unless tls_ca is given
    tls_ca: Path | None = None  # PEM root certificate(s) of the server (implies TLS)
    timeout_s: float | None = None  # the call's deadline


def build_request(prompt: str, *, chat: bool = False, system: str | None = None,
                  sampling: SamplingInput = SamplingInput(), model: str = "",
                  prefill_worker: str = "", decode_worker: str = "",
                  request_id: str = "") -> pb.GenerateRequest:
    """A text prompt, or (chat) a user turn after an optional system turn."""
    s = sampling
    params = pb.SamplingParams(stop=list(s.stop), stop_token_ids=list(s.stop_token_ids),
                               ignore_eos=s.ignore_eos, logprobs=s.logprobs)
    for name in ("max_tokens", "temperature", "top_k", "top_p", "min_p", "seed",
                 "top_logprobs"):
        value = getattr(s, name)
        if value is not None:
            setattr(params, name, value)
    req = pb.GenerateRequest(sampling=params, model=model, prefill_worker=prefill_worker,
                             decode_worker=decode_worker, request_id=request_id)
    if chat:
        if system:
            req.messages.append(pb.ChatMessage(role="system", content=system))
        req.messages.append(pb.ChatMessage(role="user", content=prompt))
    else:
        req.prompt = prompt
    return req


def open_channel(cfg: ClientConfig) -> grpc.Channel:
    if cfg.tls or cfg.tls_ca is not None:
        roots = Path(cfg.tls_ca).read_bytes() if cfg.tls_ca is not None else None
        return grpc.secure_channel(cfg.target, grpc.ssl_channel_credentials(roots))
    return grpc.insecure_channel(cfg.target)


def call_metadata(cfg: ClientConfig) -> Sequence[tuple[str, str]]:
    return (("authorization", f"Bearer {cfg.auth_token}"),) if cfg.auth_token else ()


def stream_generate(cfg: ClientConfig, request: pb.GenerateRequest, out: TextIO,
                    err: TextIO) -> int:
    """Stream to `out`, summary to `err`. Exit status: 0 ok, 1 RPC failure, 130 interrupted."""
    with open_channel(cfg) as channel:
        stub = pb_grpc.RouterStub(channel)
        t0 = time.perf_counter()
        call = stub.Generate(request, timeout=cfg.timeout_s, metadata=call_metadata(cfg))
        final: pb.GenerateResponse | None = None
        wrote = False
        logprobs: list[pb.TokenLogprob] = []
        try:
            for msg in call:
                out.write(msg.text_delta)
                out.flush()
                logprobs.extend(msg.logprobs)
                wrote = wrote or bool(msg.text_delta)
                if msg.finish_reason != pb.FINISH_REASON_UNSPECIFIED:
                    final = msg
        except grpc.RpcError as exc:
            if wrote:
                out.write("\n")
            err.write(describe_rpc_error(exc, cfg.target) + "\n")
            return 1
        except KeyboardInterrupt:
            call.cancel()  # the router aborts the request on its workers
            err.write("\ninterrupted; request cancelled\n")
            return 130
        out.write("\n")
        if final is not None:
            err.write(summary(final, time.perf_counter() - t0) + "\n")
        if logprobs:
            err.write(logprob_table(logprobs) + "\n")
        return 0


def logprob_table(logprobs: list[pb.TokenLogprob]) -> str:
    """One line per returned token: its id and log-probability, then the alternatives."""
    lines = ["[logprobs: token id, log-probability; most likely alternatives]"]
    for lp in logprobs:
        alts = "  ".join(f"{t.token_id}:{t.logprob:.3f}" for t in lp.top_logprobs)
        lines.append(f"  {lp.token_id:>7d} {lp.logprob:9.4f}" + (f"   {alts}" if alts else ""))
    return "\n".join(lines)


def summary(final: pb.GenerateResponse, wall_s: float) -> str:
    n = final.usage.completion_tokens
    decode_s = final.latency_s - final.ttft_s
    rate = f", {(n - 1) / decode_s:.1f} tok/s" if n > 1 and decode_s > 0 else ""
    line = (f"[{FINISH_NAMES.get(final.finish_reason, '?')}: {final.usage.prompt_tokens} prompt + "
            f"{n} completion tokens, TTFT {final.ttft_s:.3f} s, total {wall_s:.2f} s{rate}; "
            f"request {final.request_id}]")
    if final.HasField("spec_stats"):
        s = final.spec_stats
        per_pos = ", ".join(f"{p:.2f}" for p in s.per_position_acceptance)
        line += (f"\n[speculative: acceptance length {s.mean_acceptance_length:.2f} over "
                 f"{s.num_rounds} rounds; per position {per_pos}]")
    return line


def describe_rpc_error(exc: grpc.RpcError, target: str) -> str:
    code = exc.code() if hasattr(exc, "code") else None
    details = exc.details() if hasattr(exc, "details") else str(exc)
    name = code.name if code is not None else "UNKNOWN"
    hint = ""
    if code is grpc.StatusCode.UNAVAILABLE and "connect" in (details or "").lower():
        hint = f" (is `tandem serve` running at {target}?)"
    elif code is grpc.StatusCode.UNAUTHENTICATED:
        hint = " (pass the server's token with --auth-token or $TANDEM_AUTH_TOKEN)"
    return f"tandem generate: {name}: {details}{hint}"
