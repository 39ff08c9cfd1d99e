"""`GrpcClient`: the benchmark's requests over tandem's gRPC router API
(`tandem.v1.Router/Generate`, async stubs on one channel).

A chunk's tokens are its `token_ids`; the final message carries the usage, the router's own TTFT
and, from a speculative server, the request's acceptance stats. The deadline is the call's
timeout, which the router enforces too (it aborts the request at that time, DEADLINE_EXCEEDED).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import grpc

from tandem.bench.client import READY_TIMEOUT_S, DriverConfig
from tandem.bench.metrics import RequestRecord, SpecRecord
from tandem.bench.workload import BenchRequest
from tandem.proto import router_pb2 as pb
from tandem.proto import router_pb2_grpc as pb_grpc


def to_proto(req: BenchRequest, cfg: DriverConfig) -> pb.GenerateRequest:
    params = pb.SamplingParams(max_tokens=req.max_tokens, temperature=cfg.temperature,
                               ignore_eos=req.ignore_eos)
    msg = pb.GenerateRequest(sampling=params, model=cfg.model)
    if req.question is not None:
        msg.messages.append(pb.ChatMessage(role="user", content=req.question))
    else:
        msg.prompt_token_ids.extend(req.prompt_token_ids)
    return msg


class GrpcClient:
    """Owns nothing: the channel belongs to `connect`'s context."""

    def __init__(self, stub: pb_grpc.RouterStub, cfg: DriverConfig) -> None:
        self._stub, self._cfg = stub, cfg
        self._metadata = ((("authorization", f"Bearer {cfg.auth_token}"),)
                          if cfg.auth_token else None)

    @staticmethod
    @asynccontextmanager
    async def connect(cfg: DriverConfig) -> AsyncIterator[GrpcClient]:
        async with grpc.aio.insecure_channel(cfg.target.address, options=[
                ("grpc.max_receive_message_length", 64 << 20)]) as channel:
            await asyncio.wait_for(channel.channel_ready(), timeout=READY_TIMEOUT_S)
            yield GrpcClient(pb_grpc.RouterStub(channel), cfg)

    def prepare(self, req: BenchRequest) -> pb.GenerateRequest:
        return to_proto(req, self._cfg)

    async def send(self, wire: pb.GenerateRequest, t_level: float) -> RequestRecord:
        t0 = time.perf_counter()
        times: list[float] = []
        counts: list[int] = []
        final: pb.GenerateResponse | None = None
        error = None
        try:
            async for msg in self._stub.Generate(wire, timeout=self._cfg.request_timeout_s,
                                                 metadata=self._metadata):
                if msg.token_ids:
                    times.append(time.perf_counter() - t0)
                    counts.append(len(msg.token_ids))
                if msg.finish_reason != pb.FINISH_REASON_UNSPECIFIED:
                    final = msg
        except grpc.aio.AioRpcError as exc:
            error = f"{exc.code().name}: {exc.details()}"
        if error is None and (final is None or final.finish_reason == pb.FINISH_REASON_ABORT):
            error = "aborted" if final is not None else "stream ended without a final message"
        if error is None and not times:
            error = "no tokens"
        spec = None
        if final is not None and final.HasField("spec_stats"):
            s = final.spec_stats
            spec = SpecRecord(mean_acceptance_length=s.mean_acceptance_length,
                              per_position=tuple(s.per_position_acceptance),
                              num_rounds=s.num_rounds)
        prompt_tokens = (final.usage.prompt_tokens if final is not None
                         else len(wire.prompt_token_ids))
        return RequestRecord(chunk_times_s=tuple(times), chunk_tokens=tuple(counts),
                             prompt_tokens=prompt_tokens, start_s=t0 - t_level, error=error,
                             spec=spec, server_ttft_s=final.ttft_s if final is not None else None)
