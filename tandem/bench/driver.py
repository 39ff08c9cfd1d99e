"""The load generator: sends `BenchRequest`s to a router over the public gRPC API
(`tandem.v1.Router/Generate`, async stubs on one channel) at one load level, and records what
the client saw of each request (chunk arrival times, token counts, the server's acceptance
stats). Warm-up requests run first at the same level and are not recorded.

Owns nothing beyond one call: `run_level` opens its channel and closes it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

import grpc

from tandem.bench.load import LoadLevel, poisson_arrivals
from tandem.bench.metrics import RequestRecord, SpecRecord
from tandem.bench.workload import BenchRequest
from tandem.proto import router_pb2 as pb
from tandem.proto import router_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True, kw_only=True)
class DriverConfig:
    target: str  # host:port of the router
    auth_token: str | None = None
    model: str = ""  # empty: the served model
    temperature: float = 0.0
    request_timeout_s: float = 600.0  # the deadline of each Generate call
    seed: int = 0  # Poisson arrivals
    progress: bool = True  # a tqdm bar per level


def to_proto(req: BenchRequest, cfg: DriverConfig) -> pb.GenerateRequest:
    params = pb.SamplingParams(max_tokens=req.max_tokens, temperature=cfg.temperature,
                               ignore_eos=req.ignore_eos)
    msg = pb.GenerateRequest(sampling=params, model=cfg.model)
    if req.question is not None:
        msg.messages.append(pb.ChatMessage(role="user", content=req.question))
    else:
        msg.prompt_token_ids.extend(req.prompt_token_ids)
    return msg


async def _one(stub: pb_grpc.RouterStub, req: pb.GenerateRequest, cfg: DriverConfig,
               t_level: float) -> RequestRecord:
    metadata = (("authorization", f"Bearer {cfg.auth_token}"),) if cfg.auth_token else None
    t0 = time.perf_counter()
    times: list[float] = []
    counts: list[int] = []
    final: pb.GenerateResponse | None = None
    error = None
    try:
        async for msg in stub.Generate(req, timeout=cfg.request_timeout_s, metadata=metadata):
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
                          per_position=tuple(s.per_position_acceptance), num_rounds=s.num_rounds)
    prompt_tokens = final.usage.prompt_tokens if final is not None else len(req.prompt_token_ids)
    return RequestRecord(chunk_times_s=tuple(times), chunk_tokens=tuple(counts),
                         prompt_tokens=prompt_tokens, start_s=t0 - t_level, error=error,
                         spec=spec, server_ttft_s=final.ttft_s if final is not None else None)


async def _closed_loop(stub, reqs: Sequence[pb.GenerateRequest], concurrency: int,
                       cfg: DriverConfig, t_level: float, bar) -> list[RequestRecord]:
    records: list[RequestRecord | None] = [None] * len(reqs)
    next_index = iter(range(len(reqs)))

    async def client() -> None:
        for i in next_index:  # shared iterator: each client takes the next unsent request
            records[i] = await _one(stub, reqs[i], cfg, t_level)
            bar.update(1)

    await asyncio.gather(*(client() for _ in range(min(concurrency, len(reqs)))))
    return [r for r in records if r is not None]


async def _open_loop(stub, reqs: Sequence[pb.GenerateRequest], level: LoadLevel,
                     cfg: DriverConfig, t_level: float, bar, seed: int) -> list[RequestRecord]:
    assert level.request_rate is not None
    arrivals = poisson_arrivals(level.request_rate, len(reqs), seed)
    cap = asyncio.Semaphore(level.max_concurrency) if level.max_concurrency else None

    async def send(i: int) -> RequestRecord:
        await asyncio.sleep(max(0.0, arrivals[i] - (time.perf_counter() - t_level)))
        if cap is None:
            r = await _one(stub, reqs[i], cfg, t_level)
        else:
            async with cap:
                r = await _one(stub, reqs[i], cfg, t_level)
        bar.update(1)
        return r

    return list(await asyncio.gather(*(send(i) for i in range(len(reqs)))))


class _NoBar:
    def update(self, n: int) -> None:
        pass

    def close(self) -> None:
        pass


async def run_level_async(cfg: DriverConfig, level: LoadLevel, requests: Sequence[BenchRequest],
                          warmup: Sequence[BenchRequest], desc: str = "") -> list[RequestRecord]:
    """Warm-up (not recorded), then `requests` at `level`; one record per request, in order."""
    async with grpc.aio.insecure_channel(cfg.target, options=[
            ("grpc.max_receive_message_length", 64 << 20)]) as channel:
        await asyncio.wait_for(channel.channel_ready(), timeout=60)
        stub = pb_grpc.RouterStub(channel)
        if warmup:
            log.info("%s: %d warm-up requests", desc, len(warmup))
            wreqs = [to_proto(r, cfg) for r in warmup]
            width = level.concurrency or level.max_concurrency or len(wreqs)
            done = await _closed_loop(stub, wreqs, width, cfg, time.perf_counter(), _NoBar())
            failed = [r.error for r in done if not r.ok]
            if failed:
                log.warning("%s: %d of %d warm-up requests failed (first: %s)", desc,
                            len(failed), len(done), failed[0])
        reqs = [to_proto(r, cfg) for r in requests]
        bar = _progress(len(reqs), desc) if cfg.progress else _NoBar()
        t_level = time.perf_counter()
        try:
            if level.concurrency is not None:
                return await _closed_loop(stub, reqs, level.concurrency, cfg, t_level, bar)
            return await _open_loop(stub, reqs, level, cfg, t_level, bar, cfg.seed)
        finally:
            bar.close()


def _progress(total: int, desc: str):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="req", leave=False, dynamic_ncols=True)


def run_level(cfg: DriverConfig, level: LoadLevel, requests: Sequence[BenchRequest],
              warmup: Sequence[BenchRequest] = (), desc: str = "") -> list[RequestRecord]:
    return asyncio.run(run_level_async(cfg, level, requests, warmup, desc))
