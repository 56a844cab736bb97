"""``build_app``: the worker's FastAPI app, wired from the route groups of this package."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

from fastapi import FastAPI

from stack.worker.http.auth import ApiKeyCheck
from stack.worker.http.endpoints import ENDPOINTS, add_inference_routes
from stack.worker.http.metrics import add_metrics_route
from stack.worker.http.routes_admin import add_admin_routes
from stack.worker.http.routes_bootstrap import add_bootstrap_routes
from stack.worker.http.routes_openai import add_openai_routes
from stack.worker.http.routes_status import add_status_routes
from stack.worker.request_path import Worker
from stack.worker.settings import WorkerSettings


def build_app(settings: WorkerSettings) -> tuple[FastAPI, Worker]:
    """The app and its worker; the app's lifespan starts and stops the engine. The bootstrap
    endpoints are served here too (a prefill worker's bootstrap port defaults to its HTTP
    port). ``settings.enable_trace``: each inference request gets a span continuing the
    ``traceparent`` it carries (:mod:`.tracing`; ``app.state.tracing``, else None)."""
    w = Worker(settings)
    tracing = None
    if settings.enable_trace:
        from stack.worker.http.tracing import WorkerTracing

        tracing = WorkerTracing(settings)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await w.engine.start()
        try:
            yield
        finally:
            await w.engine.stop()
            if tracing is not None:
                tracing.provider.shutdown()

    app = FastAPI(title=f"smetric emulated SGLang worker ({settings.mode})", lifespan=lifespan)
    add_inference_routes(app, w)
    add_openai_routes(app, w)
    add_status_routes(app, w)
    add_admin_routes(app, w)
    add_metrics_route(app, w)
    add_bootstrap_routes(app, w)
    app.state.tracing = tracing
    if tracing is not None:
        from stack.worker.http.tracing import TraceMiddleware

        app.add_middleware(TraceMiddleware, tracing=tracing, paths=frozenset(ENDPOINTS))
    if settings.api_key or settings.admin_api_key:  # SGLang's --api-key / --admin-api-key
        app.add_middleware(ApiKeyCheck, api_key=settings.api_key, admin_api_key=settings.admin_api_key)
    return app, w
