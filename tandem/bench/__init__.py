"""`tandem bench`: serving benchmarks over the public gRPC API or an OpenAI-compatible HTTP front.

workload.py (what is sent) -> load.py (when: concurrency or Poisson rate) -> driver.py (sends
it through grpc_client.py or http_client.py, as target.py reads `--target`, and records
client-side timelines) -> metrics.py (TTFT, TPOT, ITL, throughput, goodput, tau)
-> floors.py (hardware floors) -> results.py (the JSON file and its schema) -> plot.py / report.py.
config.py reads bench configs, deployments.py starts them on Ray, runner.py is the loop.

The runner (and through it the gRPC stubs or the HTTP client) is imported on first use only:
`tandem --help` builds the bench parser from config.py, and must work where the generated gRPC
code cannot load.
"""

from tandem.bench.config import BenchSettings, DeploymentSpec, RunSpec, load_bench_file
from tandem.bench.load import LoadLevel, parse_levels, poisson_arrivals
from tandem.bench.metrics import (SLO, Acceptance, Distribution, LevelMetrics, RequestRecord,
                                  SpecRecord, itls, latency, percentile, summarize, tpot, ttft)
from tandem.bench.results import SCHEMA, SchemaError, validate
from tandem.bench.workload import BenchRequest, LengthRange, WorkloadConfig, build_requests

__all__ = [
    "SCHEMA", "SLO", "Acceptance", "BenchRequest", "BenchSettings", "DeploymentSpec",
    "Distribution", "LengthRange", "LevelMetrics", "LoadLevel", "RequestRecord", "RunSpec",
    "RunnerOptions", "SchemaError", "SpecRecord", "WorkloadConfig", "build_requests", "itls",
    "latency", "load_bench_file", "parse_levels", "percentile", "poisson_arrivals", "run_bench",
    "summarize", "tpot", "ttft", "validate",
]


def __getattr__(name: str):
    if name in ("RunnerOptions", "run_bench"):
        from tandem.bench import runner

        return getattr(runner, name)
    raise AttributeError(f"module 'tandem.bench' has no attribute '{name}'")
