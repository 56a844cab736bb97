"""The request path of one inference request: parse -> route and book -> PD hand-off ->
answer -> release.

:meth:`InferenceHandler.serve` parses the body as its endpoint says
(:mod:`stack.prefill_router.api.endpoints`); :meth:`InferenceHandler.route_and_forward`
routes it (which returns the request already booked on its prefill and decode worker, a
:class:`~stack.prefill_router.routed.Routed`), hands it off, and on a server-side failure
before anything was streamed tries once more on other workers. What routing records along the
way (routing history, prefill done, first token, ejection, release) is the routed request's
own (:mod:`stack.prefill_router.routed`); this layer parses, calls routing, streams, counts
and shapes errors (:mod:`stack.prefill_router.api.errors`). Every exit releases the booking
once.

Tracing (``router.tracing``, :mod:`stack.prefill_router.tracing`): :meth:`serve` opens the
request's trace and each stage records its own span in it; with tracing off the trace is the
null one (:data:`~stack.prefill_router.tracing.NULL_TRACE`), whose stages do nothing, so there
is one path either way. A request that is not routed is answered from one table
(:data:`NOT_ROUTED`: the exception, its error kind, its answer and its trace's reason).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from stack.agent_apis import AgentError
from stack.decode_router.handoff import HandOff
from stack.decode_router.sse import ends_stream
from stack.decode_router.upstream import Upstream, UpstreamError
from stack.dispatch.sglang_priority import dispatch_priority
from stack.prefill_router.api.cancel import ReleasingStream, unless_gone
from stack.prefill_router.api.endpoints import ENDPOINTS, Endpoint
from stack.prefill_router.api.errors import JSON, Envelope, client_error
from stack.prefill_router.api.keepalive import kept_alive
from stack.prefill_router.api.parse import Parsed, disconnect_watcher, read_json
from stack.prefill_router.errors import Cancelled, ClientError
from stack.prefill_router.model_names import ModelNames
from stack.prefill_router.queue import Overloaded
from stack.prefill_router.routed import Excluded, Routed
from stack.prefill_router.routing import NoWorker
from stack.prefill_router.state import RouterState
from stack.prefill_router.tracing import NULL_TRACE, NullTrace, RequestTrace

log = logging.getLogger("stack.router")

Trace = RequestTrace | NullTrace
#: (request, parsed, envelope) -> a refusal or None, once a forwarded request is parsed
OnParsed = Callable[[Request, Parsed, Envelope], Awaitable[Response | None]]

#: a request that was not routed: its exception -> (error kind, the answer, the trace's reason),
#: given the exception, the endpoint's envelope and ``router.retry_after_s``
NOT_ROUTED: dict[type[Exception], Callable[[Exception, Envelope, int], tuple[str, Response, str]]] = {
    Cancelled: lambda e, env, ra: ("cancelled", Response(status_code=499), "cancelled"),  # nobody to answer
    NoWorker: lambda e, env, ra: ("no_worker", env.no_worker(e.role, ra), f"no {e.role} worker"),
    Overloaded: lambda e, env, ra: ("overloaded", env.overloaded(str(e), e.retry_after_s), e.reason),
}


class InferenceHandler:
    """Serves the inference endpoints of one router. ``on_parsed``: checked once a forwarded
    request is parsed, a refusal or None (the per-key prompt-token limit,
    :meth:`stack.prefill_router.api.gate.Gate.charge`); None: no check."""

    def __init__(self, state: RouterState, on_parsed: OnParsed | None = None) -> None:
        self.state = state
        self.cfg = state.cfg
        self.metrics = state.metrics
        #: router.dispatch.sglang_priority: read once, off the hot path when false
        self.sglang_priority = self.cfg.router.dispatch.sglang_priority
        self.on_parsed = on_parsed
        #: router.tracing (off: NO_TRACING, whose traces do nothing)
        self.tracing = state.tracing
        #: router.record (off: None)
        self.recorder = state.recorder
        #: router.models: the model names served (others: 404)
        self.models = ModelNames(self.cfg.model.name, self.cfg.router.models)

    def _count(self, endpoint: str, status: int | str) -> None:
        self.metrics.requests.labels(endpoint, str(status)).inc()

    def _error(self, endpoint: str, kind: str, status: int | str) -> None:
        """A request answered with an error: counted by status and by kind
        (:data:`~stack.prefill_router.metrics.ERROR_KINDS`)."""
        self.metrics.requests.labels(endpoint, str(status)).inc()
        self.metrics.errors.labels(endpoint, kind).inc()

    async def serve(self, request: Request, endpoint: str, path: str) -> Response:
        """One request on ``path`` (an inference endpoint of
        :data:`~stack.prefill_router.api.endpoints.ENDPOINTS`, called ``endpoint``). The
        endpoints differ only in parsing, in their error envelope and in what the table says
        becomes of them (e.g. ``count_tokens`` is answered here). The request's trace ends with
        the answer (a stream's, when the stream ends)."""
        rt = self.tracing.start("POST", path, endpoint, request.headers)
        if self.recorder is not None:  # router.record: the trace notes what the recording needs
            rt = self.recorder.trace(rt, endpoint)
        try:
            resp = await self._parse_and_route(request, endpoint, path, rt)
        except BaseException as e:
            rt.end(500, type(e).__name__)
            raise
        finally:
            rt.detach()
        if not isinstance(resp, StreamingResponse):  # a stream ends its trace when it ends
            rt.end(resp.status_code, body=resp.body)
        return resp

    async def _parse_and_route(self, request: Request, endpoint: str, path: str, rt: Trace) -> Response:
        t0 = time.perf_counter()
        ep = ENDPOINTS[path]
        env = ep.envelope
        try:
            got = await read_json(request, self.cfg.router.max_body_bytes)
        except Cancelled:
            return self._gone_reading(request, endpoint)
        if isinstance(got, Response):
            self._error(endpoint, "too_large" if got.status_code == 413 else "bad_request", got.status_code)
            return env.translate(got)
        body, raw = got
        model = body.get("model")
        if ep.checks_model and isinstance(model, str) and not self.models.accepts(model):
            self._error(endpoint, "bad_request", 404)
            return env.model_not_found(model)
        st = self.state
        args = (st.features, endpoint, body, raw, request.headers, self.cfg.model.context_length)
        args += (st.needs_features,)
        fn = ep.parse
        pool = st.feature_pool
        try:
            if pool.inline(len(raw)):
                p = fn(*args)
            elif (p := pool.try_inline(len(raw), fn, *args)) is None:
                # much to tokenize: off the loop, dropped if the client leaves
                p = await pool.run(fn, *args, disconnected=disconnect_watcher(request.receive))
        except AgentError as e:
            self._error(endpoint, "bad_request", e.status)
            return env.client(e.status, e.message, param=e.param, code=e.status, type_=e.type)
        except ClientError as e:
            self._error(endpoint, "bad_request", e.status)
            return client_error(e)
        except (Cancelled, Overloaded) as e:  # gone, or waited past router.feature_wait_s
            return self._not_routed(e, env, endpoint, 0, rt)
        rt.parsed(p.features.prompt_tokens, len(raw), p)
        if ep.local is not None:
            self._count(endpoint, 200)
            return ep.local(p)
        if self.on_parsed is not None and (refused := await self.on_parsed(request, p, env)) is not None:
            self._count(endpoint, refused.status_code)
            return refused
        return await self.route_and_forward(p, ep, path, t0, request.receive, rt)

    def _gone_reading(self, request: Request, endpoint: str) -> Response:
        """The client left (or the front door cut it off, 408) before its body was read: the
        client's doing, counted and logged at debug level; the answer goes nowhere."""
        timed_out = request.scope.get("smetric.front_door") == "body_timeout"
        status = 408 if timed_out else 499
        self.metrics.disconnects.labels(endpoint).inc()
        self._error(endpoint, "cancelled", status)
        log.debug("%s: client gone while its body was read (%s)", endpoint, status)
        return Response(status_code=status)

    def _not_routed(self, e: Exception, env: Envelope, endpoint: str, attempt: int, rt: Trace) -> Response:
        """The answer to a request that was not routed (:data:`NOT_ROUTED`), counted and traced."""
        kind, resp, reason = NOT_ROUTED[type(e)](e, env, self.cfg.router.retry_after_s)
        rt.not_routed(reason, attempt)
        self._error(endpoint, kind, resp.status_code)
        return resp

    async def route_and_forward(
        self, p: Parsed, ep: Endpoint, path: str, t0: float, receive=None, rt: Trace = NULL_TRACE
    ) -> Response:
        """Route, hand off, answer; one retry on other workers after a retryable failure
        (errors in ``ep``'s envelope). ``rt``: the request's trace. A streamed request whose
        answer has not started ``router.stream_keepalive_s`` after it left the dispatch queue
        gets its 200 and keep-alives until it does (:mod:`stack.prefill_router.api.keepalive`)."""
        ka = self.cfg.router.stream_keepalive_s
        if not p.stream or ka is None:
            return await self._route_and_forward(p, ep, path, t0, receive, rt)
        left = asyncio.Event()
        work = asyncio.ensure_future(self._route_and_forward(p, ep, path, t0, receive, rt, left))
        try:
            return await kept_alive(work, left, ka, ep.envelope.sse_error, rt)
        except asyncio.CancelledError:
            work.cancel()
            raise

    async def _route_and_forward(
        self,
        p: Parsed,
        ep: Endpoint,
        path: str,
        t0: float,
        receive=None,
        rt: Trace = NULL_TRACE,
        left: asyncio.Event | None = None,
    ) -> Response:
        """:meth:`route_and_forward`'s work; ``left`` is set once the request has left the
        dispatch queue."""
        env = ep.envelope
        endpoint = ep.name
        st = self.state
        rc = self.cfg.router
        f = p.features
        excluded = Excluded()
        with_decode = ep.decode and not st.colocated and bool(st.registry.role("decode"))
        for attempt in range(2):
            try:
                # waiting in the dispatch queue, a client that leaves gives up its place
                gone = disconnect_watcher(receive) if receive is not None else None
                r = await st.queue.route(
                    f,
                    excluded.prefill,
                    excluded.decode,
                    with_decode,
                    attempt == 0,
                    gone,
                    time.perf_counter() - t0,
                )
            except (Cancelled, NoWorker, Overloaded) as e:  # Overloaded: the dispatch queue refused it
                return self._not_routed(e, env, endpoint, attempt, rt)
            if left is not None:
                left.set()
            # the priority class from the slack left now, as it leaves the dispatch queue
            prio = self._priority(f.prompt_tokens, ep, t0) if self.sglang_priority else None
            rt.routed(r, st.policy_name, attempt)
            if attempt == 0:
                self.metrics.overhead.observe(time.perf_counter() - t0)
                self.metrics.decisions.labels(st.policy_name, r.kind.value).inc()
                self.metrics.record_hit(f.prompt_tokens, r.local_hit, r.global_hit)
            hinted = attempt == 0 and f.session_id is not None and p.hint_source is not None
            outcome = r.pre_request(f.session_id if hinted else None)
            if outcome is not None:
                self.metrics.session_hints.labels(p.hint_source, outcome).inc()
            t_call = time.monotonic()
            try:  # a client that leaves before the first token: both workers abort (api/cancel.py)
                up = await unless_gone(self.hand_off(r, p, path, env.sse_error, prio, rt), gone)
            except Cancelled:
                r.release()
                self._count(endpoint, 499)
                return Response(status_code=499)
            except asyncio.CancelledError:  # a kept-alive stream's client left: the hand-off aborted
                r.release()
                self._count(endpoint, 499)
                raise
            except UpstreamError as e:
                rt.upstream_failed(e.role, e.message)
                self.metrics.upstream_errors.labels(e.role).inc()
                # a failure while the router itself stood still is the router's, not the worker's
                counts = not st.watch.stalled_since(t_call)
                if not r.failed(e, excluded, rc.health_failures, counts):
                    self._error(endpoint, "upstream", e.status)
                    return env.upstream(e)
                if attempt == 0:
                    self.metrics.retries.inc()
                    log.warning("%s worker %s failed (%s); retrying", e.role, e.worker.url, e.message)
                    continue
                self._error(endpoint, "bad_gateway", 502)
                return env.bad_gateway(f"upstream failure: {e.message}")
            if r.decode is not None:
                st.registry.call_ok(r.decode)
            return await self.answer(r, up, p.stream, endpoint, t0, f.prompt_tokens, rt)
        raise AssertionError("unreachable: the second attempt always returns")

    def _priority(
        self, prompt_tokens: int, ep: Endpoint, t0: float
    ) -> tuple[dict | None, dict | None] | None:
        """(body fields, headers) carrying the request's SGLang ``priority``: its priority
        class from the slack it has left now (its deadline, arrival ``t0`` + the router's
        ``SLO.ttft(L)`` as the dispatch queue computes it, less now; the one rule the
        simulator's ``prio=1`` uses, :mod:`stack.dispatch.sglang_priority`), as
        ``ep.priority`` says it travels (None: not at all). The ``x-override-priority``
        header is honoured on workers run with ``SGLANG_ENABLE_REQUEST_HEADER_OVERRIDES=1``."""
        if ep.priority is None:
            return None
        slo = self.state.slo
        v = dispatch_priority(slo.ttft(prompt_tokens), time.perf_counter() - t0, slo)
        if ep.priority == "header":
            return None, {"x-override-priority": str(v)}
        return {"priority": v}, None

    async def hand_off(
        self,
        r: Routed,
        p: Parsed,
        path: str,
        sse_error=None,
        prio: tuple | None = None,
        rt: Trace = NULL_TRACE,
    ) -> Upstream:
        """SGLang's PD hand-off (``stack.decode_router.handoff``): the same body to the prefill and
        the decode worker; returns once decode's first chunk is in. When prefill's answer
        returns, :meth:`Routed.prefill_done`. ``prio``: :meth:`_priority`'s (body fields,
        headers), or None. ``rt``: the request's trace (each worker gets its ``traceparent``)."""
        extra, headers = prio if prio is not None else (None, None)
        trace_headers = rt.hand_off(r)
        done = r.prefill_done if trace_headers is None else _both(rt.prefill_done, r.prefill_done)
        h = HandOff(
            path,
            p.raw,
            p.body,
            r.prefill,
            r.decode,
            done,
            headers,
            p.stream,
            sse_error,
            extra,
            trace_headers,
            rt.prefill_timed,
        )
        up = await self.state.forwarder.forward(h)
        rt.first_token()
        return up

    async def answer(
        self,
        r: Routed,
        up: Upstream,
        stream: bool,
        endpoint: str,
        t0: float,
        prompt_tokens: int = 0,
        rt: Trace = NULL_TRACE,
    ) -> Response:
        """Stream or collect the upstream answer; the request is released when it ends.
        A streamed answer's first chunk is its TTFT (:meth:`Routed.first_token`), held to the
        router's TTFT SLO for ``prompt_tokens`` (the SLO metrics)."""
        if stream:
            ttft = time.perf_counter() - t0
            self.metrics.ttft.observe(ttft)
            pool_ttft = ttft / self.state.time_factor  # in the pool's seconds (router.time_factor)
            self.metrics.record_slo(prompt_tokens, pool_ttft <= self.state.slo.ttft(prompt_tokens))
            r.first_token(pool_ttft)
            self._count(endpoint, 200)
            body = _relayed(up, r, rt)
            ctype = up.content_type or "text/event-stream"
            return ReleasingStream(body, up, r.release, media_type=ctype)
        try:
            parts = [up.first or b""]
            async for chunk in up.rest:
                parts.append(chunk)
        finally:
            r.release()
        self.metrics.ttft.observe(time.perf_counter() - t0)
        self._count(endpoint, 200)
        return Response(b"".join(parts), status_code=200, media_type=up.content_type or JSON)


def _both(a: Callable[[], None], b: Callable[[], None]) -> Callable[[], None]:
    def both() -> None:
        a()
        b()

    return both


async def _relayed(up: Upstream, r: Routed, rt: Trace) -> AsyncIterator[bytes]:
    """The upstream stream, releasing the request when it ends (or the client leaves) and
    ending its trace (chunks and bytes relayed; a client that left before the stream's final
    event ends it in error: one that closes once it has ``[DONE]`` is done). The trace ends
    as soon as the final event has been handed to the client, not when the upstream closes
    after it: the client may send its next turn from then on, and a recording's
    ``completion`` is what its think time counts from."""
    chunks = nbytes = 0
    error: str | None = "client gone"
    answered = False
    try:
        if up.first:
            chunks, nbytes = 1, len(up.first)
            if ends_stream(up.first):
                error = None
            yield up.first
            if error is None:
                answered = True
                rt.end(200, None, chunks, nbytes)
        async for chunk in up.rest:
            chunks += 1
            nbytes += len(chunk)
            if answered or not ends_stream(chunk):
                yield chunk
                continue
            error = None
            yield chunk
            answered = True
            rt.end(200, None, chunks, nbytes)
        error = None
    finally:
        r.release()
        if not answered:
            rt.end(200, error, chunks, nbytes)
