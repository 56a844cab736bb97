"""A small OTLP/HTTP trace receiver for tests: ``POST /v1/traces`` (protobuf, optionally gzip),
parsed with ``opentelemetry-proto``; the spans it got are kept as :class:`ReceivedSpan`.

    with OTLPReceiver() as rx:
        ... point an exporter at rx.endpoint (http/protobuf) ...
        spans = rx.wait_for(lambda s: any(x.name == "..." for x in s), timeout=10)
"""

from __future__ import annotations

import gzip
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

from stack.ports import free_port


@dataclass
class ReceivedSpan:
    name: str
    trace_id: str  # 32 hex digits
    span_id: str  # 16 hex digits
    parent_span_id: str  # "" for a root
    service: str
    attributes: dict = field(default_factory=dict)
    resource: dict = field(default_factory=dict)


def _value(v):
    kind = v.WhichOneof("value")
    return None if kind is None else getattr(v, kind)


def _attrs(kvs) -> dict:
    return {kv.key: _value(kv.value) for kv in kvs}


def parse_export(body: bytes) -> list[ReceivedSpan]:
    """The spans of one ExportTraceServiceRequest."""
    req = ExportTraceServiceRequest()
    req.ParseFromString(body)
    out = []
    for rs in req.resource_spans:
        res = _attrs(rs.resource.attributes)
        for ss in rs.scope_spans:
            for s in ss.spans:
                out.append(
                    ReceivedSpan(
                        s.name,
                        s.trace_id.hex(),
                        s.span_id.hex(),
                        s.parent_span_id.hex(),
                        str(res.get("service.name", "")),
                        _attrs(s.attributes),
                        res,
                    )
                )
    return out


class OTLPReceiver:
    """An OTLP/HTTP receiver on a free loopback port (a thread of this process)."""

    def __init__(self) -> None:
        self.port = free_port()
        self.spans: list[ReceivedSpan] = []
        self.requests = 0
        self._lock = threading.Lock()
        rx = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                n = int(self.headers.get("content-length") or 0)
                body = self.rfile.read(n)
                if self.headers.get("content-encoding") == "gzip":
                    body = gzip.decompress(body)
                if self.path != "/v1/traces":
                    self.send_error(404)
                    return
                try:
                    got = parse_export(body)
                except Exception:  # noqa: BLE001 - a malformed export is a 400, as a collector says
                    self.send_error(400)
                    return
                with rx._lock:
                    rx.spans.extend(got)
                    rx.requests += 1
                data = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def endpoint(self) -> str:
        """The full OTLP/HTTP traces URL."""
        return f"http://127.0.0.1:{self.port}/v1/traces"

    def snapshot(self) -> list[ReceivedSpan]:
        with self._lock:
            return list(self.spans)

    def wait_for(
        self, cond: Callable[[list[ReceivedSpan]], bool], timeout: float = 15.0
    ) -> list[ReceivedSpan]:
        """The spans received, once ``cond`` holds of them (AssertionError after ``timeout``)."""
        deadline = time.monotonic() + timeout
        while True:
            spans = self.snapshot()
            if cond(spans):
                return spans
            if time.monotonic() > deadline:
                names = sorted({(s.service, s.name) for s in spans})
                raise AssertionError(f"spans not received within {timeout} s; got {names}")
            time.sleep(0.05)

    def __enter__(self) -> OTLPReceiver:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()
