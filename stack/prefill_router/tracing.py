"""OpenTelemetry spans of the router's request path, and the W3C ``traceparent`` it hands to the
PD workers (``router.tracing``; docs/operate/monitoring.md, "Tracing").

With ``router.tracing.enabled: false`` (the default) :meth:`RouterTracing.from_config` returns
:data:`NO_TRACING`, whose requests all get :data:`NULL_TRACE`: a trace whose stages do nothing,
so the request path is one code path with tracing on or off, and builds nothing when it is off.

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
``router.tracing.endpoint`` is set (tests add their own processor:
:meth:`RouterTracing.add_span_processor`). The dispatch queue reaches the current request's
trace through :func:`current` (a context variable the handler sets only when tracing; otherwise
it is :data:`NULL_TRACE`).

Cost: a request's stages are noted as timestamps and attributes while it runs, and turned into
the SDK's finished spans (``ReadableSpan``) once, when it ends, and only when it is sampled and
something takes spans (an exporter or a processor): the SDK's ``start_span`` and ``end`` cost
~13 us of CPU a span here, and eight of them ~0.1 ms, the most tracing may add to a request. The sampling decision
(``ParentBased(TraceIdRatioBased(sampling_ratio))``), the ids and the ``traceparent`` headers
are made as OpenTelemetry's SDK makes them, so an unexported trace still joins the workers'
spans by its trace id.
"""

from __future__ import annotations

import contextvars
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING

from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import Event, RandomIdGenerator, ReadableSpan, SpanProcessor
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import SpanContext, SpanKind, Status, StatusCode, TraceFlags
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from stack.otlp import otlp_exporter

if TYPE_CHECKING:
    from stack.config import TracingConfig
    from stack.core.observations import Observation
    from stack.prefill_router.api.parse import Parsed
    from stack.prefill_router.routed import Routed

_PROPAGATOR = TraceContextTextMapPropagator()
_CURRENT: contextvars.ContextVar[RequestTrace | NullTrace] = contextvars.ContextVar("smetric_request_trace")
_SAMPLED = TraceFlags(TraceFlags.SAMPLED)
_NOT_SAMPLED = TraceFlags(TraceFlags.DEFAULT)
_UNSET = Status(StatusCode.UNSET)


def current() -> RequestTrace | NullTrace:
    """The trace of the request running in this task (:data:`NULL_TRACE`: tracing is off)."""
    return _CURRENT.get(NULL_TRACE)


class NullTrace:
    """The trace of every request while tracing is off: each stage of :class:`RequestTrace`,
    doing nothing (no span, no header, no clock read)."""

    __slots__ = ()

    def parsed(
        self, prompt_tokens: int | None = None, body_bytes: int | None = None, parsed: Parsed | None = None
    ) -> None:
        pass

    def queue_wait(self, start_ns: int, end_ns: int, outcome: str) -> None:
        pass

    def routed(self, r: Routed, policy: str, attempt: int) -> None:
        pass

    def not_routed(self, reason: str, attempt: int) -> None:
        pass

    def hand_off(self, r: Routed) -> None:
        """No ``traceparent`` headers."""
        return None

    def prefill_done(self) -> None:
        pass

    def prefill_timed(self, ob: Observation) -> None:
        pass

    def upstream_failed(self, role: str, message: str) -> None:
        pass

    def first_token(self) -> None:
        pass

    def end(
        self,
        status: int,
        error: str | None = None,
        chunks: int | None = None,
        nbytes: int | None = None,
        body: bytes | None = None,
    ) -> None:
        pass

    def detach(self) -> None:
        pass


NULL_TRACE = NullTrace()
"""The one :class:`NullTrace`."""


class NoTracing:
    """``router.tracing`` off: every request's trace is :data:`NULL_TRACE`."""

    enabled = False

    def start(self, method: str, path: str, endpoint: str, headers: Mapping[str, str]) -> NullTrace:
        return NULL_TRACE

    def add_span_processor(self, processor: SpanProcessor) -> None:
        raise RuntimeError("router.tracing is off: there are no spans to process")

    def shutdown(self) -> None:
        pass


NO_TRACING = NoTracing()
"""The one :class:`NoTracing`."""


class RouterTracing:
    """The router's tracing: sampler, ids, resource and where finished spans go (its own, not
    the process-global provider's, so that several routers in one process keep theirs apart)."""

    enabled = True

    def __init__(self, service_name: str = "smetric-router", sampling_ratio: float = 1.0) -> None:
        self.resource = Resource.create({"service.name": service_name})
        self.scope = InstrumentationScope("stack.prefill_router")
        self.sampler = ParentBased(TraceIdRatioBased(sampling_ratio))
        self.ids = RandomIdGenerator()
        #: where finished spans go; empty: spans are not made (ids and headers still are)
        self.processors: list[SpanProcessor] = []

    @classmethod
    def from_config(cls, tc: TracingConfig) -> RouterTracing | NoTracing:
        """:data:`NO_TRACING` when ``tc.enabled`` is false: the request path then makes nothing."""
        if not tc.enabled:
            return NO_TRACING
        t = cls(tc.service_name, tc.sampling_ratio)
        if tc.endpoint:
            from opentelemetry.sdk.trace.export import BatchSpanProcessor

            t.add_span_processor(
                BatchSpanProcessor(otlp_exporter(tc.endpoint, tc.protocol, tc.export_timeout_s))
            )
        return t

    def add_span_processor(self, processor: SpanProcessor) -> None:
        """Another destination for finished spans (tests: the SDK's in-memory exporter)."""
        self.processors.append(processor)

    def start(self, method: str, path: str, endpoint: str, headers: Mapping[str, str]) -> RequestTrace:
        """The trace of a request that arrived now, continuing the client's ``traceparent`` when
        it sent one; it becomes :func:`current` for this task."""
        parent = None
        pctx = None
        if "traceparent" in headers:
            pctx = _PROPAGATOR.extract(headers)
            sc = trace.get_current_span(pctx).get_span_context()
            parent = sc if sc.is_valid else None
        trace_id = parent.trace_id if parent is not None else self.ids.generate_trace_id()
        name = f"{method} {path}"
        got = self.sampler.should_sample(pctx, trace_id, name, SpanKind.SERVER)
        sampled = got.decision.is_sampled()
        rt = RequestTrace(
            self, name, trace_id, parent, sampled, got.trace_state, sampled and bool(self.processors)
        )
        rt.attrs = {"http.request.method": method, "url.path": path, "smetric.endpoint": endpoint}
        rt.token = _CURRENT.set(rt)
        return rt

    def export(self, spans: list[ReadableSpan]) -> None:
        for p in self.processors:
            for s in spans:
                p.on_end(s)

    def shutdown(self) -> None:
        """Flush and stop the exporters (the router is stopping)."""
        for p in self.processors:
            p.shutdown()


class _Client:
    """An open CLIENT span (prefill or decode): its id went to the worker in ``traceparent``."""

    __slots__ = ("name", "span_id", "start", "attrs", "events", "status")

    def __init__(self, name: str, span_id: int, start: int, attrs: dict) -> None:
        self.name = name
        self.span_id = span_id
        self.start = start
        self.attrs = attrs
        self.events: list[Event] = []
        self.status = _UNSET


class RequestTrace:
    """One request's trace (module docstring). With ``record`` false (not sampled, or nowhere
    to send spans) it keeps only what the ``traceparent`` headers need."""

    __slots__ = (
        "tracing", "name", "trace_id", "span_id", "parent", "flags", "trace_state", "record", "attrs",
        "spans", "token", "start_ns", "mark_ns", "prefill", "decode", "sent_ns", "first_ns", "ended",
    )  # fmt: skip

    def __init__(
        self,
        tracing: RouterTracing,
        name: str,
        trace_id: int,
        parent: SpanContext | None,
        sampled: bool,
        trace_state,
        record: bool,
    ) -> None:
        self.tracing = tracing
        self.name = name
        self.trace_id = trace_id
        self.span_id = tracing.ids.generate_span_id()
        self.parent = parent
        self.flags = _SAMPLED if sampled else _NOT_SAMPLED
        self.trace_state = trace_state
        self.record = record
        self.attrs: dict = {}
        #: finished children: (name, span id, start, end, attributes, kind, status, events)
        self.spans: list[tuple] = []
        self.token: contextvars.Token | None = None
        self.start_ns = self.mark_ns = time.time_ns()  # mark: the start of the next stage
        self.prefill: _Client | None = None
        self.decode: _Client | None = None
        self.sent_ns = 0
        self.first_ns = 0
        self.ended = False

    def traceparent(self, span_id: int) -> str:
        """The W3C ``traceparent`` naming span ``span_id`` of this trace."""
        return f"00-{self.trace_id:032x}-{span_id:016x}-{int(self.flags):02x}"

    def _span(
        self, name: str, start: int, end: int, attrs: dict | None = None, status: Status = _UNSET
    ) -> None:
        if self.record:
            sid = self.tracing.ids.generate_span_id()
            self.spans.append((name, sid, start, end, attrs, SpanKind.INTERNAL, status, ()))

    def _close(self, c: _Client | None, end: int, error: str | None = None) -> None:
        if c is not None and self.record:
            status = Status(StatusCode.ERROR, error) if error else c.status
            self.spans.append((c.name, c.span_id, c.start, end, c.attrs, SpanKind.CLIENT, status, c.events))

    # -- the stages, in the order a request meets them ----------------------------------------
    def parsed(
        self, prompt_tokens: int | None = None, body_bytes: int | None = None, parsed: Parsed | None = None
    ) -> None:
        """Parsing and features are done (from the request's arrival). ``parsed``: the request
        (read by a recording, :mod:`stack.prefill_router.record`; not by the spans)."""
        now = time.time_ns()
        if self.record:
            self._span(
                "smetric.parse",
                self.mark_ns,
                now,
                {"smetric.prompt_tokens": prompt_tokens or 0, "smetric.body_bytes": body_bytes or 0},
            )
        self.mark_ns = now

    def queue_wait(self, start_ns: int, end_ns: int, outcome: str) -> None:
        """The request waited in the dispatch queue from ``start_ns``; ``outcome``: released,
        queue_full, max_queue_wait, cancelled. The routing decision starts after it."""
        self._span("smetric.queue_wait", start_ns, end_ns, {"smetric.queue.outcome": outcome})
        self.mark_ns = end_ns

    def routed(self, r: Routed, policy: str, attempt: int) -> None:
        """The routing decision is made (since parsing, or the end of the queue wait)."""
        now = time.time_ns()
        if self.record:
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
        attrs = {"smetric.attempt": attempt, "smetric.route.outcome": reason}
        self._span("smetric.route", self.mark_ns, now, attrs, Status(StatusCode.ERROR, reason))
        self.mark_ns = now

    def hand_off(self, r: Routed) -> tuple[dict[str, str], dict[str, str]]:
        """The prefill and the decode request are about to be sent: their CLIENT spans open, and
        each worker's ``traceparent`` header names its own span."""
        now = self.sent_ns = time.time_ns()
        ids = self.tracing.ids
        p = self.prefill = _Client(
            "smetric.prefill",
            ids.generate_span_id(),
            now,
            {"smetric.role": "prefill", "server.address": r.prefill.url},
        )
        p_hdr = {"traceparent": self.traceparent(p.span_id)}
        if r.decode is None:
            return p_hdr, p_hdr
        d = self.decode = _Client(
            "smetric.decode",
            ids.generate_span_id(),
            now,
            {"smetric.role": "decode", "server.address": r.decode.url},
        )
        return p_hdr, {"traceparent": self.traceparent(d.span_id)}

    def prefill_done(self) -> None:
        """Prefill's answer is drained (PD); in a colocated pool the prefill span lasts until the
        answer ends (:meth:`end`)."""
        if self.prefill is not None and self.decode is not None:
            self._close(self.prefill, time.time_ns())
            self.prefill = None

    def prefill_timed(self, ob: Observation) -> None:
        """The prefill worker's own timing of this request's prefill half (``router.cost_model``
        observe or learn): not a span of its own."""

    def upstream_failed(self, role: str, message: str) -> None:
        """A worker failed before anything was streamed: the attempt's spans end in error."""
        now = time.time_ns()
        self._close(self.prefill, now, f"{role}: {message}")
        self._close(self.decode, now, f"{role}: {message}")
        self.prefill = self.decode = None
        self.mark_ns = now

    def first_token(self) -> None:
        """The first chunk (or, not streamed, the whole answer) is in."""
        now = self.first_ns = time.time_ns()
        self._span("smetric.first_token", self.sent_ns or self.mark_ns, now)
        if self.decode is not None and self.record:
            self.decode.events.append(Event("first_token", timestamp=now))

    def end(
        self,
        status: int,
        error: str | None = None,
        chunks: int | None = None,
        nbytes: int | None = None,
        body: bytes | None = None,
    ) -> None:
        """The request is answered (``status``), or its stream ended (``chunks`` and ``nbytes``
        relayed; ``error``: how it broke, e.g. the client left). Its spans go out once. ``body``:
        a whole answer's bytes (read by a recording, not by the spans)."""
        if self.ended:
            return
        self.ended = True
        if not self.record:
            return
        now = time.time_ns()
        if chunks is not None:
            attrs = {"smetric.stream.chunks": chunks, "smetric.stream.bytes": nbytes or 0}
            self._span(
                "smetric.stream",
                self.first_ns or now,
                now,
                attrs,
                Status(StatusCode.ERROR, error) if error else _UNSET,
            )
        self._close(self.prefill, now, error)
        self._close(self.decode, now, error)
        self.prefill = self.decode = None
        self.attrs["http.response.status_code"] = status
        failed = status >= 500 or error
        root_status = Status(StatusCode.ERROR, error or f"HTTP {status}") if failed else _UNSET
        self.tracing.export(self._finished(now, root_status))

    def _finished(self, end: int, root_status: Status) -> list[ReadableSpan]:
        tr = self.tracing
        res, scope, tid, flags, ts = tr.resource, tr.scope, self.trace_id, self.flags, self.trace_state
        root = SpanContext(tid, self.span_id, False, flags, ts)
        out = [
            ReadableSpan(
                name,
                SpanContext(tid, sid, False, flags, ts),
                root,
                res,
                attrs,
                events,
                kind=kind,
                status=status,
                start_time=start,
                end_time=stop,
                instrumentation_scope=scope,
            )
            for name, sid, start, stop, attrs, kind, status, events in self.spans
        ]
        out.append(
            ReadableSpan(
                self.name,
                root,
                self.parent,
                res,
                self.attrs,
                kind=SpanKind.SERVER,
                status=root_status,
                start_time=self.start_ns,
                end_time=end,
                instrumentation_scope=scope,
            )
        )
        return out

    def detach(self) -> None:
        """This task no longer runs the request's routing (:func:`current` is None again)."""
        if self.token is not None:
            _CURRENT.reset(self.token)
            self.token = None
