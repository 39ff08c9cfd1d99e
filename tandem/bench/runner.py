"""The benchmark's control loop: for each run (a running router, or a deployment it starts and
stops), for each load level: warm up, send the level's requests, summarize. The result file is
rewritten after every run, so a failure later keeps what was measured; the plot and the console
report come at the end.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from tandem import trace
from tandem.bench import results
from tandem.bench.config import BenchSettings, RunSpec
from tandem.bench.client import DriverConfig
from tandem.bench.driver import run_level
from tandem.bench.floors import Bandwidth, ModelFloors
from tandem.bench.metrics import summarize
from tandem.bench.target import Target
from tandem.bench.workload import build_requests
from tandem.engine.config import ConfigError

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True, kw_only=True)
class RunnerOptions:
    out_json: Path
    out_png: Path | None  # None: no plot
    ray_address: str | None = None
    auth_token: str | None = None  # for --target runs
    model: str = ""  # the request's `model` field (--target runs; empty: the served model)
    target_floors: ModelFloors | None = None  # floors of --target runs (None: n/a)
    progress: bool = True
    trace: Path | None = None  # TANDEM_TRACE file of the deployments (None: no marks)


def _deployment_json(run: RunSpec) -> dict[str, Any] | None:
    spec = run.deployment
    if spec is None:
        return None
    d = spec.deploy
    spec_on = spec.speculative
    return {"mode": spec.mode, "speculative": spec_on, "model": d.engine.model,
            "load_format": d.engine.load_format, "dtype": d.engine.dtype,
            "device": d.engine.device,
            "transfer_backend": d.transfer_backend if spec.mode == "disaggregated" else None,
            "num_prefill": d.prefill.replicas if spec.mode == "disaggregated" else 0,
            "num_decode": d.decode.replicas if spec.mode == "disaggregated" else 1,
            "num_draft_steps": d.spec.num_steps if spec_on else None,
            "draft_topk": d.spec.topk if spec_on else None, "source": spec.source}


def no_floors(reason: str) -> ModelFloors:
    na = Bandwidth(bytes_per_s=None, method=reason)
    return ModelFloors(model=None, dtype_bytes=2, memory=na, link=na)


def _bench_levels(settings: BenchSettings, driver: DriverConfig, floors: ModelFloors,
                  name: str, levels_out: list[dict[str, Any]], out: TextIO,
                  trace_file: Path | None = None) -> None:
    warmup = build_requests(settings.workload, settings.num_warmup, stream=0)
    for i, level in enumerate(settings.levels):
        reqs = build_requests(settings.workload, settings.requests_at(i), stream=i + 1)
        log.info("%s: %s, %d requests (+%d warm-up)", name, level.label, len(reqs), len(warmup))
        t0 = time.perf_counter()
        wall0 = time.time()
        records = run_level(driver, level, reqs, warmup, desc=f"{name} {level.label}")
        if trace_file is not None and trace_file.exists():
            rows = trace.stage_report(trace_file, window=(wall0, time.time()), skip=len(warmup))
            stages = {stage: ms for stage, ms, _ in rows}
            out.write(f"{name} {level.label}: median ms after the router's submit, per stage\n"
                      f"{trace.format_report(rows)}\n")
        else:
            stages = None
        m = summarize(records, settings.slo)
        levels_out.append(results.level_json(level, m, floors, records))
        if stages is not None:
            levels_out[-1]["trace_stages_ms"] = stages
        tau = f", tau {m.acceptance.mean_length:.2f}" if m.acceptance else ""
        out.write(f"{name} {level.label}: {m.num_completed}/{m.num_requests} done in "
                  f"{time.perf_counter() - t0:.1f} s, {m.output_throughput:.1f} out tok/s, "
                  f"TTFT p50 {m.ttft_s.p50 * 1e3:.1f} ms, TPOT p50 {m.tpot_s.p50 * 1e3:.1f} ms"
                  f"{tau}\n")
        out.flush()


def run_bench(settings: BenchSettings, runs: Sequence[RunSpec], opts: RunnerOptions,
              argv: Sequence[str], out: TextIO | None = None) -> dict[str, Any]:
    out = out or sys.stdout
    doc: dict[str, Any] = {
        "schema": results.SCHEMA, "date": results.now_iso(), "command": list(argv),
        "machine": results.machine_info(), "config": settings.to_json(), "runs": []}
    if opts.trace is not None:  # every actor started from here gets it (launcher.actor_runtime_env)
        opts.trace.parent.mkdir(parents=True, exist_ok=True)
        opts.trace.unlink(missing_ok=True)
        os.environ[trace.ENV] = str(opts.trace)
    if any(r.deployment is not None for r in runs):
        from tandem.bench import deployments

        deployments.init(opts.ray_address)
    for run in runs:
        # A deployment started here is benchmarked through its gRPC router.
        api = Target.parse(run.target).api.value if run.target else "grpc"
        entry: dict[str, Any] = {"name": run.name, "target": run.target or "", "api": api,
                                 "deployment": _deployment_json(run), "error": None,
                                 "levels": []}
        doc["runs"].append(entry)
        close = None
        try:
            if run.deployment is not None:
                from tandem.bench import deployments

                model = deployments.model_config(run.deployment)
                floors = deployments.measure_floors(run.deployment, model)
                entry["floors"] = floors.to_json()
                spec = deployments.prepare(run.deployment, model)
                out.write(f"{run.name}: starting {spec.mode} deployment from {spec.source} ...\n")
                out.flush()
                t0 = time.perf_counter()
                started = deployments.start(spec)
                close = started.close
                entry["target"] = started.address
                out.write(f"{run.name}: up in {time.perf_counter() - t0:.1f} s, router at "
                          f"{started.address}\n")
            else:
                floors = opts.target_floors or no_floors("pass --floor-model for floors")
                entry["floors"] = floors.to_json()
            driver = DriverConfig(
                target=Target.parse(entry["target"]),
                auth_token=opts.auth_token if run.target else None,
                model=opts.model if run.target else "",
                temperature=settings.workload.temperature,
                request_timeout_s=settings.request_timeout_s, seed=settings.seed,
                progress=opts.progress)
            _bench_levels(settings, driver, floors, run.name, entry["levels"], out,
                          opts.trace if run.deployment is not None else None)
        except Exception as exc:  # noqa: BLE001 -- recorded; the next run still goes
            if isinstance(exc, ConfigError):  # e.g. the cluster cannot hold it: the message says
                log.error("%s failed: %s", run.name, exc)
                out.write(f"{run.name}: failed: {exc}\n")
            else:
                log.exception("%s failed", run.name)
            entry["error"] = f"{type(exc).__name__}: {exc}"
            entry.setdefault("floors", no_floors("run failed before measuring").to_json())
        finally:
            if close is not None:
                out.write(f"{run.name}: shutting down\n")
                close()
        results.write(doc, opts.out_json)
    results.write(doc, opts.out_json)
    written = _loaded(opts.out_json)
    from tandem.bench.report import print_report

    print_report(written, out)
    out.write(f"\nresults: {opts.out_json}\n")
    if opts.out_png is not None:
        from tandem.bench.plot import plot

        try:
            plot(written, opts.out_png)
            out.write(f"plot:    {opts.out_png}\n")
        except ImportError as exc:  # the results are written; only the figure is missing
            out.write(f"plot:    skipped ({exc}; pip install matplotlib)\n")
    return written


def _loaded(path: Path) -> dict[str, Any]:
    """The document as written (NaN -> null), which is what the plot reads."""
    import json

    return json.loads(path.read_text())
