"""OpenTelemetry spans of the router's request path, and the W3C ``traceparent`` it hands to the
PD workers (``router.tracing``; docs/deploy.md, "Tracing").

With ``router.tracing.enabled: false`` (the default) :meth:`RouterTracing.from_config` returns
None and the request path builds nothing: every hook is behind one ``is None`` test.

With tracing on, one :class:`RequestTrace` per request holds its root span and makes the
children, all parented on the root (timestamps in ns since the epoch, as OpenTelemetry wants):

- ``POST <path>`` (SERVER, the root): received -> answered (or the stream ended); a client's
  ``traceparent`` is continued;
- ``smetric.parse``: body read, parsed, features (tokens, block hashes);
- ``smetric.queue_wait``: time in the dispatch queue (an order other than ``immediate``);
- ``smetric.route``: the routing decision (policy, decision kind, chosen prefill and decode
  worker, hits); one per attempt;
- ``smetric.prefill`` (CLIENT): the prefill worker's request, until its answer is drained; its
  context goes to that worker as ``traceparent``;
- ``smetric.decode`` (CLIENT): the decode worker's request, until the stream ends; its context
  goes to the decode worker as ``traceparent``;
- ``smetric.first_token``: sent -> the first chunk back (TTFT as the router sees it);
- ``smetric.stream``: first chunk -> the end of the stream (chunks, bytes, how it ended).

Spans are exported over OTLP (HTTP/protobuf or gRPC, a batch processor) when
``router.tracing.endpoint`` is set; otherwise they are made and dropped (tests add their own
processor: :meth:`RouterTracing.add_span_processor`). The dispatch queue reaches the current
request's trace through :func:`current` (a context variable the handler sets only when tracing).
"""

from __future__ import annotations

import contextvars
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING

from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
from opentelemetry.trace import SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from stack.otlp import otlp_exporter, traceparent

if TYPE_CHECKING:
    from stack.config import TracingConfig
    from stack.prefill_router.routed import Routed

_PROPAGATOR = TraceContextTextMapPropagator()
_CURRENT: contextvars.ContextVar[RequestTrace | None] = contextvars.ContextVar(
    "smetric_request_trace", default=None
)


def current() -> RequestTrace | None:
    """The trace of the request running in this task (None: tracing is off)."""
    return _CURRENT.get()


class RouterTracing:
    """The router's tracer (a provider of its own, not the process-global one, so that several
    routers in one process, as in the tests, keep their spans apart)."""

    def __init__(self, provider: TracerProvider) -> None:
        self.provider = provider
        self.tracer = provider.get_tracer("stack.prefill_router")

    @classmethod
    def from_config(cls, tc: TracingConfig) -> RouterTracing | None:
        """None when ``tc.enabled`` is false: the request path then makes no span at all."""
        if not tc.enabled:
            return None
        provider = TracerProvider(
            resource=Resource.create({"service.name": tc.service_name}),
            sampler=ParentBased(TraceIdRatioBased(tc.sampling_ratio)),
            shutdown_on_exit=False,
        )
        if tc.endpoint:
            from opentelemetry.sdk.trace.export import BatchSpanProcessor

            exporter = otlp_exporter(tc.endpoint, tc.protocol, tc.export_timeout_s)
            provider.add_span_processor(BatchSpanProcessor(exporter))
        return cls(provider)

    def add_span_processor(self, processor: SpanProcessor) -> None:
        """Another destination for the spans (tests: the SDK's in-memory exporter)."""
        self.provider.add_span_processor(processor)

    def start(self, method: str, path: str, endpoint: str, headers: Mapping[str, str]) -> RequestTrace:
        """The root span of a request that arrived now, continuing the client's
        ``traceparent`` when it sent one; it becomes :func:`current` for this task."""
        parent = _PROPAGATOR.extract(headers) if "traceparent" in headers else None
        root = self.tracer.start_span(
            f"{method} {path}",
            context=parent,
            kind=SpanKind.SERVER,
            attributes={"http.request.method": method, "url.path": path, "smetric.endpoint": endpoint},
        )
        rt = RequestTrace(self.tracer, root)
        rt.token = _CURRENT.set(rt)
        return rt

    def shutdown(self) -> None:
        """Flush and stop the exporters (the router is stopping)."""
        self.provider.shutdown()


class RequestTrace:
    """One request's spans (module docstring); every method is a no-op once the root ended."""

    __slots__ = ("tracer", "root", "ctx", "token", "mark_ns", "prefill", "decode", "sent_ns", "first_ns")

    def __init__(self, tracer: trace.Tracer, root: trace.Span) -> None:
        self.tracer = tracer
        self.root = root
        self.ctx = trace.set_span_in_context(root)
        self.token: contextvars.Token | None = None
        self.mark_ns = time.time_ns()  # the start of the next span made after the fact
        self.prefill: trace.Span | None = None
        self.decode: trace.Span | None = None
        self.sent_ns = 0
        self.first_ns = 0

    def _span(self, name: str, start_ns: int, end_ns: int, attributes: dict | None = None) -> trace.Span:
        s = self.tracer.start_span(name, context=self.ctx, start_time=start_ns, attributes=attributes)
        s.end(end_time=end_ns)
        return s

    # -- the stages, in the order a request meets them ----------------------------------------
    def parsed(self, prompt_tokens: int | None = None, body_bytes: int | None = None) -> None:
        """Parsing and features are done (from the root's start)."""
        now = time.time_ns()
        attrs = {}
        if prompt_tokens is not None:
            attrs["smetric.prompt_tokens"] = prompt_tokens
        if body_bytes is not None:
            attrs["smetric.body_bytes"] = body_bytes
        self._span("smetric.parse", self.mark_ns, now, attrs)
        self.mark_ns = now

    def queue_wait(self, start_ns: int, end_ns: int, outcome: str) -> None:
        """The request waited in the dispatch queue from ``start_ns``; ``outcome``: released,
        rejected, cancelled. The routing decision starts after it."""
        self._span("smetric.queue_wait", start_ns, end_ns, {"smetric.queue.outcome": outcome})
        self.mark_ns = end_ns

    def routed(self, r: Routed, policy: str, attempt: int) -> None:
        """The routing decision is made (since parsing, or the end of the queue wait)."""
        now = time.time_ns()
        attrs = {
            "smetric.policy": policy,
            "smetric.decision": r.kind.value,
            "smetric.prefill_worker": r.prefill.url,
            "smetric.local_hit_tokens": r.local_hit,
            "smetric.global_hit_tokens": r.global_hit,
            "smetric.attempt": attempt,
        }
        if r.decode is not None:
            attrs["smetric.decode_worker"] = r.decode.url
        self._span("smetric.route", self.mark_ns, now, attrs)
        self.mark_ns = now

    def not_routed(self, reason: str, attempt: int) -> None:
        """No routing decision (no worker, overloaded, client gone)."""
        now = time.time_ns()
        s = self.tracer.start_span(
            "smetric.route",
            context=self.ctx,
            start_time=self.mark_ns,
            attributes={"smetric.attempt": attempt, "smetric.route.outcome": reason},
        )
        s.set_status(Status(StatusCode.ERROR, reason))
        s.end(end_time=now)
        self.mark_ns = now

    def hand_off(self, r: Routed) -> tuple[dict[str, str], dict[str, str]]:
        """The prefill and the decode request are about to be sent: their CLIENT spans start,
        and each worker's ``traceparent`` header names its own span."""
        now = time.time_ns()
        self.sent_ns = now
        t = self.tracer
        p = self.prefill = t.start_span(
            "smetric.prefill",
            context=self.ctx,
            kind=SpanKind.CLIENT,
            start_time=now,
            attributes={"smetric.role": "prefill", "server.address": r.prefill.url},
        )
        p_hdr = {"traceparent": traceparent(p.get_span_context())}
        if r.decode is None:
            return p_hdr, p_hdr
        d = self.decode = t.start_span(
            "smetric.decode",
            context=self.ctx,
            kind=SpanKind.CLIENT,
            start_time=now,
            attributes={"smetric.role": "decode", "server.address": r.decode.url},
        )
        return p_hdr, {"traceparent": traceparent(d.get_span_context())}

    def prefill_done(self) -> None:
        """Prefill's answer is drained (PD); in a colocated pool the prefill span lasts until
        the answer ends (:meth:`end`)."""
        p = self.prefill
        if p is not None and self.decode is not None:
            p.end()
            self.prefill = None

    def upstream_failed(self, role: str, message: str) -> None:
        """A worker failed before anything was streamed: the attempt's spans end in error."""
        for s in (self.prefill, self.decode):
            if s is not None:
                s.set_status(Status(StatusCode.ERROR, f"{role}: {message}"))
                s.end()
        self.prefill = self.decode = None

    def first_token(self) -> None:
        """The first chunk (or, not streamed, the whole answer) is in."""
        now = time.time_ns()
        self.first_ns = now
        self._span("smetric.first_token", self.sent_ns or self.mark_ns, now)
        if self.decode is not None:
            self.decode.add_event("first_token", timestamp=now)

    def end(
        self, status: int, error: str | None = None, chunks: int | None = None, nbytes: int | None = None
    ) -> None:
        """The request is answered (``status``), or its stream ended (``chunks`` and ``nbytes``
        relayed; ``error``: how it broke, e.g. the client left)."""
        root = self.root
        if root is None:
            return
        now = time.time_ns()
        if chunks is not None:
            attrs = {"smetric.stream.chunks": chunks, "smetric.stream.bytes": nbytes or 0}
            s = self.tracer.start_span("smetric.stream", context=self.ctx, start_time=self.first_ns or now)
            s.set_attributes(attrs)
            if error:
                s.set_status(Status(StatusCode.ERROR, error))
            s.end(end_time=now)
        for s in (self.prefill, self.decode):
            if s is not None:
                if error:
                    s.set_status(Status(StatusCode.ERROR, error))
                s.end(end_time=now)
        self.prefill = self.decode = None
        root.set_attribute("http.response.status_code", status)
        if status >= 500 or error:
            root.set_status(Status(StatusCode.ERROR, error or f"HTTP {status}"))
        root.end(end_time=now)
        self.root = None

    def detach(self) -> None:
        """This task no longer runs the request's routing (:func:`current` is None again)."""
        if self.token is not None:
            _CURRENT.reset(self.token)
            self.token = None
