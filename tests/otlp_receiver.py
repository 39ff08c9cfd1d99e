"""A tiny OTLP/HTTP trace receiver on 127.0.0.1 for tests: it takes the exporters' POSTs of
`ExportTraceServiceRequest` protobufs at /v1/traces and keeps every span as a plain `Got`."""

from __future__ import annotations

import gzip
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)


@dataclass(frozen=True, slots=True)
class Got:
    """One received span."""

    name: str
    service: str  # its process's service.name
    trace_id: str  # hex
    span_id: str
    parent_id: str  # "" for a root span
    kind: int  # opentelemetry.proto.trace.v1.Span.SpanKind
    attrs: dict
    events: tuple[str, ...]
    status: int  # 0 unset, 1 ok, 2 error
    status_message: str
    start_ns: int
    end_ns: int


def _value(v):
    kind = v.WhichOneof("value")
    return getattr(v, kind) if kind else None


class OtlpReceiver:
    """`url`: the base URL to give an exporter (the receiver answers at url + /v1/traces)."""

    def __init__(self) -> None:
        self.spans: list[Got] = []
        self.paths: list[str] = []
        self._lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 -- http.server's name
                body = self.rfile.read(int(self.headers.get("content-length", 0)))
                if self.headers.get("content-encoding") == "gzip":
                    body = gzip.decompress(body)
                receiver._take(self.path, ExportTraceServiceRequest.FromString(body))
                out = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

            def log_message(self, *args) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()
        self.url = f"http://127.0.0.1:{self._server.server_port}"

    def _take(self, path: str, req: ExportTraceServiceRequest) -> None:
        got = []
        for rs in req.resource_spans:
            res = {a.key: _value(a.value) for a in rs.resource.attributes}
            for ss in rs.scope_spans:
                for s in ss.spans:
                    got.append(Got(
                        name=s.name, service=res.get("service.name", ""),
                        trace_id=s.trace_id.hex(), span_id=s.span_id.hex(),
                        parent_id=s.parent_span_id.hex(), kind=s.kind,
                        attrs={a.key: _value(a.value) for a in s.attributes},
                        events=tuple(e.name for e in s.events), status=s.status.code,
                        status_message=s.status.message, start_ns=s.start_time_unix_nano,
                        end_ns=s.end_time_unix_nano))
        with self._lock:
            self.paths.append(path)
            self.spans += got

    def wait_for(self, predicate, timeout_s: float = 20.0) -> list[Got]:
        """The spans received, once `predicate(spans)` holds (or at `timeout_s`)."""
        end = time.monotonic() + timeout_s
        while True:
            with self._lock:
                spans = list(self.spans)
            if predicate(spans) or time.monotonic() > end:
                return spans
            time.sleep(0.05)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
