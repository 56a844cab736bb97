"""OpenTelemetry pieces the router's and the emulated worker's tracing share: the OTLP span
exporter for a configured endpoint, and the W3C ``traceparent`` header value of a span."""

from __future__ import annotations

from urllib.parse import urlsplit

from opentelemetry.trace import SpanContext

#: the protocols an OTLP endpoint may speak here (OTEL_EXPORTER_OTLP_TRACES_PROTOCOL's spelling)
PROTOCOLS = ("http/protobuf", "grpc")


def traceparent(ctx: SpanContext) -> str:
    """The W3C ``traceparent`` header value naming ``ctx`` (version 00)."""
    return f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{int(ctx.trace_flags):02x}"


def otlp_exporter(endpoint: str, protocol: str = "http/protobuf", timeout_s: float = 10.0):
    """An OTLP span exporter. ``http/protobuf``: ``/v1/traces`` is added to an endpoint without a
    path; ``grpc``: plain text unless the endpoint is ``https://`` (``host:port`` is taken as
    plain text too, as SGLang passes it)."""
    if protocol not in PROTOCOLS:
        raise ValueError(f"OTLP protocol must be one of {', '.join(PROTOCOLS)} (got {protocol!r})")
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as Grpc

        return Grpc(endpoint=endpoint, insecure=not endpoint.startswith("https://"), timeout=timeout_s)
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as Http

    if "://" not in endpoint:
        endpoint = "http://" + endpoint
    if urlsplit(endpoint).path in ("", "/"):
        endpoint = endpoint.rstrip("/") + "/v1/traces"
    return Http(endpoint=endpoint, timeout=timeout_s)
