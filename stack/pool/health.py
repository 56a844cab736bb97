"""Health checks and load polls of the pool's workers.

``/health`` decides admission (eject after N consecutive failures, readmit on success
after the registry's cooldown; a check that failed while the router's own event loop stood
still is not counted, :class:`~stack.pool.loop_watch.LoopWatch`); ``/v1/loads`` (SGLang: ``{"loads": [{"num_running_reqs",
"num_waiting_reqs", "token_usage", ...} per dp rank]}``; older versions answer
``{"load": N}`` on ``/get_load``) feeds the polled figures of :class:`Worker`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import aiohttp
import httpx
import orjson

from stack.pool.loop_watch import LoopWatch
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


#: what a failed check or poll raises (either client)
_FAILED = (httpx.HTTPError, aiohttp.ClientError, asyncio.TimeoutError, OSError)


class HealthChecker:
    """Polls ``/health`` (eject after N failures, readmit on success) and ``/v1/loads``.

    ``client``: an ``aiohttp.ClientSession`` (the router's: about a third of httpx's CPU
    per request, which matters with dozens of workers polled every interval) or an
    ``httpx.AsyncClient`` (tests with a mock transport)."""

    def __init__(
        self,
        registry: WorkerRegistry,
        client: aiohttp.ClientSession | httpx.AsyncClient,
        interval_s: float,
        timeout_s: float,
        failures: int,
        poll_loads: bool = True,
        on_tick: Callable[[], None] | None = None,
        watch: LoopWatch | None = None,
    ) -> None:
        self.reg = registry
        #: the router's own stalls: a check that failed in one is not counted (None: all count)
        self.watch = watch
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
            t0 = time.monotonic()
            try:
                await self.check_spread()
                if self.on_tick:
                    self.on_tick()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("health loop")
            await asyncio.sleep(max(0.0, self.interval_s - (time.monotonic() - t0)))

    async def check_spread(self) -> None:
        """One round of checks, the workers' spread evenly over the interval: with many
        workers, checking all at once stalls the event loop for tens of milliseconds every
        interval (each check and load poll is an HTTP round trip of CPU on the loop), which
        showed as the requests' p99."""
        ws = list(self.reg.workers.values())
        if not ws:
            return
        step = self.interval_s / len(ws)
        tasks = []
        try:
            for i, w in enumerate(ws):
                if i:
                    await asyncio.sleep(step)
                tasks.append(asyncio.ensure_future(self.check(w)))
            for w, r in zip(ws, await asyncio.gather(*tasks, return_exceptions=True)):
                if isinstance(r, Exception):
                    log.warning("health check of %s failed: %r", w.url, r)
        finally:
            for t in tasks:
                t.cancel()

    async def check_all(self) -> None:
        ws = list(self.reg.workers.values())
        if ws:  # one worker's failure must not skip the others' checks or the tick
            for w, r in zip(ws, await asyncio.gather(*(self.check(w) for w in ws), return_exceptions=True)):
                if isinstance(r, Exception):
                    log.warning("health check of %s failed: %r", w.url, r)

    async def _get(self, url: str) -> tuple[int, bytes]:
        c = self.client
        if isinstance(c, httpx.AsyncClient):
            r = await c.get(url, timeout=self.timeout_s)
            return r.status_code, r.content
        async with c.get(url, timeout=aiohttp.ClientTimeout(total=self.timeout_s)) as r:
            return r.status, await r.read()

    async def check(self, w: Worker) -> None:
        t0 = time.monotonic()
        try:
            status, _ = await self._get(w.url + "/health")
            ok = status == 200
        except _FAILED:
            ok = False
        if not ok:
            if self.watch is not None and self.watch.stalled_since(t0):
                log.info("health check of %s failed while the router stalled: not counted", w.url)
                return
            self.reg.mark_failed(w, self.failures)
            return
        self.reg.mark_ok(w)
        if self.poll_loads:
            await self.poll(w)

    async def poll(self, w: Worker) -> None:
        paths = ("/get_load", "/v1/loads") if w.wid in self._old_shape else ("/v1/loads", "/get_load")
        for path in paths:
            try:
                status, content = await self._get(w.url + path)
            except _FAILED:
                return
            if status != 200:
                continue
            try:
                parsed = parse_loads(orjson.loads(content))
            except orjson.JSONDecodeError:
                parsed = None
            if parsed is None:
                continue
            if path == "/get_load":
                self._old_shape.add(w.wid)
            w.polled_running, w.polled_waiting, w.polled_token_usage = parsed
            w.polled_at = time.monotonic()
            return
