"""Health checks and load polls of the pool's workers.

``/health`` decides admission (eject after N consecutive failures, readmit on success
after the registry's cooldown); ``/v1/loads`` (SGLang: ``{"loads": [{"num_running_reqs",
"num_waiting_reqs", "token_usage", ...} per dp rank]}``; older versions answer
``{"load": N}`` on ``/get_load``) feeds the polled figures of :class:`Worker`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import httpx
import orjson

from stack.pool.registry import WorkerRegistry
from stack.pool.worker import Worker

log = logging.getLogger("stack.router.workers")


def parse_loads(data) -> tuple[int, int, float] | None:
    """(running, waiting, token_usage) from a ``/v1/loads`` answer (new or old shape)."""
    if isinstance(data, dict) and "loads" in data and isinstance(data["loads"], list):
        run = wait = 0
        usage = 0.0
        n = 0
        for item in data["loads"]:
            if not isinstance(item, dict):
                continue
            try:  # a worker answering nonsense must not break the health loop
                run += int(item.get("num_running_reqs") or 0)
                wait += int(item.get("num_waiting_reqs") or item.get("num_queue_reqs") or 0)
                usage += float(item.get("token_usage") or 0.0)
            except (TypeError, ValueError, OverflowError):
                return None
            n += 1
        return run, wait, usage / n if n else 0.0
    if isinstance(data, dict) and "load" in data:
        try:
            return int(data["load"]), 0, 0.0
        except (TypeError, ValueError, OverflowError):
            return None
    if isinstance(data, list):
        return parse_loads({"loads": data})
    return None


class HealthChecker:
    """Polls ``/health`` (eject after N failures, readmit on success) and ``/v1/loads``."""

    def __init__(
        self,
        registry: WorkerRegistry,
        client: httpx.AsyncClient,
        interval_s: float,
        timeout_s: float,
        failures: int,
        poll_loads: bool = True,
        on_tick: Callable[[], None] | None = None,
    ) -> None:
        self.reg = registry
        self.client = client
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.failures = failures
        self.poll_loads = poll_loads
        self.on_tick = on_tick
        self._task: asyncio.Task | None = None
        self._old_shape: set[int] = set()

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):
                pass
            self._task = None

    async def _run(self) -> None:
        while True:
            try:
                await self.check_all()
                if self.on_tick:
                    self.on_tick()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("health loop")
            await asyncio.sleep(self.interval_s)

    async def check_all(self) -> None:
        ws = list(self.reg.workers.values())
        if ws:  # one worker's failure must not skip the others' checks or the tick
            for w, r in zip(ws, await asyncio.gather(*(self.check(w) for w in ws), return_exceptions=True)):
                if isinstance(r, Exception):
                    log.warning("health check of %s failed: %r", w.url, r)

    async def check(self, w: Worker) -> None:
        try:
            r = await self.client.get(w.url + "/health", timeout=self.timeout_s)
            ok = r.status_code == 200
        except (httpx.HTTPError, OSError):
            ok = False
        if not ok:
            self.reg.mark_failed(w, self.failures)
            return
        self.reg.mark_ok(w)
        if self.poll_loads:
            await self.poll(w)

    async def poll(self, w: Worker) -> None:
        paths = ("/get_load", "/v1/loads") if w.wid in self._old_shape else ("/v1/loads", "/get_load")
        for path in paths:
            try:
                r = await self.client.get(w.url + path, timeout=self.timeout_s)
            except (httpx.HTTPError, OSError):
                return
            if r.status_code != 200:
                continue
            try:
                parsed = parse_loads(orjson.loads(r.content))
            except orjson.JSONDecodeError:
                parsed = None
            if parsed is None:
                continue
            if path == "/get_load":
                self._old_shape.add(w.wid)
            w.polled_running, w.polled_waiting, w.polled_token_usage = parsed
            w.polled_at = time.monotonic()
            return
