"""A small OTLP/HTTP trace receiver on a free loopback port, for the tracing tests
and `bench --features`: it decodes what the SDK's exporter sends (protobuf, as
opentelemetry-proto defines it) and keeps the spans, or (``keep_spans=False``, for
the bench, whose receiver shares the machine with the relay) only counts them and
their links."""

from __future__ import annotations

import gzip
import threading
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


@dataclass(frozen=True)
class ReceivedSpan:
    name: str
    trace_id: str
    span_id: str
    kind: int
    attributes: dict[str, Any]
    links: list[tuple[str, str]]  # (trace id, span id), hex
    status_code: int
    status_message: str
    parent_span_id: str  # hex, "" for a root span
    start_ns: int
    end_ns: int
    trace_state: str


def _value(any_value: Any) -> Any:
    kind = any_value.WhichOneof("value")
    return getattr(any_value, kind) if kind else None


class OtlpSink:
    def __init__(self, *, keep_spans: bool = True) -> None:
        from opentelemetry.proto.collector.trace.v1 import trace_service_pb2  # noqa: PLC0415

        self.spans: list[ReceivedSpan] = []
        self.keep_spans = keep_spans
        self.requests = 0
        self.span_count = 0
        self.link_count = 0
        self._lock = threading.Lock()
        sink = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                request = trace_service_pb2.ExportTraceServiceRequest()
                request.ParseFromString(body)
                sink.add(request)
                reply = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args: object) -> None:
                return None

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def add(self, request: Any) -> None:
        spans = [
            span
            for resource_spans in request.resource_spans
            for scope_spans in resource_spans.scope_spans
            for span in scope_spans.spans
        ]
        links = sum(len(span.links) for span in spans)
        found = [
            ReceivedSpan(
                name=span.name,
                trace_id=span.trace_id.hex(),
                span_id=span.span_id.hex(),
                kind=span.kind,
                attributes={a.key: _value(a.value) for a in span.attributes},
                links=[(link.trace_id.hex(), link.span_id.hex()) for link in span.links],
                status_code=span.status.code,
                status_message=span.status.message,
                parent_span_id=span.parent_span_id.hex(),
                start_ns=span.start_time_unix_nano,
                end_ns=span.end_time_unix_nano,
                trace_state=span.trace_state,
            )
            for span in (spans if self.keep_spans else [])
        ]
        with self._lock:
            self.requests += 1
            self.span_count += len(spans)
            self.link_count += links
            self.spans.extend(found)

    def __enter__(self) -> OtlpSink:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()
