"""The live router's dispatch queue: :class:`LiveQueue` drives a :mod:`stack.dispatch`
dispatcher on the event loop. It admits, waits and pumps; routing builds every view and
decides the link rules (:class:`~stack.prefill_router.routing.PrefillRouter`).

With the ``immediate`` order :meth:`LiveQueue.route` *is* :meth:`PrefillRouter.route`: no
entry, no future. Another order (the router's default is ``deadline-defer``,
:data:`stack.dispatch.ROUTER_DISPATCH`) holds each request as an :class:`~stack.dispatch.Entry`
(size from :func:`~stack.dispatch.estimate_size`, deadline from its SLO) until the pump
releases it; it then routes with the workers that were not ready excluded (the ready mask),
as the simulator's policy chooses among the ready instances only. The request's
:class:`~stack.prefill_router.routing.Lookup` is taken at admission and routed with: the
prefix index and the global tier are asked at most once per request. ``bypass``: a
link-bound request routes at once, unqueued; ``affinity``: a released one that would be
link-bound on the ready workers routes over every worker (:mod:`stack.dispatch.bypass`).

The pump runs on admission, whenever work leaves a worker (the registry's ``on_work_left``),
on membership and health changes, on the dispatcher's ``next_timer`` and on a short safety
tick while anything waits. It releases one entry at a time and waits for its booking (the
gate), so each release sees the load the previous one added. Router replicas:
:mod:`stack.prefill_router.queue_replicas`.

Every admitted request ends in exactly one of: routed, an :class:`Overloaded` answer
(``queue_full`` at admission, ``max_queue_wait`` after waiting: 503 with Retry-After,
Anthropic paths 529), or, its client gone, removed from the queue. With no prefill worker at
all, waiting entries are released at once and routing answers ``no_worker``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from prometheus_client import CollectorRegistry

from stack.core.cost_model import CostModel
from stack.core.types import SLO, InstanceState
from stack.dispatch import MAX_QUEUE_WAIT, Dispatcher, Entry, Rejected, estimate_size
from stack.pool import Worker, WorkerRegistry
from stack.prefill_router.errors import Cancelled, Overloaded
from stack.prefill_router.features import Features
from stack.prefill_router.queue_metrics import DispatchMetrics
from stack.prefill_router.queue_replicas import ClaimedRelease, Replicas
from stack.prefill_router.routing import PrefillRouter, Routed
from stack.prefill_router.shared_refusals import SharedRefusals
from stack.prefill_router.tracing import current
from stack.prefill_router.wakeup import Wakeup

#: while entries wait, the pump runs at least this often (polled loads, missed events)
TICK_S = 0.25


@dataclass(slots=True)
class _Released:
    """What a released entry's future carries: the worker ids the routing step excludes,
    whether the pump waits for this entry's booking (the gate), and when (the queue's clock)."""

    exclude: frozenset[int]
    gated: bool
    at: float = 0.0


class LiveQueue:
    """The dispatch queue of one router (see the module docstring). ``replicas``: the router
    replicas' shared state (None: one router)."""

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
        replicas: Replicas | None = None,
        refusals: SharedRefusals | None = None,
    ) -> None:
        self.disp = disp
        self.routing = routing
        self.registry = registry
        self.cost = cost
        self.slo = slo
        self.retry_after_s = retry_after_s
        self.clock = clock
        self.tick_s = tick_s
        self.time_factor = time_factor
        self.immediate = disp.immediate
        self.bypass = disp.bypass  # router.dispatch.bypass, or None
        self.affinity = disp.affinity  # router.dispatch.affinity, or None
        self.metrics = DispatchMetrics(disp, metrics_registry)
        self.gate = 0  # released entries not yet booked (at most one)
        #: router replicas (None: one router, or the immediate order)
        self.replicas = None if self.immediate else replicas
        #: router replicas: the memory of requests refused for their wait, in Redis (None:
        #: one router, or a queue that refuses none for their wait)
        self.refusals = None if self.immediate or not disp.bounds_waits else refusals
        #: replica_mode claims: this replica's place in the one release order
        self.claims: ClaimedRelease | None = None
        if self.replicas is not None:
            claims = (disp.replica_mode or "claims") == "claims"
            if claims:
                self.claims = ClaimedRelease(self.replicas, disp, clock, time_factor)
            self.replicas.subscribe(self.poke, claims)
        self.wakeup = Wakeup(self._pump)  # the pump runs soon, or at the dispatcher's next timer
        if not self.immediate:
            for hooks in (registry.on_work_left, registry.on_eject, registry.on_readmit, registry.on_add):
                hooks.append(self._on_worker)
            registry.on_remove.append(self._on_worker)

    @property
    def depth(self) -> int:
        return self.disp.counters.depth

    # ------------------------------------------------------------------ the request's side
    async def route(
        self,
        f: Features,
        exclude_p: set[int],
        exclude_d: set[int],
        with_decode: bool,
        queued: bool = True,
        disconnected: Callable[[], Awaitable[None]] | None = None,
        waited_s: float = 0.0,
    ) -> Routed:
        """The :class:`Routed` request, as :meth:`PrefillRouter.route`; with a queue, once
        released. Raises :class:`Overloaded` (and ``NoWorker``). ``queued=False`` (a retry
        after a worker failed) routes at once. ``disconnected`` resolves when the client
        leaves: a waiting request then gives up its place (raises ``Cancelled``); one released
        at admission (the common case below the knee) does not watch for it. ``waited_s``: the
        wall seconds since the router admitted the request (its body read, its features
        derived, perhaps in the feature pool): the queue counts its deadline and its wait bound
        from then, so the bound holds end to end."""
        if self.immediate or not queued:
            return await self.routing.route(f, exclude_p, exclude_d, with_decode)
        r = self.routing
        lk = r.lookup(f)  # routed with: asked once
        if self.bypass is not None and await r.bypasses(f, lk, self.bypass, exclude_p):
            self.disp.bypassed(self.slo.ttft(f.prompt_tokens))
            self.metrics.bypassed.inc()
            return await r.route(f, exclude_p, exclude_d, with_decode, lk)
        rel = await self.wait(f, disconnected, waited_s)
        try:
            ex = exclude_p | rel.exclude if rel.exclude else exclude_p
            if rel.exclude and self.affinity is not None:
                if await r.unbinds(f, lk, self.affinity, exclude_p, rel.exclude):
                    self.metrics.unbound.inc()
                    ex = exclude_p  # routed over every worker (stack/dispatch/bypass.py)
            return await r.route(f, ex, exclude_d, with_decode, lk)
        finally:
            if rel.gated:
                self._ungate(rel)

    async def wait(
        self, f: Features, disconnected: Callable[[], Awaitable[None]] | None = None, waited_s: float = 0.0
    ) -> _Released:
        """Admit the request and wait for its release, recorded in the request's trace (its
        ``smetric.queue_wait`` span). The caller must call :meth:`_ungate` after booking when
        the result is gated (:meth:`route` does). ``disconnected``: see :meth:`route`; raises
        :class:`Cancelled` when it resolves first."""
        rt = current()
        t = time.time_ns()
        outcome = "cancelled"
        try:
            rel = await self._admitted(f, disconnected, waited_s)
            outcome = "released"
            return rel
        except Overloaded as e:
            outcome = e.reason
            raise
        finally:
            rt.queue_wait(t, time.time_ns(), outcome)

    async def _admitted(
        self, f: Features, disconnected: Callable[[], Awaitable[None]] | None, waited_s: float = 0.0
    ) -> _Released:
        """The request admitted, once released; it arrived ``waited_s`` wall seconds ago. Those
        seconds are the router's own work (reading, parsing, the feature pool), which runs in
        real time whatever the pool's time factor (``router.time_factor`` speeds up only the
        emulated pool), so they count one for one on the queue's clock."""
        req = self.routing.request_of(f)
        now = self.clock()
        arrival = now - waited_s
        fut: asyncio.Future = asyncio.get_running_loop().create_future()
        # the prompt's fingerprint (its length and last block hash), as the simulator's: how
        # the dispatcher knows the retry of a request it refused
        key = (f.prompt_tokens, f.hashes[-1]) if f.hashes else None
        e = Entry(fut, req, arrival, self.slo.ttft(f.prompt_tokens), estimate_size(self.cost, req), key=key)
        if key is not None and self.refusals is not None:
            e.readmitted = await self._readmits(key, now)
        r = self.disp.admit(e, now)
        if r is not None:
            if r.entry is not e:  # a queued request worth less was shed for this one
                self._reject(r)
            else:
                self.metrics.rejected.labels(r.reason).inc()
                raise Overloaded(r.reason, r.waited_s, self.retry_after())
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
                    self.claims.withdraw()
            elif fut.done() and not fut.cancelled() and fut.exception() is None and fut.result().gated:
                self._ungate(fut.result())  # released, but its task was cancelled before it could route
            raise

    async def _readmits(self, key, now: float) -> bool:
        """Whether any router replica refused a request with fingerprint ``key`` for its wait
        within the window (Redis decides; this replica's own memory while Redis is down). The
        replica's own copy of that refusal is used up either way, to stay in step."""
        shared = await self.refusals.readmits(key)
        mine = self.disp.refusals.readmits(key, now)
        return mine if shared is None else shared

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
            self.claims.withdraw()  # booked, and nothing else waits: the rank leaves
        self.poke()

    # ------------------------------------------------------------------ the pump
    def _on_worker(self, w: Worker) -> None:
        if w.role == "prefill":
            self.poke()

    def poke(self) -> None:
        """Run the pump soon (coalesced); a no-op with nothing waiting."""
        if self.disp.counters.depth:
            self.wakeup.soon()

    def _pump(self) -> None:
        d = self.disp
        now = self.clock()
        for r in d.expire(now):
            self._reject(r)
        for e in d.take_overdue():  # a retry at its bound: routed at once, over every worker
            if not e.handle.done():
                self.metrics.wait.observe(now - e.arrival)
                self.metrics.overdue.inc()
                e.handle.set_result(_Released(frozenset(), False, now))
        if d.counters.depth == 0:
            if self.claims is not None and self.gate == 0:
                self.claims.withdraw()
            if self.replicas is not None:
                self.replicas.want_view(False)
            self.wakeup.disarm()
            return
        ws = self.routing.candidates()
        if not ws:
            self._drain(now)  # no worker at all: the routing step answers no_worker
            return
        self._release(now, ws)
        self.metrics.sync_deferrals(d.counters.deferrals)
        if self.replicas is not None:
            self.replicas.want_view(d.counters.depth > 0)
        states = self.routing.load_states(now, ws)
        if self.claims is not None and self.gate == 0:
            # (a release not yet booked keeps its rank published: the others wait for its
            # booking, whose figures the next exchange shows them, before they rank past it)
            self.claims.publish(now, states)
        if d.counters.depth == 0:
            self.wakeup.disarm()
            return
        self.wakeup.at(now, min(d.next_timer(now, states), now + self.tick_s))

    def _release(self, now: float, ws: list[Worker]) -> None:
        """Release the dispatcher's next entry while the gate is open (and, with claims, while
        this replica's rank lets it), its future carrying the workers not ready."""
        d = self.disp
        while self.gate == 0 and d.counters.depth:
            states = self.routing.load_states(now, ws)
            if self.claims is not None and not self.claims.may_release(now, states):
                break
            e = d.pop(now, states)
            if e is None:
                break
            fut: asyncio.Future = e.handle
            if fut.done():  # its task was cancelled and has not run its handler yet
                continue
            mask = d.ready_mask(states)
            not_ready = frozenset(s.index for s, ok in zip(states, mask or ()) if not ok)
            self.gate += 1
            self.metrics.wait.observe(now - e.arrival)
            fut.set_result(_Released(not_ready, True, now))

    def _drain(self, now: float) -> None:
        """Release every waiting entry (no worker to be ready: each gets no_worker)."""
        d = self.disp
        free = [InstanceState(-1)]
        while (e := d.pop(now, free)) is not None:
            if not e.handle.done():
                self.metrics.wait.observe(now - e.arrival)
                e.handle.set_result(_Released(frozenset(), False))
        self.metrics.sync_deferrals(d.counters.deferrals)
        self.wakeup.disarm()

    def retry_after(self) -> int:
        """``Retry-After`` of an overload answer: the queue's drain estimate (the prefill
        seconds queued over the prefill workers, in wall seconds), at least
        ``router.retry_after_s`` and at most 60 s (:meth:`Dispatcher.retry_after`)."""
        return self.disp.retry_after(len(self.routing.candidates()), self.retry_after_s, self.time_factor)

    def _reject(self, r: Rejected) -> None:
        self.metrics.rejected.labels(r.reason).inc()
        if r.reason == MAX_QUEUE_WAIT and r.entry.key is not None and self.refusals is not None:
            self.refusals.refused(r.entry.key)  # its retry may reach another replica
        fut: asyncio.Future = r.entry.handle
        if not fut.done():
            fut.set_exception(Overloaded(r.reason, r.waited_s, self.retry_after()))

    def close(self) -> None:
        """Stop the timer (the router is stopping)."""
        self.wakeup.disarm()


__all__ = ["LiveQueue", "Overloaded"]  # Overloaded: stack.prefill_router.errors
