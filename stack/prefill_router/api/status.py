"""What load balancers, Prometheus and OpenAI clients ask about the router itself:
``/health`` (200 while it can serve: a healthy prefill worker, and a healthy decode
worker when any is configured), ``/metrics`` (worker gauges refreshed from the pool at
each scrape) and ``/v1/models``."""

from __future__ import annotations

import orjson
from fastapi import APIRouter
from fastapi.responses import Response

from stack.prefill_router.api.errors import JSON
from stack.prefill_router.model_names import ModelNames
from stack.prefill_router.state import RouterState


def status_router(state: RouterState) -> APIRouter:
    """The status routes of ``state``'s router."""
    router = APIRouter()
    names = ModelNames(state.cfg.model.name, state.cfg.router.models).listed

    @router.get("/v1/models")
    async def models():  # the served model, then its aliases (router.models)
        """the served model, then its aliases (`router.models`), in OpenAI's list shape"""
        data = {
            "object": "list",
            "data": [{"id": n, "object": "model", "created": 0, "owned_by": "smetric"} for n in names],
        }
        return Response(orjson.dumps(data), media_type=JSON)

    @router.get("/health")
    async def health():
        """200 `{status: ok, prefill_healthy, decode_healthy}` while the router can serve (a
        healthy prefill worker, and a healthy decode worker when any is configured), else 503
        `unavailable`; 503 `draining` while the replica drains; with replicas, also
        `shared_state` (up or down) and `replica`"""
        if state.drain.draining:  # load balancers stop sending (stack/prefill_router/drain.py)
            body = {"status": "draining", **state.drain.describe()}
            return Response(orjson.dumps(body), status_code=503, media_type=JSON)
        p = len(state.registry.role("prefill", healthy_only=True))
        d = len(state.registry.role("decode", healthy_only=True))
        need_d = bool(state.registry.role("decode"))
        ok = p > 0 and (d > 0 or not need_d)
        body = {"status": "ok" if ok else "unavailable", "prefill_healthy": p, "decode_healthy": d}
        if state.shared is not None:  # router replicas: is the Redis shared state reachable
            body["shared_state"] = "up" if state.shared.up else "down"
            body["replica"] = state.shared.rid
        return Response(orjson.dumps(body), status_code=200 if ok else 503, media_type=JSON)

    @router.get("/metrics")
    async def metrics():
        """Prometheus text format (docs/reference/metrics.md); the worker gauges are refreshed
        from the pool at each scrape"""
        state.metrics.update_workers(state.registry.workers.values(), state.index.blocks)
        data, ctype = state.metrics.render()
        return Response(data, media_type=ctype)

    return router
