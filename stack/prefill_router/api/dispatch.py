"""The dispatch path of one inference request: parse -> route and book -> PD hand-off ->
answer -> release.

:meth:`InferenceHandler.dispatch` is the dispatch order: route (which returns the request
already booked on its prefill and decode worker, see :mod:`stack.prefill_router.routing`),
hand it off, and on a server-side failure before anything was streamed release it, eject
the failing worker and try once more on another one. :meth:`InferenceHandler.hand_off` is the
PD hand-off. Every exit releases the booking through :meth:`Booking.release` once.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from stack.agent_apis import AgentError
from stack.decode_router.pd import Upstream, UpstreamError
from stack.prefill_router.api.agents import (
    AGENT_ENDPOINTS,
    Envelope,
    count_tokens_answer,
    envelope,
    parse_agent,
)
from stack.prefill_router.api.errors import JSON, client_error
from stack.prefill_router.api.parse import Parsed, parse_inference, read_json
from stack.prefill_router.features import Cancelled, ClientError
from stack.prefill_router.offload import disconnect_watcher
from stack.prefill_router.queue import Overloaded
from stack.prefill_router.routing import NoWorker, Routed
from stack.prefill_router.session_hints import HintTracker
from stack.prefill_router.sglang_priority import deadline_priority
from stack.prefill_router.state import RouterState

log = logging.getLogger("stack.router")


class InferenceHandler:
    """Serves the inference endpoints of one router."""

    def __init__(self, state: RouterState) -> None:
        self.state = state
        self.cfg = state.cfg
        self.metrics = state.metrics
        self.hints = HintTracker()
        #: router.dispatch.sglang_priority: read once, off the hot path when false
        self.sglang_priority = self.cfg.router.dispatch.sglang_priority

    def _count(self, endpoint: str, status: int | str) -> None:
        self.metrics.requests.labels(endpoint, str(status)).inc()

    async def serve(self, request: Request, endpoint: str, path: str) -> Response:
        """One request on ``path`` (``endpoint``: "chat", "completions", "generate", or an
        agent API's "messages", "count_tokens", "responses"). The agent APIs differ only in
        parsing and in their error envelope; ``count_tokens`` is answered here."""
        t0 = time.perf_counter()
        env = envelope(endpoint)
        got = await read_json(request, self.cfg.router.max_body_bytes)
        if isinstance(got, Response):
            self._count(endpoint, got.status_code)
            return env.translate(got)
        body, raw = got
        st = self.state
        ctx = self.cfg.model.context_length
        if endpoint in AGENT_ENDPOINTS:
            fn, args = parse_agent, (st.features, endpoint, body, raw, request.headers, ctx)
        else:
            fn = parse_inference
            args = (st.features, endpoint, body, raw, request.headers, ctx, st.needs_features)
        pool = st.feature_pool
        try:
            if pool.inline(len(raw)):
                p = fn(*args)
            elif (p := pool.try_inline(len(raw), fn, *args)) is None:
                # much to tokenize: off the loop, dropped if the client leaves
                p = await pool.run(fn, *args, disconnected=disconnect_watcher(request.receive))
        except AgentError as e:
            self._count(endpoint, e.status)
            return env.client(e.status, e.message, param=e.param, code=e.status, type_=e.type)
        except ClientError as e:
            self._count(endpoint, e.status)
            return client_error(e)
        except Cancelled:
            self._count(endpoint, 499)  # nobody to answer
            return Response(status_code=499)
        if endpoint == "count_tokens":
            self._count(endpoint, 200)
            return count_tokens_answer(p.features)
        return await self.dispatch(p, endpoint, path, t0, env, receive=request.receive)

    async def dispatch(
        self,
        p: Parsed,
        endpoint: str,
        path: str,
        t0: float,
        env: Envelope | None = None,
        receive=None,
    ) -> Response:
        """Route, hand off, answer; one retry on other workers after a retryable failure
        (errors in ``env``'s shape: the endpoint's API)."""
        env = env or envelope(endpoint)
        st = self.state
        rc = self.cfg.router
        f = p.features
        exclude_p: set[int] = set()
        exclude_d: set[int] = set()
        with_decode = not st.colocated and bool(st.registry.role("decode"))
        prio = self._priority(f.prompt_tokens, endpoint) if self.sglang_priority else None
        for attempt in range(2):
            try:
                # waiting in the dispatch queue, a client that leaves gives up its place
                gone = disconnect_watcher(receive) if receive is not None else None
                r = await st.queue.route(f, exclude_p, exclude_d, with_decode, attempt == 0, gone)
            except Cancelled:
                self._count(endpoint, 499)
                return Response(status_code=499)
            except NoWorker as e:
                resp = env.no_worker(e.role, rc.retry_after_s)
                self._count(endpoint, resp.status_code)
                return resp
            except Overloaded as e:  # the dispatch queue refused it (router.dispatch)
                resp = env.overloaded(str(e), e.retry_after_s)
                self._count(endpoint, resp.status_code)
                return resp
            if attempt == 0:
                self.metrics.overhead.observe(time.perf_counter() - t0)
                self.metrics.decisions.labels(st.policy_name, r.kind.value).inc()
                self.metrics.record_hit(f.prompt_tokens, r.local_hit, r.global_hit)
                if f.session_id is not None and p.hint_source is not None:
                    outcome = self.hints.observe(f.session_id, r.prefill.wid)
                    self.metrics.session_hints.labels(p.hint_source, outcome).inc()
            if f.hashes:  # routing history, for workers that publish no KV events
                st.index.record_routed(r.prefill.wid, f.hashes)
            try:
                up = await self.hand_off(r, p, path, env.sse_error, prio)
            except UpstreamError as e:
                r.booking.release()
                self.metrics.upstream_errors.labels(e.role).inc()
                if not e.retryable:
                    self._count(endpoint, e.status)
                    return env.upstream(e)
                st.registry.mark_failed(e.worker, rc.health_failures, immediate=True)
                (exclude_p if e.worker.role == "prefill" else exclude_d).add(e.worker.wid)
                exclude_p.add(r.prefill.wid)
                if attempt == 0:
                    self.metrics.retries.inc()
                    log.warning("%s worker %s failed (%s); retrying", e.role, e.worker.url, e.message)
                    continue
                self._count(endpoint, 502)
                return env.bad_gateway(f"upstream failure: {e.message}")
            return await self.answer(r, up, p.stream, endpoint, t0)
        raise AssertionError("unreachable: the second attempt always returns")

    def _priority(self, prompt_tokens: int, endpoint: str) -> tuple[dict | None, dict | None]:
        """(body fields, headers) carrying the request's SGLang ``priority`` from its deadline
        (arrival + the router's ``SLO.ttft(L)``, as the dispatch queue computes it; wall clock,
        see :mod:`stack.prefill_router.sglang_priority`). SGLang's Anthropic request model has
        no ``priority`` field (a body key is dropped); its ``x-override-priority`` header is
        honoured on workers run with ``SGLANG_ENABLE_REQUEST_HEADER_OVERRIDES=1``."""
        v = deadline_priority(time.time() + self.state.slo.ttft(prompt_tokens))
        if endpoint == "messages":
            return None, {"x-override-priority": str(v)}
        return {"priority": v}, None

    async def hand_off(
        self, r: Routed, p: Parsed, path: str, sse_error=None, prio: tuple | None = None
    ) -> Upstream:
        """SGLang's PD hand-off (``stack.decode_router.pd``): the same body to the prefill and
        the decode worker; returns once decode's first chunk is in. When prefill's answer
        returns, its queued work leaves the worker's load; a worker that publishes no KV
        events is taken to have written the prompt's blocks through to the global tier.
        ``prio``: :meth:`_priority`'s (body fields, headers), or None."""
        st = self.state
        f = p.features
        pw = r.prefill

        def prefill_done() -> None:
            if r.booking.prefill_done() and f.hashes and not pw.kv_events:
                st.global_tier.record_written(f.hashes)

        if prio is None:
            return await st.forwarder.forward(
                path, p.raw, p.body, pw, r.decode, prefill_done, stream=p.stream, sse_error=sse_error
            )
        extra, headers = prio
        return await st.forwarder.forward(
            path, p.raw, p.body, pw, r.decode, prefill_done, headers, p.stream, sse_error, extra
        )

    async def answer(self, r: Routed, up: Upstream, stream: bool, endpoint: str, t0: float) -> Response:
        """Stream or collect the upstream answer; the booking is released when it ends.
        A streamed answer's first chunk is its TTFT, handed to a learning policy."""
        st = self.state
        if stream:
            ttft = time.perf_counter() - t0
            self.metrics.ttft.observe(ttft)
            try:
                if r.feedback is not None:
                    st.policy.observe(r.request, r.prefill.wid, r.feedback, ttft)
            except Exception:  # a learning policy must never break serving
                log.exception("policy.observe")
            self._count(endpoint, 200)
            return StreamingResponse(_released(up, r), media_type=up.content_type or "text/event-stream")
        try:
            parts = [up.first or b""]
            async for chunk in up.rest:
                parts.append(chunk)
        finally:
            r.booking.release()
        self.metrics.ttft.observe(time.perf_counter() - t0)
        self._count(endpoint, 200)
        return Response(b"".join(parts), status_code=200, media_type=up.content_type or JSON)


async def _released(up: Upstream, r: Routed) -> AsyncIterator[bytes]:
    """The upstream stream, releasing the booking when it ends (or the client leaves)."""
    try:
        if up.first:
            yield up.first
        async for chunk in up.rest:
            yield chunk
    finally:
        r.booking.release()
