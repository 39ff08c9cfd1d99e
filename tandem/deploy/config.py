"""The deployment config (`tandem serve --config FILE.yaml`): which model, how many prefill and
decode workers, where they may run, how KV moves. Parsed and validated here; every error
names the offending key."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import yaml

from tandem import otel
from tandem.worker import TRANSFER_BACKENDS
from tandem.router.admission import AdmissionConfig
from tandem.kvtransfer import EndpointConfig, FailureInjection
from tandem.engine.config import ConfigError, EngineConfig
from tandem.spec.config import SpecConfig


@dataclass(frozen=True, slots=True, kw_only=True)
class GroupConfig:
    """A set of identical workers of one role. A worker has `tp * dp` ranks (one Ray actor and
    one placement-group bundle each: `num_cpus` / `num_gpus` are per rank); MoE experts split
    over `ep` of them (1: experts whole on every rank, their columns split over the ranks; or
    every rank). `dp` > 1 (decode only): DP attention -- each DP rank (a TP group of `tp`
    ranks, heads split over them) owns its own requests, KV pages and seed slots, the MLP/MoE
    runs over every rank on the tokens gathered from every DP rank."""

    replicas: int = 1
    tp: int = 1
    ep: int = 1
    dp: int = 1
    num_cpus: float = 1.0
    num_gpus: float = 0.0
    resources: dict[str, float] = field(default_factory=dict)  # custom Ray resources (pinning)
    torch_threads: int = 1
    # Prefill only: push layer l's KV while layer l+1 computes (prefill_node/layerwise.py).
    layerwise_push: bool = False
    # How often Ray restarts a worker that died (-1: always, 0: never). Single-rank workers
    # only: the ranks of a TP/DP worker share a process group that a restarted rank cannot
    # rejoin, so a multi-rank worker is never restarted (it stays down, reported unhealthy).
    max_restarts: int = -1
    # Test knobs (not read from YAML): break this group's transfers on purpose.
    faults: FailureInjection | None = None

    def __post_init__(self) -> None:
        if self.replicas < 1:
            raise ConfigError(f"replicas: must be >= 1, got {self.replicas}")
        for name in ("tp", "ep", "dp"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name}: must be an integer >= 1, got {value!r}")
        if self.dp > 1 and self.ep not in (1, self.world_size):
            every = f"dp ({self.dp})" if self.tp == 1 else f"dp * tp ({self.world_size})"
            raise ConfigError(f"ep: must be 1 or equal to {every}, got {self.ep}")
        if self.dp == 1 and self.ep not in (1, self.tp):
            raise ConfigError(f"ep: must be 1 or equal to tp ({self.tp}), got {self.ep}")
        if self.num_cpus < 0 or self.num_gpus < 0:
            raise ConfigError("num_cpus/num_gpus: must be >= 0")
        if isinstance(self.max_restarts, bool) or not isinstance(self.max_restarts, int) or (
                self.max_restarts < -1):
            raise ConfigError(f"max_restarts: must be an integer >= -1 (-1: always), got "
                              f"{self.max_restarts!r}")
        if not isinstance(self.layerwise_push, bool):
            raise ConfigError(f"layerwise_push: must be true or false, got "
                              f"{self.layerwise_push!r}")

    @property
    def world_size(self) -> int:
        """Ranks (actors) per worker."""
        return self.tp * self.dp


@dataclass(frozen=True, slots=True, kw_only=True)
class PlacementConfig:
    """How a deployment is placed on the Ray cluster (YAML `placement:`; deploy/resources.py)."""

    # Before placing anything, compare what every worker and helper actor asks for with the
    # cluster's nodes and refuse at once if it cannot fit. Off for an autoscaling cluster
    # whose nodes come on demand (then raise timeout_s to cover a node's start).
    check: bool = True
    # Placement groups (every worker, the colocated server) not placed within this many
    # seconds fail the launch, naming what is missing, and release what was reserved.
    timeout_s: float = 30.0

    def __post_init__(self) -> None:
        if not isinstance(self.check, bool):
            raise ConfigError(f"check: must be true or false, got {self.check!r}")
        if isinstance(self.timeout_s, bool) or not isinstance(self.timeout_s, (int, float)) or (
                self.timeout_s <= 0):
            raise ConfigError(f"timeout_s: must be a number > 0, got {self.timeout_s!r}")


@dataclass(frozen=True, slots=True, kw_only=True)
class HttpFrontConfig:
    """The OpenAI-compatible HTTP front next to the gRPC API (YAML `http: {port: 8000}`), on the
    router's process and loop. Token, TLS and body limit are the gRPC front's (`tandem serve`
    flags); `--http-port` / `--http-host` override these."""

    port: int | None = None  # None: no HTTP front; 0: any free port
    host: str | None = None  # None: the gRPC front's host (--host)

    def __post_init__(self) -> None:
        if self.port is not None and (isinstance(self.port, bool) or not isinstance(
                self.port, int) or not 0 <= self.port <= 65535):
            raise ConfigError(f"port: must be an integer in [0, 65535], got {self.port!r}")
        if self.host is not None and (not isinstance(self.host, str) or not self.host):
            raise ConfigError(f"host: must be a non-empty string, got {self.host!r}")


@dataclass(frozen=True, slots=True, kw_only=True)
class ObservabilityConfig:
    """Request tracing (YAML `observability: {otlp_endpoint: http://collector:4318}`): the
    router and every worker export OpenTelemetry spans over OTLP/HTTP to that collector
    (tandem/otel.py). `tandem serve --otlp-endpoint` overrides it; unset, the standard
    OTEL_EXPORTER_OTLP_ENDPOINT may still turn tracing on (otel.endpoint_from)."""

    otlp_endpoint: str | None = None  # a collector's base URL, or its /v1/traces URL

    def __post_init__(self) -> None:
        if self.otlp_endpoint is not None:
            try:
                otel.traces_url(self.otlp_endpoint, "otlp_endpoint")
            except ValueError as exc:
                raise ConfigError(str(exc)) from None


@dataclass(frozen=True, slots=True, kw_only=True)
class DeployConfig:
    model_name: str = "default"  # what clients put in `model`
    engine: EngineConfig = field(default_factory=EngineConfig)
    spec: SpecConfig = field(default_factory=SpecConfig)
    transfer_backend: str = "mooncake"
    transfer_timeout_s: float = 30.0
    prefill: GroupConfig = field(default_factory=GroupConfig)
    decode: GroupConfig = field(default_factory=GroupConfig)
    endpoint: EndpointConfig | None = None  # transfer deadlines/leases; None = defaults
    # The router's bound on requests (YAML `router: {max_running: N, max_queued: M}`):
    # at most max_running dispatched at once, max_queued waiting; beyond, RESOURCE_EXHAUSTED.
    router: AdmissionConfig = field(default_factory=AdmissionConfig)
    placement: PlacementConfig = field(default_factory=PlacementConfig)
    http: HttpFrontConfig = field(default_factory=HttpFrontConfig)
    observability: ObservabilityConfig = field(default_factory=ObservabilityConfig)

    def __post_init__(self) -> None:
        if self.transfer_backend not in TRANSFER_BACKENDS:
            raise ConfigError(f"transfer_backend: '{self.transfer_backend}' is not one of "
                              f"{', '.join(TRANSFER_BACKENDS)}")
        if self.prefill.dp != 1:
            raise ConfigError(f"prefill.dp: must be 1, got {self.prefill.dp} (DP attention is a "
                              "decode-side layout; each request is prefilled by one worker)")
        if self.decode.layerwise_push:
            raise ConfigError("decode.layerwise_push: a prefill-side option (set it under "
                              "prefill:)")
        # prefill.tp != decode.tp (per DP rank with decode DP: the prefill pushes to the TP
        # ranks of the DP rank that took the request) is fine when the model's KV heads split
        # evenly over both sizes (re-sliced, kvtransfer/reslice.py); the head count is unknown
        # here: the launcher checks it at startup (`launcher.check_kv_reslice`).


def _build(cls: type, raw: Any, where: str) -> Any:
    if raw is None:
        return cls()
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: expected a mapping, got {type(raw).__name__}")
    known = {f.name for f in fields(cls)} - {"faults"}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ConfigError(f"{where}.{unknown[0]}: unknown key (known: {', '.join(sorted(known))})")
    try:
        return cls(**raw)
    except TypeError as exc:
        raise ConfigError(f"{where}: {exc}") from exc
    except ValueError as exc:
        raise ConfigError(f"{where}.{exc}") from exc


def parse_deploy(raw: dict[str, Any]) -> DeployConfig:
    if not isinstance(raw, dict):
        raise ConfigError("config: expected a mapping at the top level")
    top = {f.name for f in fields(DeployConfig)} - {"endpoint"}
    unknown = sorted(set(raw) - top)
    if unknown:
        raise ConfigError(f"{unknown[0]}: unknown key (known: {', '.join(sorted(top))})")
    return DeployConfig(
        model_name=str(raw.get("model_name", "default")),
        engine=_build(EngineConfig, raw.get("engine"), "engine"),
        spec=_build(SpecConfig, raw.get("spec"), "spec"),
        transfer_backend=str(raw.get("transfer_backend", "mooncake")),
        transfer_timeout_s=float(raw.get("transfer_timeout_s", 30.0)),
        prefill=_build(GroupConfig, raw.get("prefill"), "prefill"),
        decode=_build(GroupConfig, raw.get("decode"), "decode"),
        router=_build(AdmissionConfig, raw.get("router"), "router"),
        placement=_build(PlacementConfig, raw.get("placement"), "placement"),
        http=_http(raw.get("http")),
        observability=_build(ObservabilityConfig, raw.get("observability"), "observability"),
    )


def _http(raw: Any) -> HttpFrontConfig:
    if isinstance(raw, dict) and raw.get("port") is None:  # `http:` given means a front
        raise ConfigError("http.port: required (the HTTP front's port; 0: any free port)")
    return _build(HttpFrontConfig, raw, "http")


BUNDLED = ("local", "gpu-2x", "gpu-4x-tp2")  # configs shipped in this package (tandem/deploy/NAME.yaml)


def load_deploy(path: str | Path) -> DeployConfig:
    """A YAML file, or the name of a bundled config."""
    p = Path(path)
    if not p.is_file() and str(path) in BUNDLED:
        p = Path(__file__).resolve().parent / f"{path}.yaml"
    if not p.is_file():
        raise ConfigError(f"config: no such file {p} (bundled configs: {', '.join(BUNDLED)})")
    try:
        raw = yaml.safe_load(p.read_text())
    except yaml.YAMLError as exc:
        raise ConfigError(f"config: {p} is not valid YAML ({exc})") from exc
    return parse_deploy(raw or {})
