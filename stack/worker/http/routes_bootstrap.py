"""The PD bootstrap endpoints a decode worker calls on its prefill twin.

``/kv/register`` (a decode half announces its receive region for a ``bootstrap_room``) and
``/route``. Served on the main app and, when the prefill worker has a separate bootstrap port,
on :func:`build_bootstrap_app` there too (with its own ``/health``).
"""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import Response

from stack.worker.http.encoding import error_response, json_response
from stack.worker.request_path import Worker


def add_bootstrap_routes(app: FastAPI, w: Worker) -> None:
    @app.post("/kv/register")
    async def kv_register(request: Request) -> Response:
        if w.s.mode != "prefill":
            return error_response("not a prefill worker", 404)
        b = await request.json()
        info = await w.engine.handoff.register_decode(
            int(b["room"]), str(b["peer"]), int(b["addr"]), int(b["nbytes"])
        )
        return json_response(info)

    @app.get("/route")
    async def route() -> Response:
        return json_response({"prefill": w.s.name, "host": w.s.host, "port": w.s.port, "mode": w.s.mode})


def build_bootstrap_app(w: Worker) -> FastAPI:
    """The bootstrap server of a prefill worker whose bootstrap port is not its HTTP port (no
    lifespan: the main app starts and stops the engine)."""
    app = FastAPI(title="smetric emulated PD bootstrap server")

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200 if w.engine.ready else 503)

    add_bootstrap_routes(app, w)
    return app
