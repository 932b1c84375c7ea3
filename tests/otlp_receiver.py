"""A local OTLP/HTTP trace receiver on loopback: what a collector would get from a gateway.

It serves ``POST /v1/traces`` (``application/x-protobuf``, gzip or not), decodes each
``ExportTraceServiceRequest`` with the OpenTelemetry protobuf package and keeps every span
as a plain ``ReceivedSpan`` (ids in lowercase hex, attributes as Python values), with the
headers each export came with (the collector's credential, ``tracing.headers_from_env``).

It runs on its own thread (``http.server``), not on the test's event loop: a gateway's
shutdown flushes its spans (``TracerProvider.shutdown``), and however the gateway waits for
that, the receiver answers.
"""

from __future__ import annotations

import gzip
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span, Status

__all__ = ["OtlpReceiver", "ReceivedSpan"]

#: OTLP's span kinds, by their protobuf number.
KINDS = {
    Span.SPAN_KIND_INTERNAL: "internal",
    Span.SPAN_KIND_SERVER: "server",
    Span.SPAN_KIND_CLIENT: "client",
    Span.SPAN_KIND_PRODUCER: "producer",
    Span.SPAN_KIND_CONSUMER: "consumer",
}
STATUSES = {
    Status.STATUS_CODE_UNSET: "unset",
    Status.STATUS_CODE_OK: "ok",
    Status.STATUS_CODE_ERROR: "error",
}


def _value(value: AnyValue) -> Any:
    which = value.WhichOneof("value")
    if which == "array_value":
        return [_value(v) for v in value.array_value.values]
    if which == "kvlist_value":
        return {kv.key: _value(kv.value) for kv in value.kvlist_value.values}
    return getattr(value, which) if which is not None else None


@dataclass(frozen=True)
class ReceivedSpan:
    name: str
    kind: str
    trace_id: str
    span_id: str
    #: "" for a root span.
    parent_span_id: str
    attributes: dict[str, Any]
    status: str
    resource: dict[str, Any]
    start_ns: int
    end_ns: int


@dataclass
class OtlpReceiver:
    spans: list[ReceivedSpan] = field(default_factory=list)
    #: The headers of every export (lowercase names).
    exports: list[dict[str, str]] = field(default_factory=list)
    _server: ThreadingHTTPServer | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def endpoint(self) -> str:
        """The base URL a gateway's ``tracing.otlp_endpoint`` names."""
        assert self._server is not None
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def start(self, port: int = 0) -> OtlpReceiver:
        """Serve on loopback, on ``port`` (0: one the system picks)."""
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length", "0"))
                raw = self.rfile.read(length)
                if self.headers.get("Content-Encoding") == "gzip":
                    raw = gzip.decompress(raw)
                if self.path != "/v1/traces":
                    self.send_error(404)
                    return
                request = ExportTraceServiceRequest()
                request.ParseFromString(raw)
                receiver._add(request, {k.lower(): v for k, v in self.headers.items()})
                body = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:
                pass  # quiet: the test's output is about the gateway

        self._server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self._server.daemon_threads = True
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()

    def _add(self, request: ExportTraceServiceRequest, headers: dict[str, str]) -> None:
        received = []
        for resource_spans in request.resource_spans:
            resource = {kv.key: _value(kv.value) for kv in resource_spans.resource.attributes}
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    received.append(
                        ReceivedSpan(
                            name=span.name,
                            kind=KINDS.get(span.kind, "unspecified"),
                            trace_id=span.trace_id.hex(),
                            span_id=span.span_id.hex(),
                            parent_span_id=span.parent_span_id.hex(),
                            attributes={kv.key: _value(kv.value) for kv in span.attributes},
                            status=STATUSES.get(span.status.code, "unset"),
                            resource=resource,
                            start_ns=span.start_time_unix_nano,
                            end_ns=span.end_time_unix_nano,
                        )
                    )
        with self._lock:
            self.spans.extend(received)
            self.exports.append(headers)

    def named(self, prefix: str) -> list[ReceivedSpan]:
        with self._lock:
            return [s for s in self.spans if s.name.startswith(prefix)]

    def children(self, parent: ReceivedSpan) -> list[ReceivedSpan]:
        with self._lock:
            return [
                s
                for s in self.spans
                if s.parent_span_id == parent.span_id and s.trace_id == parent.trace_id
            ]

    def kind(self, kind: str) -> list[ReceivedSpan]:
        with self._lock:
            return [s for s in self.spans if s.kind == kind]

    def clear(self) -> None:
        with self._lock:
            self.spans.clear()
            self.exports.clear()


def main() -> None:
    """``python -m tests.otlp_receiver PORT``: serve until interrupted (bench/README.md,
    "Tracing": the collector of a benchmark with ``[tracing]``), then print how many spans
    came."""
    import signal
    import sys

    port = int(sys.argv[1]) if len(sys.argv) > 1 else 4318
    receiver = OtlpReceiver()
    receiver.start(port)
    print(f"OTLP/HTTP receiver on {receiver.endpoint}", flush=True)
    stop = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):  # a background job ignores SIGINT
        signal.signal(signum, lambda *_: stop.set())
    stop.wait()
    receiver.stop()
    print(f"{len(receiver.spans)} spans in {len(receiver.exports)} exports", flush=True)


if __name__ == "__main__":
    main()
