"""Operator endpoints: ``/flush_cache`` and ``/abort_request`` (SGLang's bodies and codes)."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse, Response

from stack.worker.http.encoding import json_response
from stack.worker.request_path import Worker

_FLUSHED = (
    "Cache flushed.\nPlease check backend logs for more details. "
    "(When there are running or waiting requests, the operation will not be performed.)\n"
)


def add_admin_routes(app: FastAPI, w: Worker) -> None:
    e = w.engine

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache() -> Response:
        if e.cache.clear():
            return PlainTextResponse(_FLUSHED)
        return PlainTextResponse("Cache not flushed: requests hold pages.\n", status_code=400)

    @app.post("/abort_request")
    async def abort_request(request: Request) -> Response:
        # SGLang ignores a missing or unreadable body: it aborts nothing and says so
        try:
            body = await request.json()
        except Exception:
            body = {}
        if not isinstance(body, dict):
            body = {}
        e.c.abort_requests += 1
        n = e.abort(body.get("rid"), bool(body.get("abort_all", False)))
        return json_response({"aborted": n})
