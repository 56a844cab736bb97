"""The admin API of the learned cost model (``router.cost_model``: observe, learn):
``/admin/cost_model`` (status), ``/admin/cost_model/observations`` (JSON lines, or CSV with
``?format=csv``: what ``smetric calibrate --from`` reads) and ``/admin/cost_model/calibration``
(the learned model as a calibration file that ``--hardware FILE`` takes). Same bearer token as
``/admin/workers``; 404 with ``router.cost_model: static``."""

from __future__ import annotations

import orjson
from fastapi import APIRouter, Request
from fastapi.responses import Response

from stack.core.observations import to_csv, to_jsonl
from stack.prefill_router.api.admin import _authorized, _unauthorized
from stack.prefill_router.api.errors import JSON, error_response
from stack.prefill_router.state import RouterState


def cost_model_router(state: RouterState) -> APIRouter:
    router = APIRouter()

    def _gate(request: Request) -> Response | None:
        if not _authorized(state, request):
            return _unauthorized()
        if state.learner is None:
            return error_response(
                404,
                "the router learns no cost model: set router.cost_model to observe or learn",
                code="not_found",
            )
        return None

    @router.get("/admin/cost_model")
    async def status(request: Request):
        """the learned cost model's status; 404 with `router.cost_model: static`"""
        if (r := _gate(request)) is not None:
            return r
        return Response(orjson.dumps(state.learner.status()), media_type=JSON)

    @router.get("/admin/cost_model/observations")
    async def observations(request: Request):
        """the prefill timings observed, as JSON lines, or CSV with `?format=csv` (what `smetric
        calibrate --from` reads)"""
        if (r := _gate(request)) is not None:
            return r
        fmt = request.query_params.get("format", "jsonl")
        obs = list(state.learner.obs)
        if fmt == "csv":
            return Response(to_csv(obs), media_type="text/csv")
        if fmt != "jsonl":
            return error_response(422, "format must be jsonl or csv", param="format", code="invalid_value")
        return Response(to_jsonl(obs), media_type="application/x-ndjson")

    @router.get("/admin/cost_model/calibration")
    async def calibration(request: Request):
        """the learned model as a calibration file that `--hardware FILE` takes (YAML); 409
        `no_fit` before a fit"""
        if (r := _gate(request)) is not None:
            return r
        text = state.learner.calibration_text()
        if text is None:
            return error_response(409, "no learned fit yet: too few prefill observations", code="no_fit")
        return Response(text, media_type="application/yaml")

    return router
