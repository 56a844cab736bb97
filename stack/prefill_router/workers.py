"""Worker registry, load accounting and health checks.

Each worker (prefill or decode) gets a stable integer id (never reused), which is its
index in the policies' :class:`~stack.prefill_router.types.ClusterView` and its bit in the
prefix index.

Load is the router's own dispatch accounting (prefill work queued on the worker, in new
tokens and in estimated seconds, until the worker's prefill answer returns; requests in
flight until their answer ends), reconciled with the worker's own numbers polled from
``/v1/loads`` (SGLang: ``{"loads": [{"num_running_reqs", "num_waiting_reqs",
"token_usage", ...} per dp rank]}``; older versions answer ``{"load": N}``): the polled
counts are floors (other routers may feed the same worker), and waiting requests the
router does not know of are charged at the mean size of its own dispatches.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import httpx
import orjson

log = logging.getLogger("stack.router.workers")


@dataclass(slots=True)
class _Ticket:
    tokens: int
    seconds: float
    t0: float


@dataclass(slots=True)
class Worker:
    wid: int
    role: str  # "prefill" | "decode"
    url: str
    bootstrap_port: int | None = None
    kv_events: str | None = None
    kv_topic: str = "kv"
    healthy: bool = True
    fails: int = 0
    ejected_at: float = 0.0
    # own accounting
    queued: dict[int, _Ticket] = field(default_factory=dict)  # prefill not yet done
    queued_tokens: int = 0
    queued_seconds: float = 0.0
    inflight: int = 0  # requests whose answer has not ended
    dispatched: int = 0
    mean_tokens: float = 0.0
    # polled from /v1/loads
    polled_running: int = 0
    polled_waiting: int = 0
    polled_token_usage: float = 0.0
    polled_at: float = 0.0
    # the other router replicas' accounting on this worker (shared state; 0 without Redis)
    shared_tokens: int = 0
    shared_seconds: float = 0.0
    shared_running: int = 0

    @property
    def host(self) -> str:
        return urlsplit(self.url).hostname or "127.0.0.1"

    def view_running(self, fresh_s: float, now: float) -> int:
        """Requests on the worker: for prefill, those whose prefill is not done; for decode,
        those whose answer has not ended. The polled count is a floor."""
        own = (len(self.queued) + self.shared_running) if self.role == "prefill" else self.inflight
        if now - self.polled_at <= fresh_s:
            return max(own, self.polled_running + self.polled_waiting)
        return own

    def view_queued(self, fresh_s: float, now: float, sec_per_token: float) -> tuple[int, float]:
        """(queued tokens, queued seconds) reconciled with the polled waiting count."""
        qt, qs = self.queued_tokens + self.shared_tokens, self.queued_seconds + self.shared_seconds
        if now - self.polled_at <= fresh_s:
            unknown = self.polled_waiting - len(self.queued) - self.shared_running
            if unknown > 0 and self.mean_tokens > 0:
                extra = unknown * self.mean_tokens
                qt += int(extra)
                qs += extra * sec_per_token
        return qt, qs

    def info(self) -> dict:
        return {
            "id": self.wid,
            "role": self.role,
            "url": self.url,
            "bootstrap_port": self.bootstrap_port,
            "kv_events": self.kv_events,
            "healthy": self.healthy,
            "queued_tokens": self.queued_tokens,
            "queued_seconds": round(self.queued_seconds, 6),
            "inflight": self.inflight,
            "dispatched": self.dispatched,
            "polled": {
                "running": self.polled_running,
                "waiting": self.polled_waiting,
                "token_usage": self.polled_token_usage,
            },
        }


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


class WorkerRegistry:
    def __init__(self, eject_cooldown_s: float = 5.0) -> None:
        self.eject_cooldown_s = eject_cooldown_s
        self._ids = itertools.count()
        self.workers: dict[int, Worker] = {}
        self._tickets = itertools.count(1)
        self.on_eject: list[Callable[[Worker], None]] = []
        self.on_readmit: list[Callable[[Worker], None]] = []
        self.on_remove: list[Callable[[Worker], None]] = []
        self.on_add: list[Callable[[Worker], None]] = []

    # -- membership ---------------------------------------------------------------------
    def add(
        self,
        role: str,
        url: str,
        bootstrap_port: int | None = None,
        kv_events: str | None = None,
        kv_topic: str = "kv",
    ) -> Worker:
        if role not in ("prefill", "decode"):
            raise ValueError("role must be prefill or decode")
        url = url.rstrip("/")
        if self.find(role, url) is not None:
            raise ValueError(f"{role} worker {url} is already registered")
        w = Worker(next(self._ids), role, url, bootstrap_port, kv_events, kv_topic)
        self.workers[w.wid] = w
        for cb in self.on_add:
            cb(w)
        return w

    def remove(self, wid: int) -> Worker | None:
        w = self.workers.pop(wid, None)
        if w is not None:
            for cb in self.on_remove:
                cb(w)
        return w

    def find(self, role: str, url: str) -> Worker | None:
        url = url.rstrip("/")
        for w in self.workers.values():
            if w.role == role and w.url == url:
                return w
        return None

    def role(self, role: str, healthy_only: bool = False) -> list[Worker]:
        return [w for w in self.workers.values() if w.role == role and (w.healthy or not healthy_only)]

    # -- health -------------------------------------------------------------------------
    def mark_failed(self, w: Worker, threshold: int, immediate: bool = False) -> None:
        w.fails = threshold if immediate else w.fails + 1
        if w.healthy and w.fails >= threshold:
            w.healthy = False
            w.ejected_at = time.monotonic()
            log.warning("worker %s (%s) ejected", w.url, w.role)
            for cb in self.on_eject:
                cb(w)

    def mark_ok(self, w: Worker) -> None:
        w.fails = 0
        if (
            not w.healthy
            and w.wid in self.workers
            and time.monotonic() - w.ejected_at >= self.eject_cooldown_s
        ):
            w.healthy = True
            log.info("worker %s (%s) readmitted", w.url, w.role)
            for cb in self.on_readmit:
                cb(w)

    # -- accounting ---------------------------------------------------------------------
    def dispatch(self, w: Worker, tokens: int, seconds: float) -> int:
        t = next(self._tickets)
        w.queued[t] = _Ticket(tokens, seconds, time.monotonic())
        w.queued_tokens += tokens
        w.queued_seconds += seconds
        w.inflight += 1
        w.dispatched += 1
        w.mean_tokens = tokens if w.dispatched == 1 else 0.9 * w.mean_tokens + 0.1 * tokens
        return t

    def prefill_done(self, w: Worker, ticket: int) -> None:
        tk = w.queued.pop(ticket, None)
        if tk is not None:
            w.queued_tokens -= tk.tokens
            w.queued_seconds = max(0.0, w.queued_seconds - tk.seconds)
            if not w.queued:
                w.queued_tokens = 0
                w.queued_seconds = 0.0

    def finished(self, w: Worker, ticket: int) -> None:
        self.prefill_done(w, ticket)
        w.inflight = max(0, w.inflight - 1)

    def purge_stale(self, max_age_s: float) -> None:
        now = time.monotonic()
        for w in self.workers.values():
            for t, tk in list(w.queued.items()):
                if now - tk.t0 > max_age_s:
                    self.prefill_done(w, t)


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
