"""The live router's dispatch queue: :class:`LiveQueue` drives a :mod:`stack.dispatch`
dispatcher on the event loop.

With the ``immediate`` order (no queue; the router's default is ``deadline-defer``,
:data:`stack.dispatch.ROUTER_DISPATCH`, ``router.dispatch``) :meth:`LiveQueue.route` *is*
:meth:`PrefillRouter.route`: no entry, no future, no callback. Another order holds each
request as an :class:`~stack.dispatch.Entry` (size from :func:`~stack.dispatch.estimate_size`
with the router's cost model, deadline from its SLO) until the pump releases it; the
request then routes with the workers that were not ready excluded (the dispatcher's ready
mask), as the simulator's policy chooses among the ready instances only.

The pump runs on admission, whenever work leaves a worker (a booking's prefill_done or
release: the registry's ``on_work_left``), on membership and health changes, on the
dispatcher's ``next_timer`` and on a short safety tick while anything waits (polled
load reports change readiness too). It releases one entry at a time and waits for it to be
booked before the next, so each release sees the load the previous one added.

Router replicas (``router.redis_url``) with ``router.dispatch.replica_mode: claims`` (the
default there) release in one order across replicas: the pump publishes the rank of its
next release (:meth:`~stack.dispatch.Dispatcher.rank`) through the shared state and
releases only while fewer replicas rank before it than workers are ready
(:meth:`~stack.prefill_router.shared_state.SharedState.may_release`). Each exchange of
ranks (every ``redis_flush_s``) runs the pump again; a replica whose view is older than
that (nothing waited here a moment ago) reads it before it releases. A replica's waiting
requests stay with it (its clients are connected to it): nothing is handed over, so a
replica that dies takes only its own clients' requests, and its rank expires with its
heartbeat. In either replica mode the others' figures are read every ``redis_flush_s``
while requests wait: readiness needs them, and no routing reads them while nothing is
released (without that read, a worker freed by another replica's finished request stayed
busy in this replica's view).

Every admitted request ends in exactly one of: routed (then the ordinary path), an
:class:`Overloaded` answer (``queue_full`` at admission, ``max_queue_wait`` after waiting;
the API answers 503 with Retry-After, Anthropic paths 529), or, its client gone (the
waiting task cancelled, or ``Cancelled`` from the disconnect watch of :meth:`LiveQueue.route`),
removed from the queue. A request released at its admission (nothing waiting, a worker
ready) costs no wait and no disconnect watch.

With the dispatch key ``affinity`` (``router.dispatch.affinity``) a released request that
would be link-bound on the ready workers, while a worker that is not ready holds more of its
prefix, routes over every worker instead of the ready ones (the same test as the simulator's,
:func:`~stack.dispatch.bypass.unbind_at_release`, on the same view as ``bypass``).

With the dispatch key ``bypass`` (``router.dispatch.bypass``, :mod:`stack.dispatch.bypass`)
a link-bound request (its global-tier fetch beyond the best local hit takes longer than that
share of its compute) is not admitted: it goes straight to routing over every worker, as with
``immediate``, so its fetch starts now. The rule reads the routing step's own view (the
prefix index's local hits, the global tier's hit, the router's fetch bandwidth; the live
link backlog is 0 today); the global tier is asked only when the whole hashed prefix, were
it all in the global tier, could make the request link-bound (the rule is monotone in the
global hit). With no prefill worker at all, waiting
entries are released at once and the routing step answers ``no_worker`` as without a queue.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Awaitable, Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from stack.core.cost_model import CostModel
from stack.core.types import SLO, ClusterView, InstanceState, usable_hit
from stack.dispatch import MAX_QUEUE_WAIT, QUEUE_FULL, Dispatcher, Entry, Rejected, estimate_size
from stack.dispatch.bypass import Bypass, unbind_at_release
from stack.pool import Worker, WorkerRegistry
from stack.prefill_router.errors import Cancelled
from stack.prefill_router.features import Features
from stack.prefill_router.routing import PrefillRouter, Routed
from stack.prefill_router.tracing import RequestTrace, current
from stack.prefill_router.view import build_view

_WAIT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 16, 32, 64)

#: while entries wait, the pump runs at least this often (polled loads, missed events)
TICK_S = 0.25


class Overloaded(Exception):
    """The dispatch queue refused a request: ``reason`` is ``queue_full`` or ``max_queue_wait``."""

    def __init__(self, reason: str, waited_s: float, retry_after_s: int) -> None:
        what = "queue full" if reason == "queue_full" else f"waited {waited_s:.2f}s in the queue"
        super().__init__(f"router overloaded ({what}); retry later")
        self.reason = reason
        self.waited_s = waited_s
        self.retry_after_s = retry_after_s


class _Released:
    """What a released entry's future carries: the worker ids the routing step excludes,
    and whether the pump waits for this entry's booking (the gate)."""

    __slots__ = ("at", "exclude", "gated")

    def __init__(self, exclude: frozenset[int], gated: bool, at: float = 0.0) -> None:
        self.exclude = exclude
        self.gated = gated
        self.at = at  # when it was released (the queue's clock)


class DispatchMetrics:
    def __init__(self, disp: Dispatcher, r: CollectorRegistry) -> None:
        self.depth = Gauge(
            "smetric_dispatch_queue_depth", "requests waiting in the dispatch queue", registry=r
        )
        self.depth.set_function(lambda: disp.counters.depth)
        self.wait = Histogram(
            "smetric_dispatch_queue_wait_seconds",
            "time a request waited in the dispatch queue before it was released",
            buckets=_WAIT_BUCKETS,
            registry=r,
        )
        self.deferrals = Counter(
            "smetric_dispatch_deferrals",
            "queued requests put behind others because they could no longer meet their deadline",
            registry=r,
        )
        self.rejected = Counter(
            "smetric_dispatch_rejected", "requests the dispatch queue refused", ["reason"], registry=r
        )
        for reason in (QUEUE_FULL, MAX_QUEUE_WAIT):  # every reason is a series from the start
            self.rejected.labels(reason)
        self.cancelled = Counter(
            "smetric_dispatch_cancelled", "waiting requests whose client left", registry=r
        )
        self.bypassed = Counter(
            "smetric_dispatch_bypassed",
            "link-bound requests dispatched at once instead of queued (router.dispatch.bypass)",
            registry=r,
        )
        self.unbound = Counter(
            "smetric_dispatch_unbound",
            "released requests routed over every worker, not the ready ones, where those would "
            "fetch what another holds (router.dispatch.affinity)",
            registry=r,
        )
        self.gate = Histogram(
            "smetric_dispatch_gate_seconds",
            "from a request's release to its booking, while no other request is released (the gate)",
            buckets=_WAIT_BUCKETS,
            registry=r,
        )
        self._deferrals_seen = 0

    def sync_deferrals(self, n: int) -> None:
        if n > self._deferrals_seen:
            self.deferrals.inc(n - self._deferrals_seen)
            self._deferrals_seen = n


class LiveQueue:
    """The dispatch queue of one router (see the module docstring)."""

    def __init__(
        self,
        disp: Dispatcher,
        routing: PrefillRouter,
        registry: WorkerRegistry,
        cost: CostModel,
        slo: SLO,
        metrics_registry: CollectorRegistry,
        retry_after_s: int = 1,
        clock: Callable[[], float] = time.monotonic,
        tick_s: float = TICK_S,
        time_factor: float = 1.0,
    ) -> None:
        self.disp = disp
        self.routing = routing
        self.registry = registry
        self.cost = cost
        self.slo = slo
        self.retry_after_s = retry_after_s
        self.clock = clock
        self.tick_s = tick_s
        self.time_factor = time_factor  # wall seconds per second of the pool (router.time_factor)
        self.immediate = disp.immediate
        #: link-bound requests dispatched at admission (router.dispatch.bypass), or None
        self.bypass = disp.bypass
        #: released requests not held to the ready workers where that makes them link-bound
        #: (router.dispatch.affinity), or None
        self.affinity = disp.affinity
        self.metrics = DispatchMetrics(disp, metrics_registry)
        self.gate = 0  # released entries not yet booked (at most one)
        #: replica_mode claims: the shared state ranks this replica's releases among the others'
        self.claims = None
        #: router replicas: the shared state, whose reads of the others' figures (every
        #: redis_flush_s while requests wait) run the pump again
        self.shared = None
        shared = getattr(routing, "shared", None)
        mode = disp.replica_mode or ("claims" if shared is not None else "own")
        if shared is not None and not self.immediate:
            self.shared = shared
            shared.on_heads.append(self.poke)
            if mode == "claims":
                self.claims = shared
                shared.heads_on = True
        self._scheduled = False
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = math.inf
        if not self.immediate:
            registry.on_work_left.append(self._on_worker)
            registry.on_eject.append(self._on_worker)
            registry.on_readmit.append(self._on_worker)
            registry.on_add.append(self._on_worker)
            registry.on_remove.append(self._on_worker)

    @property
    def depth(self) -> int:
        return self.disp.counters.depth

    # ------------------------------------------------------------------ the request's side
    def route(
        self,
        f: Features,
        exclude_p: set[int],
        exclude_d: set[int],
        with_decode: bool,
        queued: bool = True,
        disconnected: Callable[[], Awaitable[None]] | None = None,
    ):
        """An awaitable of the :class:`Routed` request, as :meth:`PrefillRouter.route`; with a
        queue, once the request is released. Raises :class:`Overloaded` (and ``NoWorker``).
        ``queued=False`` (a retry after a worker failed) routes at once. ``disconnected``:
        resolves when the client leaves; a request that has to wait then gives up its place
        (raises :class:`~stack.prefill_router.errors.Cancelled`). A request released at
        admission (nothing waits, a worker is ready: the common case below the knee) does not
        watch for it."""
        if self.immediate or not queued:
            return self.routing.route(f, exclude_p, exclude_d, with_decode)
        return self._route(f, exclude_p, exclude_d, with_decode, disconnected)

    async def _route(
        self,
        f: Features,
        exclude_p: set[int],
        exclude_d: set[int],
        with_decode: bool,
        disconnected: Callable[[], Awaitable[None]] | None = None,
    ) -> Routed:
        if self.bypass is not None and await self._bypass_now(f, exclude_p):
            self.disp.bypassed(self.slo.ttft(f.prompt_tokens))
            self.metrics.bypassed.inc()
            return await self.routing.route(f, exclude_p, exclude_d, with_decode)
        rt = current()  # tracing off: None
        rel = await (self.wait(f, disconnected) if rt is None else self._traced_wait(f, disconnected, rt))
        try:
            ex = exclude_p | rel.exclude if rel.exclude else exclude_p
            if rel.exclude and self.affinity is not None and await self._unbind(f, exclude_p, rel.exclude):
                self.metrics.unbound.inc()
                ex = exclude_p  # routed over every worker (stack/dispatch/bypass.py)
            return await self.routing.route(f, ex, exclude_d, with_decode)
        finally:
            if rel.gated:
                self._ungate(rel)

    async def _bypass_now(self, f: Features, exclude_p: set[int]) -> bool:
        """Whether the bypass rule dispatches ``f`` at once (see the module docstring), on
        the view the routing step builds (no global tier or fetch bandwidth: never)."""
        got = await self._link_view(f, exclude_p, self.bypass, frozenset())
        return got is not None and self.bypass.on_view(got[0], f.prompt_tokens, self.cost)

    async def _unbind(self, f: Features, exclude_p: set[int], not_ready: frozenset[int]) -> bool:
        """The affinity rule at ``f``'s release (``not_ready``: the workers the ready mask
        left out): whether it routes over every worker instead of the ready ones
        (:func:`~stack.dispatch.bypass.unbind_at_release`, the simulator's test)."""
        got = await self._link_view(f, exclude_p, self.affinity, not_ready)
        if got is None:
            return False
        v, ws = got
        ready = [w.wid not in not_ready for w in ws]
        return unbind_at_release(self.affinity, v, ready, f.prompt_tokens, self.cost)

    async def _link_view(
        self, f: Features, exclude_p: set[int], rule: Bypass, not_ready: frozenset[int]
    ) -> tuple[ClusterView, list[Worker]] | None:
        """The routing step's view of ``f`` over the healthy prefill workers, for a link rule
        (``rule``): None where it cannot hold (no hashes, no fetch bandwidth, no worker), or
        where even a global tier holding the whole hashed prefix would not make ``f``
        link-bound on the workers not in ``not_ready`` (the rule grows with the global hit:
        the global tier is asked only past that test), or, with ``not_ready``, where none of
        those holds more of the prefix than the others."""
        r = self.routing
        if not f.hashes or not r.fetch_tps > 0:
            return None
        ws = [
            w
            for w in self.registry.workers.values()
            if w.role == "prefill" and w.healthy and w.wid not in exclude_p
        ]
        if not ws:
            return None  # the routing step answers no_worker
        hits = r.index.hits(f.hashes)
        L = f.prompt_tokens
        bs = r.block_size
        local = [usable_hit(hits.get(w.wid, 0) * bs, L) for w in ws]
        best = max((h for h, w in zip(local, ws) if w.wid not in not_ready), default=0)
        if not_ready and max(local) <= best:
            return None  # no worker left out holds more of the prefix: nothing to unbind
        g_max = usable_hit(len(f.hashes) * bs, L)
        now = self.clock()
        backlog = min((w.link_backlog(now) for w in ws if w.wid not in not_ready), default=0.0)
        if not rule.decide(g_max - best, L - g_max, L, r.fetch_tps, backlog, self.cost):
            return None
        gblocks = await r.global_tier.hit_blocks(f.hashes, f.tokens)
        v = build_view(
            time.monotonic(),  # as the routing step's view (only the hits are read here)
            ws,
            hits,
            gblocks,
            prompt_tokens=L,
            block_size=bs,
            fetch_tokens_per_s=r.fetch_tps,
            sec_per_token=self.cost.c_linear,
            decode=r.decode_cost,
            link_now=now,
        )
        return v, ws

    async def wait(self, f: Features, disconnected: Callable[[], Awaitable[None]] | None = None) -> _Released:
        """Admit the request and wait for its release. The caller must call :meth:`_ungate`
        after booking when the result is gated (:meth:`_route` does). ``disconnected``: see
        :meth:`route`; raises :class:`Cancelled` when it resolves first."""
        req = self.routing.request_of(f)
        now = self.clock()
        fut: asyncio.Future = asyncio.get_running_loop().create_future()
        e = Entry(fut, req, now, self.slo.ttft(f.prompt_tokens), estimate_size(self.cost, req))
        r = self.disp.admit(e, now)
        if r is not None:
            self._count_rejected(r)
            raise Overloaded(r.reason, r.waited_s, self.retry_after_s)
        self._pump()
        if fut.done():  # released at admission: no wait, nothing to watch
            return fut.result()
        try:
            if disconnected is None:
                return await fut
            return await self._unless_disconnected(fut, disconnected)
        except (asyncio.CancelledError, Cancelled):
            if self.disp.cancel(e):
                self.metrics.cancelled.inc()
                if self.claims is not None and self.disp.counters.depth == 0:
                    self.claims.set_head(None)
            elif fut.done() and not fut.cancelled() and fut.exception() is None and fut.result().gated:
                self._ungate(fut.result())  # released, but its task was cancelled before it could route
            raise

    async def _traced_wait(
        self, f: Features, disconnected: Callable[[], Awaitable[None]] | None, rt: RequestTrace
    ) -> _Released:
        """:meth:`wait`, recorded as the request's ``smetric.queue_wait`` span."""
        t = time.time_ns()
        outcome = "cancelled"
        try:
            rel = await self.wait(f, disconnected)
            outcome = "released"
            return rel
        except Overloaded as e:
            outcome = e.reason
            raise
        finally:
            rt.queue_wait(t, time.time_ns(), outcome)

    @staticmethod
    async def _unless_disconnected(fut: asyncio.Future, disconnected) -> _Released:
        """``fut``'s result, or :class:`Cancelled` when the client leaves first. An entry
        released when both happen at once is returned, so that it is served (and its gate
        opened) rather than lost."""
        watch = asyncio.ensure_future(disconnected())
        try:
            await asyncio.wait({fut, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watch.cancel()
        if fut.done():
            return fut.result()
        raise Cancelled()

    def _ungate(self, rel: _Released) -> None:
        self.gate -= 1
        self.metrics.gate.observe(max(0.0, self.clock() - rel.at))
        if self.claims is not None and self.gate == 0 and self.disp.counters.depth == 0:
            self.claims.set_head(None)  # booked, and nothing else waits: the rank leaves
        self.poke()

    # ------------------------------------------------------------------ the pump
    def _on_worker(self, w: Worker) -> None:
        if w.role == "prefill":
            self.poke()

    def poke(self) -> None:
        """Run the pump soon (coalesced); a no-op with nothing waiting."""
        if self._scheduled or self.disp.counters.depth == 0:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        self._scheduled = True
        loop.call_soon(self._pump)

    def _on_timer(self) -> None:
        self._timer = None
        self._timer_at = math.inf
        self._pump()

    def _pump(self) -> None:
        self._scheduled = False
        d = self.disp
        now = self.clock()
        for r in d.expire(now):
            self._reject(r)
        if d.counters.depth == 0:
            if self.claims is not None and self.gate == 0:
                self.claims.set_head(None)
            if self.shared is not None:
                self.shared.view_wanted = False
            self._disarm()
            return
        ws = [w for w in self.registry.workers.values() if w.role == "prefill" and w.healthy]
        if not ws:
            self._drain(now)  # no worker at all: the routing step answers no_worker
            return
        claims = self.claims
        while self.gate == 0 and d.counters.depth:
            states = self._states(now, ws)
            if claims is not None and not self._may_release(now, states):
                break
            e = d.pop(now, states)
            if e is None:
                break
            fut: asyncio.Future = e.handle
            if fut.done():  # its task was cancelled and has not run its handler yet
                continue
            mask = d.ready_mask(states)
            ex = (
                frozenset(s.index for s, ok in zip(states, mask, strict=True) if not ok)
                if mask
                else frozenset()
            )
            self.gate += 1
            self.metrics.wait.observe(now - e.arrival)
            fut.set_result(_Released(ex, True, now))
        self.metrics.sync_deferrals(d.counters.deferrals)
        if self.shared is not None:
            self.shared.view_wanted = d.counters.depth > 0
        if claims is not None and self.gate == 0:
            # (a release not yet booked keeps its rank published: the others wait for its
            # booking, whose figures the next exchange shows them, before they rank past it)
            self._publish_rank(now, ws)
        if d.counters.depth == 0:
            self._disarm()
            return
        t = min(d.next_timer(now, self._states(now, ws)), now + self.tick_s)
        self._arm(now, t)

    def _shared_key(self, key: tuple[int, float, float]) -> tuple[int, float, float]:
        """``key`` on the replicas' shared clock (wall seconds in the pool's time): each
        replica's monotonic clock has its own origin."""
        off = time.time() / self.time_factor - self.clock()
        return (key[0], key[1] + off, key[2] + off)

    def _may_release(self, now: float, states: list[InstanceState]) -> bool:
        """replica_mode claims: whether this replica's next release goes now (see the module
        docstring); False also when no worker is ready (the dispatcher would not release)."""
        d = self.disp
        start, mask = d.readiness.scan(states)
        if start is None:
            return False
        if not self.claims.fresh():  # a view older than redis_flush_s: read it first
            return False
        key = d.rank(now, start)
        if key is None:
            return False
        return self.claims.may_release(self._shared_key(key), sum(mask))

    def _publish_rank(self, now: float, ws: list[Worker]) -> None:
        """Tell the other replicas the rank of this replica's next release (None: none
        waits). With no worker ready, ranked at the earliest estimated start of any worker."""
        d = self.disp
        key = None
        if d.counters.depth:
            states = self._states(now, ws)
            start, _ = d.readiness.scan(states)
            if start is None:
                start = min((d.readiness.load(s) for s in states if s.healthy), default=0.0)
            key = d.rank(now, start)
        self.claims.set_head(None if key is None else self._shared_key(key))

    def _drain(self, now: float) -> None:
        """Release every waiting entry (no worker to be ready: each gets no_worker)."""
        d = self.disp
        free = [InstanceState(-1)]
        while (e := d.pop(now, free)) is not None:
            if not e.handle.done():
                self.metrics.wait.observe(now - e.arrival)
                e.handle.set_result(_Released(frozenset(), False))
        self.metrics.sync_deferrals(d.counters.deferrals)
        self._disarm()

    def _states(self, now: float, ws: list[Worker]) -> list[InstanceState]:
        """The instances as readiness sees them: the routing view's figures, except that a
        worker's queued seconds leave out what it has computed (:meth:`Worker.computed_seconds`),
        as the simulator's instances count their remaining work, not the requests whose
        answer has not returned yet; each worker's link backlog is the fetches booked on it
        (:meth:`Worker.link_backlog`)."""
        r = self.routing
        v = build_view(
            now,
            ws,
            {},
            0,
            prompt_tokens=0,
            block_size=r.block_size,
            fetch_tokens_per_s=r.fetch_tps,
            sec_per_token=self.cost.c_linear,
            decode=r.decode_cost,
            link_now=now,
        )
        wall = time.monotonic()
        for s, w in zip(v.instances, ws, strict=True):
            done = w.computed_seconds(wall, self.time_factor)
            if done > 0.0:
                s.queued_seconds = s.queued_seconds - done if s.queued_seconds > done else 0.0
        return v.instances

    def _arm(self, now: float, at: float) -> None:
        if at >= self._timer_at:
            return
        if self._timer is not None:
            self._timer.cancel()
        self._timer_at = at
        self._timer = asyncio.get_running_loop().call_later(max(0.0, at - now), self._on_timer)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._timer_at = math.inf

    def _reject(self, r: Rejected) -> None:
        self._count_rejected(r)
        fut: asyncio.Future = r.entry.handle
        if not fut.done():
            fut.set_exception(Overloaded(r.reason, r.waited_s, self.retry_after_s))

    def _count_rejected(self, r: Rejected) -> None:
        self.metrics.rejected.labels(r.reason).inc()

    def close(self) -> None:
        """Stop the timer (the router is stopping)."""
        self._disarm()


__all__ = ["LiveQueue", "Overloaded"]
