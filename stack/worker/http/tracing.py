"""The emulated worker continues the trace it is handed (``--enable-trace``, as SGLang's flag).

Each inference POST that carries a W3C ``traceparent`` (the router sends one per PD side when
``router.tracing`` is on) gets a SERVER span of this worker as that span's child: from the
request's arrival to the last byte of its answer, with the rid, bootstrap room and prompt
length (:func:`annotate`) and the status. A request without a ``traceparent`` starts a trace
of its own, as SGLang's does. Spans go over OTLP to ``otlp_traces_endpoint``, the protocol from
``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL`` (grpc by default, as in SGLang).

Off (the default), nothing here is installed: the app is not wrapped.
"""

from __future__ import annotations

import os

from starlette.types import ASGIApp, Receive, Scope, Send

from stack.worker.settings import WorkerSettings

#: where the request's span waits in the ASGI scope for :func:`annotate`
SCOPE_KEY = "smetric.span"


class WorkerTracing:
    """One worker's tracer: a provider of its own (several workers share a process), named
    ``smetric-worker`` with the worker's name and mode as resource attributes."""

    def __init__(self, s: WorkerSettings, exporter=None) -> None:
        # imported here: a worker that does not trace never loads OpenTelemetry
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        from stack.otlp import otlp_exporter

        self.propagator = TraceContextTextMapPropagator()
        resource = Resource.create(
            {"service.name": "smetric-worker", "smetric.worker": s.name, "smetric.mode": s.mode}
        )
        self.provider = TracerProvider(resource=resource, shutdown_on_exit=False)
        if exporter is None and s.otlp_traces_endpoint:
            protocol = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "grpc")
            exporter = otlp_exporter(s.otlp_traces_endpoint, protocol)
        if exporter is not None:
            from opentelemetry.sdk.trace.export import BatchSpanProcessor

            self.provider.add_span_processor(BatchSpanProcessor(exporter))
        self.tracer = self.provider.get_tracer("stack.worker")
        self.mode = s.mode


class TraceMiddleware:
    """ASGI: a span per POST on ``paths`` (the inference endpoints), continuing its
    ``traceparent``; the span is in ``scope[SCOPE_KEY]`` while the request runs."""

    def __init__(self, app: ASGIApp, tracing: WorkerTracing, paths: frozenset[str]) -> None:
        from opentelemetry.trace import SpanKind, Status, StatusCode

        self.server_kind = SpanKind.SERVER
        self.error = lambda why: Status(StatusCode.ERROR, why)
        self.app = app
        self.tracing = tracing
        self.paths = paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST" or scope["path"] not in self.paths:
            return await self.app(scope, receive, send)
        carrier = {}
        for k, v in scope["headers"]:
            if k in (b"traceparent", b"tracestate"):
                carrier[k.decode()] = v.decode("latin-1")
        path = scope["path"]
        span = self.tracing.tracer.start_span(
            f"{self.tracing.mode} {path}",
            context=self.tracing.propagator.extract(carrier) if carrier else None,
            kind=self.server_kind,
            attributes={"http.request.method": "POST", "url.path": path},
        )
        scope[SCOPE_KEY] = span
        ended = False

        async def traced_send(msg) -> None:
            nonlocal ended
            if msg["type"] == "http.response.start":
                status = msg["status"]
                span.set_attribute("http.response.status_code", status)
                if status >= 500:
                    span.set_status(self.error(f"HTTP {status}"))
            await send(msg)
            if msg["type"] == "http.response.body" and not msg.get("more_body") and not ended:
                ended = True
                span.end()

        try:
            await self.app(scope, receive, traced_send)
        except BaseException as e:
            span.set_status(self.error(type(e).__name__))
            raise
        finally:
            if not ended:  # the client left, or the app failed, before the answer's end
                span.end()


def annotate(scope: Scope, rid: str, prompt_tokens: int, bootstrap_room: int | None) -> None:
    """Add the request's identity to its span (a no-op when the worker does not trace)."""
    span = scope.get(SCOPE_KEY)
    if span is None:
        return
    attrs = {"smetric.rid": str(rid), "smetric.prompt_tokens": prompt_tokens}
    if bootstrap_room is not None:
        attrs["smetric.bootstrap_room"] = str(bootstrap_room)
    span.set_attributes(attrs)
