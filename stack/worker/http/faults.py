"""Fault injection for tests: an ASGI wrapper that slows the worker or breaks its answers.

It sits outside FastAPI so a ``malformed`` fault can send bytes no route would (a truncated
JSON body, an SSE stream that turns into garbage), which is what the router's fault tests need.
"""

from __future__ import annotations

import asyncio
import logging

import orjson
from starlette.types import ASGIApp, Receive, Scope, Send

from stack.worker.events import KVEventPublisher
from stack.worker.http.endpoints import MALFORMED_PATHS
from stack.worker.settings import WorkerSettings

log = logging.getLogger("stack.worker")


def with_faults(app: ASGIApp, settings: WorkerSettings, publisher: KVEventPublisher | None = None) -> ASGIApp:
    """The app, wrapped in :class:`FaultInjector` only when a fault is set or ``fault_control`` is
    on: a worker started normally exposes no ``/debug/fault``."""
    return FaultInjector(app, settings, publisher) if settings.fault or settings.fault_control else app


class FaultInjector:
    """ASGI wrapper: the faults of ``WorkerSettings.fault``, and ``POST /debug/fault`` to change
    them at run time (``{"fault": "slow" | "stall" | "malformed" | null, "delay_s": 30}``; ``{"kv_gap": N}``:
    the next N KV-event batches are left out of the live stream, still replayable, so that a
    subscriber sees a sequence gap). Installed only when a fault is set or ``fault_control`` is on."""

    def __init__(
        self, app: ASGIApp, settings: WorkerSettings, publisher: KVEventPublisher | None = None
    ) -> None:
        self.app = app
        self.s = settings
        self.publisher = publisher

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path, method = scope["path"], scope["method"]
        if path == "/debug/fault" and method == "POST":
            return await self._set(receive, send)
        fault = self.s.fault
        if fault == "slow":
            await asyncio.sleep(self.s.fault_delay_s)
        elif fault == "stall" and method == "POST" and path in MALFORMED_PATHS:
            await asyncio.sleep(self.s.fault_delay_s)
        elif fault == "malformed" and method == "POST" and path in MALFORMED_PATHS:
            return await self._malformed(receive, send)
        elif fault == "malformed" and path == "/v1/loads":
            return await _raw(send, 200, b"application/json", b'{"loads": [{"num_running_reqs": "lots"}]}')
        return await self.app(scope, receive, send)

    async def _body(self, receive: Receive) -> bytes:
        body = b""
        while True:
            msg = await receive()
            body += msg.get("body", b"")
            if not msg.get("more_body"):
                return body

    async def _set(self, receive: Receive, send: Send) -> None:
        try:
            b = orjson.loads(await self._body(receive))
            if "kv_gap" in b:
                return await self._kv_gap(b["kv_gap"], send)
            fault = b.get("fault")
            WorkerSettings(fault=fault)  # validates
            delay = None if b.get("delay_s") is None else float(b["delay_s"])
        except (ValueError, TypeError, AttributeError) as ex:
            return await _raw(send, 400, b"application/json", orjson.dumps({"error": str(ex)}))
        self.s.fault = fault
        if delay is not None:
            self.s.fault_delay_s = delay
        log.warning("fault injection: %s", fault)
        await _raw(send, 200, b"application/json", orjson.dumps({"fault": fault}))

    async def _kv_gap(self, n: object, send: Send) -> None:
        if self.publisher is None or not isinstance(n, int) or isinstance(n, bool) or n < 0:
            err = {"error": "kv_gap: a count >= 0, on a worker that publishes KV events"}
            return await _raw(send, 400, b"application/json", orjson.dumps(err))
        self.publisher.drop_next(n)
        log.warning("fault injection: the next %d KV-event batches left out of the live stream", n)
        await _raw(send, 200, b"application/json", orjson.dumps({"kv_gap": n}))

    async def _malformed(self, receive: Receive, send: Send) -> None:
        try:
            stream = bool(orjson.loads(await self._body(receive)).get("stream"))
        except (ValueError, AttributeError):
            stream = False
        if not stream:
            return await _raw(send, 200, b"application/json", b'{"id": "x", "choices": [{"message": {"con')
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", b"text/event-stream")],
            }
        )
        ok = b'data: {"choices": [{"index": 0, "delta": {"content": "ok"}}]}\n\n'
        await send({"type": "http.response.body", "body": ok, "more_body": True})
        await asyncio.sleep(0.01)
        bad = b'data: {"choices": [{"index": 0, "delta": \xff\xfe not json\n\n'
        await send({"type": "http.response.body", "body": bad, "more_body": False})


async def _raw(send: Send, status: int, ctype: bytes, data: bytes) -> None:
    headers = [(b"content-type", ctype), (b"content-length", str(len(data)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": data})
