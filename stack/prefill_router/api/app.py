"""``create_app``: the router's FastAPI app, wiring only.

One :class:`~stack.prefill_router.state.RouterState` per app (started and stopped by the
lifespan), the inference endpoints of :data:`~stack.prefill_router.api.endpoints.ENDPOINTS`
served by an :class:`~stack.prefill_router.api.inference.InferenceHandler`, the admin and
status routers, and the error handlers. The inference POSTs bypass FastAPI's routing and
middleware (raw ASGI, ~0.3 ms per request saved); their FastAPI routes stay for every
other method and as documentation. With ``router.auth`` keys, a
:class:`~stack.prefill_router.api.gate.Gate` checks every request's key first (and an
inference request's limits).
"""

from __future__ import annotations

import gc
import logging
from contextlib import asynccontextmanager

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import Response

from stack.config import DeploymentConfig
from stack.prefill_router.api.admin import admin_router
from stack.prefill_router.api.cost_model import cost_model_router
from stack.prefill_router.api.endpoints import ENDPOINTS
from stack.prefill_router.api.errors import OPENAI, install_error_handlers
from stack.prefill_router.api.gate import LIMITED_PATHS, Gate
from stack.prefill_router.api.inference import InferenceHandler
from stack.prefill_router.api.status import status_router
from stack.prefill_router.api.tokenize import tokenize_router
from stack.prefill_router.front_door import FrontDoor
from stack.prefill_router.state import RouterState

log = logging.getLogger("stack.router")


class _RouterApp(FastAPI):
    """FastAPI, with POSTs on the hot paths dispatched straight to the raw ASGI handler, and
    every other request's key checked first when ``router.auth`` has keys."""

    hot_paths: frozenset = frozenset()
    hot = None
    gate: Gate | None = None

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            if scope["method"] == "POST" and scope["path"] in self.hot_paths:
                await self.hot(scope, receive, send)
                return
            if self.gate is not None:
                if scope["path"] in LIMITED_PATHS:
                    await self._limited(scope, receive, send)
                    return
                if (refused := self.gate.check(scope)) is not None:
                    await refused(scope, receive, send)
                    return
        await super().__call__(scope, receive, send)

    async def _limited(self, scope, receive, send) -> None:
        """A client endpoint of :data:`LIMITED_PATHS`: its key and its request-rate and
        concurrency limits, as an inference request's (OpenAI's error shape)."""
        got = await self.gate.admit(scope, OPENAI)
        if isinstance(got, Response):
            await got(scope, receive, send)
            return
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.gate.release(got)


def create_app(
    cfg: DeploymentConfig,
    transport: httpx.AsyncBaseTransport | None = None,
    global_checker=None,
    freeze_gc: bool = False,
) -> FastAPI:
    """The router app for ``cfg`` (``transport``: an httpx transport for health checks and
    load polls, for tests; ``global_checker``: a Mooncake existence checker to use instead
    of connecting to ``mooncake.master``; ``freeze_gc``: the router owns its process, see
    :func:`_freeze_gc`)."""
    state = RouterState(cfg, transport, global_checker)
    gate = _gate(cfg, state)
    handler = InferenceHandler(state, on_parsed=gate.charge if gate is not None else None)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await state.start()
        if freeze_gc:
            _freeze_gc()
        try:
            yield
        finally:
            await state.stop()
            if gate is not None:
                await gate.close()

    app = _RouterApp(
        title="smetric router", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None
    )
    app.state.router = state
    #: router.front_door: served by service.run (and the tests' router threads) behind it
    app.state.front_door = FrontDoor(cfg.router.front_door, state.metrics.registry, cfg.router.retry_after_s)
    install_error_handlers(app)

    drain = state.drain

    async def hot(scope, receive, send) -> None:
        path = scope["path"]
        if drain.draining:  # its client retries on another replica (the load balancer's)
            resp = ENDPOINTS[path].envelope.overloaded(
                "this router replica is draining", cfg.router.retry_after_s
            )
            state.metrics.requests.labels(ENDPOINTS[path].name, str(resp.status_code)).inc()
            await resp(scope, receive, send)
            return
        drain.enter()
        try:
            await _hot(scope, receive, send, path)
        finally:
            drain.leave()

    async def _hot(scope, receive, send, path: str) -> None:
        ticket = None
        if gate is not None:  # the key and its request-rate and concurrency limits
            got = await gate.admit(scope, ENDPOINTS[path].envelope)
            if isinstance(got, Response):
                state.metrics.requests.labels(ENDPOINTS[path].name, str(got.status_code)).inc()
                await got(scope, receive, send)
                return
            ticket = scope["smetric.key"] = got
        try:
            try:
                resp = await handler.serve(Request(scope, receive), ENDPOINTS[path].name, path)
            except Exception:
                log.exception("internal error on %s", path)
                resp = ENDPOINTS[path].envelope.internal()
            await resp(scope, receive, send)
        finally:
            if ticket is not None:
                gate.release(ticket)

    app.hot_paths = frozenset(ENDPOINTS)
    app.hot = hot
    app.gate = gate
    for path, ep in ENDPOINTS.items():
        _add_inference_route(app, handler, path, ep.name)
    app.include_router(status_router(state))
    app.include_router(admin_router(state, gate))
    app.include_router(cost_model_router(state))
    app.include_router(tokenize_router(state))
    return app


def _gate(cfg: DeploymentConfig, state: RouterState) -> Gate | None:
    """The key checks of ``router.auth`` (None without keys): keys read now (a file that
    cannot be read stops the router here), limits shared through Redis with router replicas,
    and the prompt-token limit checked after parsing (:meth:`Gate.charge`, the handler's
    ``on_parsed``; prompts then always tokenized)."""
    rc = cfg.router
    if not rc.auth.enabled:
        return None
    gate = Gate(rc.auth, state.metrics.registry, state.shared, rc if state.shared is not None else None)
    if gate.counts_tokens:
        state.needs_features = True
    return gate


def _freeze_gc() -> None:
    """Once started, move every object alive (modules, the app, the config) out of the
    collector's reach, so that a full collection walks only what requests allocate since: a
    full pass over ~83k objects cost 27-35 ms (``benchmarks/router_step_costs.py``), a stall
    of the event loop that lands on some request's latency. Only for a process the router
    owns (``smetric router``): objects frozen are never collected."""
    gc.collect()
    gc.freeze()


def _add_inference_route(app: FastAPI, handler: InferenceHandler, path: str, endpoint: str) -> None:
    async def serve(request: Request):
        return await handler.serve(request, endpoint, path)

    app.add_api_route(path, serve, methods=["POST"], name=endpoint)
