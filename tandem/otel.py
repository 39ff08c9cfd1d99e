"""OpenTelemetry tracing of requests, opt-in: one trace per request across the router and its
workers, exported over OTLP/HTTP (protobuf) to a collector (Jaeger, Tempo, the OTel collector).

Off unless this process called `configure(url, ...)` (`tandem serve --otlp-endpoint`, the
deployment's `observability.otlp_endpoint` or the standard OTEL_EXPORTER_OTLP_ENDPOINT: see
`endpoint_from`) or, in a worker actor, `configure_from_env` found TANDEM_OTLP_ENDPOINT (the
launcher puts it into every actor's runtime_env: deploy/launcher.actor_runtime_env). While off,
nothing imports OpenTelemetry, and `start` returns the shared `NOOP` span at once, building
nothing: a span site costs one function call.

Context crosses processes as a W3C `traceparent` string ("00-<trace id>-<span id>-<flags>"):
the router puts its dispatch span's into the commands it sends (`StartPrefill`, `Reserve`), the
workers start their spans under it, and a client's `traceparent` (HTTP header, gRPC metadata)
becomes the parent of the request's root span. A string rather than an OpenTelemetry object, so
the messages stay plain picklable values and no process has to load OpenTelemetry to carry one.
Sampling is the SDK's (parent-based; OTEL_TRACES_SAMPLER / OTEL_TRACES_SAMPLER_ARG): a trace the
router samples out stays out on the workers too.

Exporting never fails a request: spans go to a batching processor on a thread of its own, which
drops them when the collector is away (the SDK logs it).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from urllib.parse import urlsplit, urlunsplit

ENDPOINT_ENV = "TANDEM_OTLP_ENDPOINT"  # a worker process's traces URL (set by the launcher)
TRACES_PATH = "/v1/traces"  # where an OTLP/HTTP collector takes spans
# Span kinds (OpenTelemetry's SpanKind by name, so callers need not import it)
SERVER, CLIENT, INTERNAL = "SERVER", "CLIENT", "INTERNAL"

AttrValue = str | int | float | bool


class Span:
    """A started span. `end` may be called on every way out: only the first counts."""

    __slots__ = ("_span", "_ended")

    def __init__(self, span) -> None:
        self._span = span  # an opentelemetry.trace.Span
        self._ended = False

    @property
    def traceparent(self) -> str:
        """This span as a W3C traceparent: what a child in another process starts under."""
        from opentelemetry.trace import set_span_in_context

        carrier: dict[str, str] = {}
        _propagator().inject(carrier, context=set_span_in_context(self._span))
        return carrier.get("traceparent", "")

    def set(self, key: str, value: AttrValue) -> None:
        if not self._ended:
            self._span.set_attribute(key, value)

    def event(self, name: str, at_ns: int | None = None) -> None:
        if not self._ended:
            self._span.add_event(name, timestamp=at_ns)

    def fail(self, error: BaseException | str) -> None:
        """Status ERROR, described by `error` (an exception also names its type)."""
        if self._ended:
            return
        from opentelemetry.trace import Status, StatusCode

        if isinstance(error, BaseException):
            self._span.set_attribute("error.type", type(error).__name__)
            error = str(error) or type(error).__name__
        self._span.set_status(Status(StatusCode.ERROR, error[:300]))

    def end(self, at_ns: int | None = None) -> None:
        """End now, or at `at_ns` (time.time_ns()); later calls do nothing."""
        if not self._ended:
            self._ended = True
            self._span.end(end_time=at_ns)


class _Off(Span):
    """The span of an untraced request: every method does nothing."""

    __slots__ = ()

    def __init__(self) -> None:
        pass

    @property
    def traceparent(self) -> str:
        return ""

    def set(self, key: str, value: AttrValue) -> None:
        pass

    def event(self, name: str, at_ns: int | None = None) -> None:
        pass

    def fail(self, error: BaseException | str) -> None:
        pass

    def end(self, at_ns: int | None = None) -> None:
        pass


NOOP: Span = _Off()


class _Tracing:
    """This process's tracing setup (one per process, as its exporter thread is)."""

    def __init__(self) -> None:
        self.url = ""  # the OTLP/HTTP traces URL; "" while off
        self.provider = None  # opentelemetry.sdk.trace.TracerProvider
        self.tracer = None  # None: tracing is off (what `start` checks)


_state = _Tracing()


def enabled() -> bool:
    return _state.tracer is not None


def start(name: str, parent: str | Span = "", *, kind: str = INTERNAL,
          attrs: Mapping[str, AttrValue] | None = None, at_ns: int | None = None) -> Span:
    """A span named `name` under `parent` (a traceparent string, or a span of this process; ""
    or an untraced span: a new trace), started now or at `at_ns`; `NOOP` while tracing is
    off. A malformed traceparent is ignored (W3C: start a new trace)."""
    tracer = _state.tracer
    if tracer is None:
        return NOOP
    from opentelemetry.trace import SpanKind

    return Span(tracer.start_span(name, context=_context_of(parent), kind=SpanKind[kind],
                                  attributes=attrs, start_time=at_ns))


def _context_of(parent: str | Span):
    from opentelemetry.context import Context
    from opentelemetry.trace import set_span_in_context

    # Always an explicit context: a span never picks up whatever happens to be "current".
    if isinstance(parent, _Off) or not parent:
        return Context()
    if isinstance(parent, Span):
        return set_span_in_context(parent._span, Context())
    return _propagator().extract({"traceparent": parent}, context=Context())


def _propagator():
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    return TraceContextTextMapPropagator()


# ---- setup ---------------------------------------------------------------------------------


def configure(url: str, service: str, *, instance: str = "") -> None:
    """Trace this process: spans go to the OTLP/HTTP traces `url` (`traces_url`'s form) as
    service `service` (service.instance.id `instance`, e.g. the worker's name). Replaces an
    earlier setup, whose spans are flushed first."""
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    shutdown()
    resource = {"service.name": service}
    if instance:
        resource["service.instance.id"] = instance
    # Not installed as the global provider: tandem's spans are its own, whatever else in the
    # process uses OpenTelemetry. Batch settings come from OTEL_BSP_* (5 s delay by default).
    provider = TracerProvider(resource=Resource.create(resource))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=url)))
    _state.url, _state.provider = url, provider
    _state.tracer = provider.get_tracer("tandem")


def configure_from_env(service: str, *, instance: str = "") -> bool:
    """In a worker process: trace to $TANDEM_OTLP_ENDPOINT if it is set (and this process does
    not trace already, as when a test runs workers next to the router). Whether it traces."""
    url = os.environ.get(ENDPOINT_ENV)
    if url and not enabled():
        configure(url, service, instance=instance)
    return enabled()


def env_vars() -> dict[str, str]:
    """The environment a process started from this one needs to trace too: the traces URL, and
    the OTEL_* settings (headers, TLS files, sampler, batching) this process runs with."""
    if not enabled():
        return {}
    return {ENDPOINT_ENV: _state.url,
            **{k: v for k, v in os.environ.items() if k.startswith("OTEL_")}}


def flush(timeout_s: float = 5.0) -> bool:
    """Export every ended span now; whether that finished within `timeout_s`."""
    if _state.provider is None:
        return True
    return _state.provider.force_flush(int(timeout_s * 1000))


def shutdown() -> None:
    """Flush and stop tracing in this process (`start` returns NOOP again)."""
    provider = _state.provider
    _state.url, _state.provider, _state.tracer = "", None, None
    if provider is not None:
        provider.shutdown()


# ---- where to export -----------------------------------------------------------------------


def traces_url(endpoint: str, key: str) -> str:
    """The OTLP/HTTP traces URL of `endpoint`: a collector's base URL (http://host:4318, as
    OTEL_EXPORTER_OTLP_ENDPOINT has it; /v1/traces is appended) or its traces URL itself.
    ValueError naming `key` unless it is an http(s) URL with a host."""
    parts = urlsplit(endpoint.strip()) if isinstance(endpoint, str) else None
    if parts is None or parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"{key}: must be an http(s) URL of an OTLP/HTTP collector, such as "
                         f"http://localhost:4318; got {endpoint!r}")
    path = parts.path.rstrip("/")
    if not path.endswith(TRACES_PATH):
        path += TRACES_PATH
    return urlunsplit(parts._replace(path=path))


def endpoint_from(flag: str | None, configured: str | None,
                  environ: Mapping[str, str]) -> str | None:
    """The traces URL `tandem serve` exports to (None: tracing off), the first given of:
    --otlp-endpoint, the deployment's observability.otlp_endpoint, the standard
    OTEL_EXPORTER_OTLP_TRACES_ENDPOINT (a traces URL, taken as it is) and
    OTEL_EXPORTER_OTLP_ENDPOINT (a base URL). The environment counts unless OTEL_SDK_DISABLED is
    true or OTEL_TRACES_EXPORTER is none, as for any OpenTelemetry SDK."""
    if flag is not None:
        return traces_url(flag, "--otlp-endpoint")
    if configured is not None:
        return traces_url(configured, "observability.otlp_endpoint")
    if (environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true"
            or environ.get("OTEL_TRACES_EXPORTER", "").strip().lower() == "none"):
        return None
    url = environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "").strip()
    if url:
        traces_url(url, "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")  # the check only
        return url
    base = environ.get("OTEL_EXPORTER_OTLP_ENDPOINT", "").strip()
    return traces_url(base, "OTEL_EXPORTER_OTLP_ENDPOINT") if base else None
