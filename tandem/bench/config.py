"""What `tandem bench` runs: the settings of the measurement (workload, load levels, SLO, ...)
and the runs to compare (a running router, or deployments to start from bench config files).

A bench config file is a deployment YAML (`tandem serve --config`'s schema: model_name, engine,
spec, transfer_backend, prefill, decode, ...) plus these optional top-level keys:

    name: 8b-disagg-nixl      # the run's name in the results (default: the file's stem)
    mode: disaggregated       # or colocated: one engine (resources: `decode`, decode.tp ranks)
    speculative: true         # colocated only; disaggregated workers always speculate
    bench:                    # measurement defaults, named like the CLI flags
      dataset: random
      input_len: 2048:4096
      output_len: 256
      concurrency: [1, 16, 64]
      num_requests: [8, 48, 128]

`spec.draft_model: dummy` asks for a random EAGLE head of the model's shape (see dummy_head.py).
Flags given on the command line override `bench:`; when several files are compared, the values
their `bench:` sections set must agree (a comparison runs one workload).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from tandem.bench.load import LoadLevel, parse_levels
from tandem.bench.metrics import SLO
from tandem.bench.workload import LengthRange, WorkloadConfig
from tandem.deploy.config import BUNDLED, DeployConfig, parse_deploy
from tandem.engine.config import ConfigError

MODES = ("colocated", "disaggregated")
BENCH_DIR = Path(__file__).resolve().parent.parent / "deploy" / "bench"

# The measurement settings a `bench:` section may set, with their defaults (CLI flag names).
DEFAULTS: dict[str, Any] = {
    "dataset": "random", "input_len": "128:512", "output_len": "64:128", "vocab_size": None,
    "concurrency": None, "request_rate": None, "max_concurrency": None, "num_requests": None,
    "num_warmup": 2, "slo_ttft_ms": 2000.0, "slo_tpot_ms": 100.0, "temperature": 0.0,
    "seed": 0, "request_timeout": 600.0,
}
DEFAULT_CONCURRENCY = "1,4,16"


@dataclass(frozen=True, slots=True, kw_only=True)
class DeploymentSpec:
    mode: str  # colocated | disaggregated
    speculative: bool
    deploy: DeployConfig
    source: str  # the file it came from

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ConfigError(f"mode: '{self.mode}' is not one of {', '.join(MODES)}")
        if self.mode == "disaggregated" and not self.speculative:
            raise ConfigError("speculative: disaggregated workers always speculate (the decode "
                              "worker runs EAGLE); use mode: colocated for a plain reference")
        if self.mode == "colocated" and self.deploy.decode.dp > 1:
            raise ConfigError("decode.dp: a colocated server runs TP ranks only (decode.tp); DP "
                              "attention needs mode: disaggregated")


@dataclass(frozen=True, slots=True, kw_only=True)
class RunSpec:
    """One thing to benchmark: a running router (`target`) or a deployment to start."""

    name: str
    target: str | None = None  # host:port
    deployment: DeploymentSpec | None = None

    def __post_init__(self) -> None:
        if (self.target is None) == (self.deployment is None):
            raise ValueError("run: give exactly one of target, deployment")


@dataclass(frozen=True, slots=True, kw_only=True)
class BenchSettings:
    workload: WorkloadConfig
    levels: tuple[LoadLevel, ...]
    num_requests: tuple[int, ...] | None  # per level (one value: every level); None: defaults
    num_warmup: int
    slo: SLO
    request_timeout_s: float
    seed: int

    def __post_init__(self) -> None:
        n = self.num_requests
        if n is not None and len(n) not in (1, len(self.levels)):
            raise ConfigError(f"num_requests: give one value or one per level ({len(self.levels)}"
                              f"), got {len(n)}")
        if n is not None and min(n) < 1:
            raise ConfigError("num_requests: must be >= 1")
        if self.num_warmup < 0:
            raise ConfigError(f"num_warmup: must be >= 0, got {self.num_warmup}")

    def requests_at(self, i: int) -> int:
        if self.num_requests is None:
            return self.levels[i].default_num_requests()
        return self.num_requests[i if len(self.num_requests) > 1 else 0]

    def to_json(self) -> dict[str, Any]:
        return {"workload": self.workload.to_json(),
                "levels": [lv.to_json() for lv in self.levels],
                "num_requests": [self.requests_at(i) for i in range(len(self.levels))],
                "num_warmup": self.num_warmup,
                "slo": {"ttft_s": self.slo.ttft_s, "tpot_s": self.slo.tpot_s},
                "request_timeout_s": self.request_timeout_s, "seed": self.seed}


def resolve_path(path: str) -> Path:
    """A file, or the name of a bundled bench config (tandem/deploy/bench/NAME.yaml) or
    deployment config (tandem/deploy/NAME.yaml: benchmarked as it is served)."""
    p = Path(path)
    if p.is_file():
        return p
    for folder in (BENCH_DIR, BENCH_DIR.parent):  # bench configs, then `tandem serve`'s
        bundled = folder / f"{path}.yaml"
        if bundled.is_file():
            return bundled
    names = sorted(f.stem for f in BENCH_DIR.glob("*.yaml"))
    raise ConfigError(f"config: no such file '{path}' (bundled bench configs: {', '.join(names)};"
                      f" deployment configs: {', '.join(BUNDLED)})")


def load_bench_file(path: str) -> tuple[RunSpec, dict[str, Any]]:
    """(the run, its `bench:` section)."""
    p = resolve_path(path)
    try:
        raw = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"config: {p} is not valid YAML ({exc})") from exc
    if not isinstance(raw, dict):
        raise ConfigError(f"config: {p}: expected a mapping at the top level")
    raw = dict(raw)
    name = str(raw.pop("name", p.stem))
    mode = str(raw.pop("mode", "disaggregated"))
    speculative = raw.pop("speculative", True)
    if not isinstance(speculative, bool):
        raise ConfigError(f"{p}: speculative: must be true or false, got {speculative!r}")
    section = raw.pop("bench", None) or {}
    if not isinstance(section, dict):
        raise ConfigError(f"{p}: bench: expected a mapping")
    unknown = sorted(set(section) - set(DEFAULTS))
    if unknown:
        raise ConfigError(f"{p}: bench.{unknown[0]}: unknown key (known: "
                          f"{', '.join(sorted(DEFAULTS))})")
    try:
        deploy = parse_deploy(raw)
        spec = DeploymentSpec(mode=mode, speculative=speculative, deploy=deploy, source=str(p))
    except ConfigError as exc:
        raise ConfigError(f"{p}: {exc}") from exc
    return RunSpec(name=name, deployment=spec), section


def merge_settings(cli: dict[str, Any], sections: list[tuple[str, dict[str, Any]]]
                   ) -> dict[str, Any]:
    """Flag values: the command line's (non-None), else the files' (which must agree), else the
    defaults."""
    out = dict(DEFAULTS)
    given = {k for k, v in cli.items() if v is not None}
    seen: dict[str, tuple[str, Any]] = {}
    for source, section in sections:
        for key, value in section.items():
            value = _canonical(value)
            if key in seen and seen[key][1] != value and key not in given:
                raise ConfigError(f"bench.{key}: {seen[key][0]} sets {seen[key][1]!r} but "
                                  f"{source} sets {value!r}; a comparison runs one workload "
                                  f"(override with the command-line flag)")
            seen[key] = (source, value)
            out[key] = value
    for key, value in cli.items():
        if key in out and value is not None:
            out[key] = _canonical(value)
    return out


def _canonical(value: Any) -> Any:
    """YAML lists and CLI strings compare equal: [1, 16] == '1,16'; [2048, 4096] == '2048:4096'
    is left to the parser (lists stay lists here)."""
    if isinstance(value, list):
        return ",".join(str(v) for v in value)
    return value


def build_settings(values: dict[str, Any], vocab_size: int) -> BenchSettings:
    """Typed settings from merged flag values; errors name the flag."""
    def length(key: str) -> LengthRange:
        v = values[key]
        if isinstance(v, str) and "," in v:  # a YAML [lo, hi] list canonicalised above
            v = v.replace(",", ":")
        return LengthRange.parse(v, key.replace("_", "-"))

    concurrency = values["concurrency"]
    rate = values["request_rate"]
    if concurrency is None and rate is None:
        concurrency = DEFAULT_CONCURRENCY
    levels = parse_levels(None if concurrency is None else str(concurrency),
                          None if rate is None else str(rate), values["max_concurrency"])
    num = values["num_requests"]
    try:
        num_requests = (None if num is None else
                        tuple(int(x) for x in str(num).split(",") if x.strip()))
    except ValueError as exc:
        raise ConfigError(f"num-requests: {exc}") from exc
    workload = WorkloadConfig(
        kind=str(values["dataset"]), input_len=length("input_len"),
        output_len=length("output_len"), vocab_size=int(values["vocab_size"] or vocab_size),
        temperature=float(values["temperature"]), seed=int(values["seed"]))
    return BenchSettings(
        workload=workload, levels=levels, num_requests=num_requests,
        num_warmup=int(values["num_warmup"]),
        slo=SLO(ttft_s=float(values["slo_ttft_ms"]) / 1e3,
                tpot_s=float(values["slo_tpot_ms"]) / 1e3),
        request_timeout_s=float(values["request_timeout"]), seed=int(values["seed"]))
