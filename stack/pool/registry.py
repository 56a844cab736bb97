"""The pool's membership, health marks and per-request accounting (booking: each worker
charged with a request's work until its prefill answers and its answer ends).

Callbacks (``on_add``, ``on_remove``, ``on_eject``, ``on_readmit``, and ``on_work_left``:
a prefill answered or a request ended, so a worker took on less) let the users of the
pool (the prefix index, the policy, the KV-event subscribers, metrics) follow membership
without the registry knowing any of them.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable

from stack.pool.booking import Booking
from stack.pool.worker import BookedLink, Ticket, Worker

log = logging.getLogger("stack.router.workers")

#: how workers share global-tier links (router.link): each its own, or one per host
LINK_SCOPES = ("worker", "host")


class WorkerRegistry:
    """All workers of one router, by id; ids are never reused."""

    def __init__(self, eject_cooldown_s: float = 5.0, link: str = "worker") -> None:
        """``link``: how workers share global-tier links (``router.link``): ``worker``, each
        its own (a NIC per GPU); ``host``, one per host, shared by the workers on it (a NIC
        per node, the simulator's ``--link shared``)."""
        if link not in LINK_SCOPES:
            raise ValueError(f"link must be one of {', '.join(LINK_SCOPES)}")
        self.eject_cooldown_s = eject_cooldown_s
        self.link_scope = link
        self._host_links: dict[str, BookedLink] = {}
        self._ids = itertools.count()
        self.workers: dict[int, Worker] = {}
        self._tickets = itertools.count(1)
        self.on_eject: list[Callable[[Worker], None]] = []
        self.on_readmit: list[Callable[[Worker], None]] = []
        self.on_remove: list[Callable[[Worker], None]] = []
        self.on_add: list[Callable[[Worker], None]] = []
        self.on_work_left: list[Callable[[Worker], None]] = []

    # -- membership ---------------------------------------------------------------------
    def add(
        self,
        role: str,
        url: str,
        bootstrap_port: int | None = None,
        kv_events: str | None = None,
        kv_topic: str = "kv",
        kv_replay: str | None = None,
    ) -> Worker:
        if role not in ("prefill", "decode"):
            raise ValueError("role must be prefill or decode")
        url = url.rstrip("/")
        if self.find(role, url) is not None:
            raise ValueError(f"{role} worker {url} is already registered")
        w = Worker(next(self._ids), role, url, bootstrap_port, kv_events, kv_topic, kv_replay)
        if self.link_scope == "host":
            w.link = self._host_links.setdefault(w.host, BookedLink())
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
        """A health check of ``w`` failed (``immediate``: eject it now): ejected after
        ``threshold`` failures in a row."""
        w.fails = threshold if immediate else w.fails + 1
        if w.healthy and w.fails >= threshold:
            self._eject(w)

    def call_failed(self, w: Worker, threshold: int) -> None:
        """A call to ``w`` failed on a fresh connection. Ejected after ``threshold`` failures in
        a row, of calls and health checks alike (a passing check or call ends the run), or of
        calls alone (a worker that passes its checks but fails every request). The last
        healthy worker of its role is never ejected by calls: its health checks alone decide,
        so a failure on the router's side cannot take the whole pool out."""
        w.fails += 1
        w.call_fails += 1
        if not w.healthy or max(w.fails, w.call_fails) < threshold:
            return
        if not self._another_healthy(w):
            log.info(
                "worker %s (%s): %d failed calls in a row, the last healthy one: left to its health checks",
                w.url,
                w.role,
                w.call_fails,
            )
            return
        self._eject(w)

    def call_ok(self, w: Worker) -> None:
        """A call to ``w`` succeeded: its runs of failures are over (no readmission: an
        ejected worker comes back through its health checks)."""
        if w.call_fails or w.fails:
            w.fails = w.call_fails = 0

    def _another_healthy(self, w: Worker) -> bool:
        return any(x.healthy and x.role == w.role and x is not w for x in self.workers.values())

    def _eject(self, w: Worker) -> None:
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
            w.call_fails = 0
            log.info("worker %s (%s) readmitted", w.url, w.role)
            for cb in self.on_readmit:
                cb(w)

    # -- accounting ---------------------------------------------------------------------
    def charge(self, w: Worker, tokens: int, seconds: float, prompt_tokens: int = 0) -> int:
        """Charge ``w`` with one request's work (``tokens`` new tokens and ``seconds`` of
        estimated prefill queued, ``prompt_tokens`` active, one more in flight); returns the
        ticket that :meth:`prefill_done` and :meth:`finished` discharge."""
        t = next(self._tickets)
        w.queued[t] = Ticket(tokens, seconds, time.monotonic(), prompt_tokens)
        w.queued_tokens += tokens
        w.active_tokens += prompt_tokens
        w.queued_seconds += seconds
        w.inflight += 1
        w.dispatched += 1
        w.mean_tokens = tokens if w.dispatched == 1 else 0.9 * w.mean_tokens + 0.1 * tokens
        return t

    def book(
        self,
        prefill: Worker,
        tokens: int,
        seconds: float,
        decode: Worker | None = None,
        prompt_tokens: int = 0,
    ) -> Booking:
        """Account one request on its prefill worker (``tokens`` new tokens, ``seconds`` of
        estimated prefill) and on its decode worker if any (a request in flight there)."""
        pt = self.charge(prefill, tokens, seconds, prompt_tokens)
        dt = self.charge(decode, 0, 0.0) if decode is not None else None
        return Booking(self, prefill, pt, decode, dt)

    def prefill_done(self, w: Worker, ticket: int, decoding: bool = False) -> None:
        """The request's prefill on ``w`` is done; ``decoding``: ``w`` decodes it too (PD
        colocation), so it stays on ``w`` as a running decode until :meth:`finished`."""
        tk = w.queued.pop(ticket, None)
        if tk is not None:
            if decoding:
                w.decoding[ticket] = tk.prompt_tokens or tk.tokens
            w.queued_tokens -= tk.tokens
            w.queued_seconds = max(0.0, w.queued_seconds - tk.seconds)
            w.active_tokens -= tk.prompt_tokens
            if not w.queued:
                w.queued_tokens = 0
                w.queued_seconds = 0.0
                w.active_tokens = 0
            for cb in self.on_work_left:
                cb(w)

    def finished(self, w: Worker, ticket: int) -> None:
        self.prefill_done(w, ticket)
        w.decoding.pop(ticket, None)
        w.inflight = max(0, w.inflight - 1)
        for cb in self.on_work_left:
            cb(w)

    def purge_stale(self, max_age_s: float) -> None:
        now = time.monotonic()
        for w in self.workers.values():
            for t, tk in list(w.queued.items()):
                if now - tk.t0 > max_age_s:
                    self.prefill_done(w, t)
