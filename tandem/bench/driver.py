"""The load generator: sends `BenchRequest`s to a running server at one load level and records
what the client saw of each request (chunk arrival times, token counts, the final status).
Warm-up requests run first at the same level and are not recorded.

The schedule (closed loop or Poisson arrivals) lives here and is the same for every API; how one
request goes over the wire is a `Client` (client.py), picked by the target's API with a lazy
import (so a gRPC run loads no HTTP client and an HTTP run no gRPC stubs):

    grpc_client.py   tandem's gRPC router API: token ids per chunk, acceptance stats
    http_client.py   an OpenAI-compatible HTTP front: text chunks over SSE, the usage at the end

Owns nothing beyond one call: `run_level` opens its client and closes it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from contextlib import AbstractAsyncContextManager

from tandem.bench.client import Client, DriverConfig
from tandem.bench.load import LoadLevel, poisson_arrivals
from tandem.bench.metrics import RequestRecord
from tandem.bench.target import Api
from tandem.bench.workload import BenchRequest

log = logging.getLogger(__name__)


def open_client(cfg: DriverConfig) -> AbstractAsyncContextManager[Client]:
    """The client of `cfg.target`'s API, connected (it waits up to client.READY_TIMEOUT_S for
    the server) when entered."""
    if cfg.target.api is Api.HTTP:
        from tandem.bench.http_client import HttpClient

        return HttpClient.connect(cfg)
    from tandem.bench.grpc_client import GrpcClient

    return GrpcClient.connect(cfg)


async def _closed_loop(client: Client, wires: Sequence, concurrency: int, t_level: float,
                       bar) -> list[RequestRecord]:
    records: list[RequestRecord | None] = [None] * len(wires)
    next_index = iter(range(len(wires)))

    async def worker() -> None:
        for i in next_index:  # shared iterator: each worker takes the next unsent request
            records[i] = await client.send(wires[i], t_level)
            bar.update(1)

    await asyncio.gather(*(worker() for _ in range(min(concurrency, len(wires)))))
    return [r for r in records if r is not None]


async def _open_loop(client: Client, wires: Sequence, level: LoadLevel, t_level: float, bar,
                     seed: int) -> list[RequestRecord]:
    assert level.request_rate is not None
    arrivals = poisson_arrivals(level.request_rate, len(wires), seed)
    cap = asyncio.Semaphore(level.max_concurrency) if level.max_concurrency else None

    async def send(i: int) -> RequestRecord:
        await asyncio.sleep(max(0.0, arrivals[i] - (time.perf_counter() - t_level)))
        if cap is None:
            r = await client.send(wires[i], t_level)
        else:
            async with cap:
                r = await client.send(wires[i], t_level)
        bar.update(1)
        return r

    return list(await asyncio.gather(*(send(i) for i in range(len(wires)))))


class _NoBar:
    def update(self, n: int) -> None:
        pass

    def close(self) -> None:
        pass


async def run_level_async(cfg: DriverConfig, level: LoadLevel, requests: Sequence[BenchRequest],
                          warmup: Sequence[BenchRequest], desc: str = "") -> list[RequestRecord]:
    """Warm-up (not recorded), then `requests` at `level`; one record per request, in order."""
    async with open_client(cfg) as client:
        if warmup:
            log.info("%s: %d warm-up requests", desc, len(warmup))
            wwires = [client.prepare(r) for r in warmup]
            width = level.concurrency or level.max_concurrency or len(wwires)
            done = await _closed_loop(client, wwires, width, time.perf_counter(), _NoBar())
            failed = [r.error for r in done if not r.ok]
            if failed:
                log.warning("%s: %d of %d warm-up requests failed (first: %s)", desc,
                            len(failed), len(done), failed[0])
        wires = [client.prepare(r) for r in requests]
        bar = _progress(len(wires), desc) if cfg.progress else _NoBar()
        t_level = time.perf_counter()
        try:
            if level.concurrency is not None:
                return await _closed_loop(client, wires, level.concurrency, t_level, bar)
            return await _open_loop(client, wires, level, t_level, bar, cfg.seed)
        finally:
            bar.close()


def _progress(total: int, desc: str):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="req", leave=False, dynamic_ncols=True)


def run_level(cfg: DriverConfig, level: LoadLevel, requests: Sequence[BenchRequest],
              warmup: Sequence[BenchRequest] = (), desc: str = "") -> list[RequestRecord]:
    return asyncio.run(run_level_async(cfg, level, requests, warmup, desc))
