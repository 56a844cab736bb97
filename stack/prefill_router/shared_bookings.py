"""Dispatch accounting shared by the replicas: each one's figures, and claims on a worker.

Per prefill worker, each replica publishes its own in-flight prefill work: queued tokens,
queued seconds, the requests whose prefill is not done, and its link counter
(:mod:`stack.prefill_router.shared_links`). A replica's view of a worker is its own
accounting plus the other live replicas' published figures.

An idle instance is never booked twice. Routing reads the others' figures with a booking
version per worker (one round trip), runs the policy, then *claims* the worker it chose: a
compare-and-set on that version that also writes this replica's new figures for the worker
(a second round trip). If another replica, or a concurrent request of this one (claims in
flight count in the local view), booked the same worker in between, the claim fails and
hands back a fresh view to choose again with. From the :data:`MAX_CLAIMS`-th attempt on, or
once the request's Redis deadline has passed, the choice is booked anyway.

Completions (prefill done, answer ended) are published by a flusher every ``flush_s``, only
for the workers whose figures changed. Publishing late only over-states a load, never hides
one.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time

from stack.pool import Worker, WorkerRegistry
from stack.prefill_router import shared_scripts as lua
from stack.prefill_router.shared_connection import SharedConnection
from stack.prefill_router.shared_links import SharedLinks
from stack.prefill_router.shared_view import Snapshot, parse_view, wkey

log = logging.getLogger("stack.router.shared")

#: claims of one request before its choice is booked regardless of the version
MAX_CLAIMS = 4

#: one worker's figures as published: tokens, seconds, running, link seconds booked (wall)
Figures = tuple[int, float, int, float]


class SharedBookings:
    """This replica's published figures, its claims, and the others' figures in its workers."""

    def __init__(
        self,
        conn: SharedConnection,
        registry: WorkerRegistry,
        links: SharedLinks,
        *,
        flush_s: float,
        metrics_registry=None,
    ) -> None:
        self.conn = conn
        self.reg = registry
        self.links = links
        self.flush_s = flush_s
        self._claim = conn.r.register_script(lua.CLAIM)
        self._publish = conn.r.register_script(lua.PUBLISH)
        self._pending: dict[str, list] = {}  # claims in flight: wkey -> [tokens, seconds, running]
        self._published: dict[str, Figures] = {}  # wkey -> figures last written
        self._conflicts = None
        if metrics_registry is not None:
            from prometheus_client import Counter

            self._conflicts = Counter(
                "smetric_shared_claim_conflicts",
                "claims retried because another booking won",
                registry=metrics_registry,
            )

    # -- figures ------------------------------------------------------------------------------
    def figures(self, w: Worker) -> Figures:
        """This replica's figures for ``w``, its claims in flight included."""
        p = self._pending.get(wkey(w))
        t, s, r = w.queued_tokens, w.queued_seconds, len(w.queued)
        if p:
            t, s, r = t + p[0], s + p[1], r + p[2]
        return t, s, r, self.links.booked(w)

    @staticmethod
    def _value(fig: Figures, seq: int) -> str:
        s = fig[1] if math.isfinite(fig[1]) else 0.0
        return f"{seq} {fig[0]} {s!r} {fig[2]} {fig[3]!r}"

    def apply(self, snap: Snapshot) -> None:
        """Set each local worker's view of the other replicas' figures, plus this replica's
        claims in flight (concurrent requests here must see them too)."""
        others, pending = snap.others, self._pending
        for w in self.reg.workers.values():
            k = wkey(w)
            t, s, r = others.get(k, (0, 0.0, 0))
            p = pending.get(k)
            if p:
                t, s, r = t + p[0], s + p[1], r + p[2]
            w.shared_tokens, w.shared_seconds, w.shared_running = t, s, r

    def reset(self) -> None:
        """Redis is down: the workers carry no other replica's figures."""
        for w in self.reg.workers.values():
            w.shared_tokens, w.shared_seconds, w.shared_running = 0, 0.0, 0

    def forget(self, k: str) -> None:
        """The figures last written for worker key ``k`` are unknown: written again if any."""
        self._published.pop(k, None)

    def forget_all(self) -> None:
        """Every figure is written again by the next flush (a resync)."""
        self._published.clear()

    # -- the routing path -----------------------------------------------------------------------
    async def claim(
        self,
        w: Worker,
        tokens: int,
        seconds: float,
        snap: Snapshot,
        attempt: int = 1,
        deadline: float | None = None,
    ) -> Snapshot | None:
        """Book ``w`` if nobody booked it since ``snap`` (unconditionally from the
        :data:`MAX_CLAIMS`-th attempt on, or once ``deadline`` (monotonic) has passed, so a
        slow Redis cannot hold a request for several round trips): None when booked (or Redis
        down), else a fresh snapshot (already applied) to choose again with. The caller must
        account the dispatch locally before its next await."""
        conn = self.conn
        force = attempt >= MAX_CLAIMS or (deadline is not None and time.monotonic() > deadline)
        if not conn.up:
            return None
        k = wkey(w)
        p = self._pending.setdefault(k, [0, 0.0, 0])
        p[0] += tokens
        p[1] += seconds
        p[2] += 1
        w.shared_tokens += tokens
        w.shared_seconds += seconds
        w.shared_running += 1
        try:
            seq = conn.next_seq()
            value = self._value(self.figures(w), seq)
            expected = -1 if force else snap.versions.get(k, 0)
            reply = await conn.call(self._claim(args=[conn.ns, conn.rid, k, expected, seq, value]))
        except Exception as e:  # noqa: BLE001
            conn.down("claim", e)
            return None
        finally:
            p[0] -= tokens
            p[1] -= seconds
            p[2] -= 1
            if p[2] <= 0:
                self._pending.pop(k, None)
            w.shared_tokens = max(0, w.shared_tokens - tokens)
            w.shared_seconds = max(0.0, w.shared_seconds - seconds)
            w.shared_running = max(0, w.shared_running - 1)
            # the claim may have written figures (even if cancelled): let the flusher rewrite them
            self._published.pop(k, None)
        conn.stats["claims"] += 1
        if int(reply[0]) == 1:
            return None
        conn.stats["conflicts"] += 1
        if self._conflicts is not None:
            self._conflicts.inc()
        fresh = parse_view(reply[1])
        conn.apply(fresh)
        return fresh

    # -- publication ----------------------------------------------------------------------------
    async def loop(self) -> None:
        """The flusher: publish what changed every ``flush_s`` while Redis is up."""
        while True:
            await asyncio.sleep(self.flush_s)
            if self.conn.up:
                try:
                    await self.flush()
                except Exception as e:  # noqa: BLE001
                    log.exception("shared state: publishing failed")
                    self.conn.down("flush", e)

    async def flush(self) -> None:
        """Publish the figures that changed since last written (and drop removed workers)."""
        conn = self.conn
        args: list = []
        current = {}
        for w in self.reg.workers.values():
            if w.role != "prefill":
                continue
            k = wkey(w)
            fig = self.figures(w)
            current[k] = fig
            if self._published.get(k) != fig:
                args.append(k)
                args.append(fig)
        gone = [k for k in self._published if k not in current]
        if not args and not gone:
            return
        seq = conn.next_seq()
        flat: list = [conn.ns, conn.rid, seq]
        for i in range(0, len(args), 2):
            flat += [args[i], self._value(args[i + 1], seq)]
        for k in gone:
            flat += [k, "-"]
        try:
            await conn.call(self._publish(args=flat))
        except Exception as e:  # noqa: BLE001
            conn.down("publish", e)
            return
        for i in range(0, len(args), 2):
            self._published[args[i]] = args[i + 1]
        for k in gone:
            self._published.pop(k, None)
