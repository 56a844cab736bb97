"""The OTLP span exporter the router's and the emulated worker's tracing share."""

from __future__ import annotations

from urllib.parse import urlsplit

#: the protocols an OTLP endpoint may speak here (OTEL_EXPORTER_OTLP_TRACES_PROTOCOL's spelling)
PROTOCOLS = ("http/protobuf", "grpc")


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
