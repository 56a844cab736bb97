"""The dispatcher: a queue between the routing policy and the workers.

A policy says *where* a request goes; the dispatcher says *when* and *which next*. It is
pure (no I/O, no clock, no asyncio: time is passed in) so the simulator and the live router
drive the very same object. One cycle of a driver::

    d = DispatchSpec.parse("deadline-defer:age_k=5").build()   # stack/dispatch/spec.py
    # a request comes in
    r = d.admit(Entry(handle, req, now, slo.ttft(L), estimate_size(cost, req)), now)
    if r is not None:               # a bound refused it: answer it (503 / 529), never drop
        answer_overload(r)
    # whenever something changed (admission, a prefill or fetch completed, a timer fired)
    for r in d.expire(now):          # waited past its bound (max_wait_k x SLO, max_queue_wait_s)
        answer_overload(r)
    while (e := d.pop(now, states)) is not None:
        mask = d.ready_mask(states)  # the policy chooses among the ready instances only
        decision = policy.choose(e.request, view_with(mask))
        send(e.handle, decision)      # and update states[decision.instance]
    wake_at = d.next_timer(now, states)   # call again then, absent other events

``states`` are the instances as :class:`~stack.core.types.InstanceState`
(queued seconds, running requests, fetch backlog, health): what both drivers already
build for the policies. With the ``immediate`` order (the simulator's default) nothing is held:
:meth:`pop` hands back the admitted request at once, whatever the instances' load, and
:meth:`ready_mask` returns ``None`` (the whole cluster).
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from stack.core.types import InstanceState
from stack.dispatch.bypass import Bypass
from stack.dispatch.entry import MAX_QUEUE_WAIT, QUEUE_FULL, Entry, Rejected, State
from stack.dispatch.orders import Order
from stack.dispatch.readiness import Readiness
from stack.dispatch.refusals import RETRY_AFTER_MAX_S, Refusals


def worth(e: Entry, now: float) -> tuple[int, int, float]:
    """What ``e`` is worth keeping when the queue is full (smaller: shed first): one that
    can no longer meet its SLO (``now + size_s`` past its deadline even on an idle instance)
    before one that can; then a first turn before a follow-up (an agent mid-session, its KV
    cached somewhere); then the latest arrival first (the older ones have waited longer)."""
    return (0 if now + e.size_s > e.arrival + e.slo_s else 1, 0 if e.request.turn <= 1 else 1, -e.arrival)


@dataclass(slots=True)
class Counters:
    """What a driver exports (the live router's /metrics): ``depth`` now and its maximum,
    admissions, releases, rejections by reason, deferrals (entries put behind others
    because they could no longer meet their deadline), ``aged`` (deferrals that ran out),
    and the waits of released entries (sum, max)."""

    depth: int = 0
    max_depth: int = 0
    admitted: int = 0
    released: int = 0
    rejected_queue_full: int = 0
    #: of those, queued entries shed for a newcomer worth more (:func:`worth`)
    shed: int = 0
    rejected_max_wait: int = 0
    cancelled: int = 0
    deferrals: int = 0
    aged: int = 0
    #: admitted requests the bypass rule dispatched at once (:mod:`stack.dispatch.bypass`)
    bypassed: int = 0
    wait_sum_s: float = 0.0
    wait_max_s: float = 0.0
    #: estimated prefill seconds (``Entry.size_s``) of the entries queued now
    queued_size_s: float = 0.0
    #: retries of requests refused for their wait, released at their bound instead of refused
    overdue: int = 0

    @property
    def rejected(self) -> int:
        return self.rejected_queue_full + self.rejected_max_wait


class Dispatcher:
    """Holds admitted entries under ``order``; see the module docstring for the cycle.

    ``max_queue``: at most this many entries held. An admission beyond it is refused with
    ``queue_full``, unless a queued entry is worth less (:func:`worth`): that one is shed
    (refused with ``queue_full``) and the newcomer admitted. An entry's wait is bounded by ``max_wait_k`` times its own TTFT SLO and
    by ``max_queue_wait_s``, whichever comes first: past its bound :meth:`expire` rejects it
    with ``max_queue_wait``. All ``None`` by default (unbounded).

    A request is refused for its wait once, not again: the fingerprint (``Entry.key``) of an
    entry refused with ``max_queue_wait`` is remembered for a while
    (:data:`~stack.dispatch.refusals.READMIT_WINDOW_S`), and the request that comes back with
    it (its client's retry, after the Retry-After) is marked ``readmitted``. That memory is
    :attr:`refusals` (:mod:`stack.dispatch.refusals`); router replicas share one, as a retry
    seldom comes back to the replica that refused it. A readmitted entry still waiting at its
    bound leaves the queue there anyway: :meth:`expire` hands it to :meth:`take_overdue`, and
    the driver routes it at once over every instance. The official SDKs retry an overload
    answer twice, so refusing the same request three times fails its agent's turn; refusing it
    once is the back-off, and its retry gets the wait the bound promises. The request carries
    no id: a retry is known by its prompt.
    """

    def __init__(
        self,
        order: Order,
        readiness: Readiness,
        max_queue: int | None = None,
        max_queue_wait_s: float | None = None,
        replica_mode: str | None = None,
        bypass: Bypass | None = None,
        affinity: Bypass | None = None,
        max_wait_k: float | None = None,
        refusals: Refusals | None = None,
    ) -> None:
        self.order = order
        #: link-bound requests dispatched at once (the drivers ask it at admission), or None
        self.bypass = bypass
        #: released requests not held to the ready instances when that makes them link-bound
        #: (the drivers ask :func:`~stack.dispatch.bypass.unbind_at_release` at a release), or None
        self.affinity = affinity
        #: how router replicas share this queue (``replica_mode``), None: the driver's default
        self.replica_mode = replica_mode
        self.readiness = readiness
        self.readiness.check()
        if max_queue is not None and max_queue < 0:
            raise ValueError("dispatch: max_queue must be >= 0")
        if max_queue_wait_s is not None and not max_queue_wait_s >= 0:
            raise ValueError("dispatch: max_queue_wait_s must be >= 0")
        if max_wait_k is not None and not max_wait_k > 0:
            raise ValueError("dispatch: max_wait_k must be > 0")
        bounded = max_queue is not None or max_queue_wait_s is not None or max_wait_k is not None
        if order.immediate and bounded:
            raise ValueError(
                "dispatch: the immediate order holds no queue: max_queue / max_queue_wait_s / "
                "max_wait_k need another order"
            )
        self.max_queue = max_queue
        self.max_queue_wait_s = max_queue_wait_s
        self.max_wait_k = max_wait_k
        self.immediate = order.immediate
        self.name = order.name
        self.counters = Counters()
        self._seq = 0
        #: queued entries by when their wait bound runs out (lazy), when a bound is set
        self._expiry: list[tuple[float, int, Entry]] = []
        self._pending: deque[Entry] = deque()  # immediate: admitted, not yet popped
        #: the admitted entries, with max_queue (pruned of the gone ones when it is reached)
        self._held: list[Entry] = []
        #: (states, mask) of the last pop's readiness pass, for ready_mask
        self._mask_of: tuple[Sequence[InstanceState], list[bool]] | None = None
        #: the fingerprints of requests refused for their wait, to know their retries
        #: (router replicas share one: :mod:`stack.dispatch.refusals`)
        self.refusals = refusals if refusals is not None else Refusals()
        #: readmitted entries released at their bound, for the driver (take_overdue)
        self._overdue: list[Entry] = []

    # ------------------------------------------------------------------ admission
    def admit(self, e: Entry, now: float) -> Rejected | None:
        """Take ``e`` into the queue, or refuse it (``queue_full``). At ``max_queue``, the
        entry worth least (:func:`worth`), ``e`` or a queued one, is refused: the refusal
        returned may be another entry's (the driver answers its request)."""
        c = self.counters
        e.seq = self._seq
        self._seq += 1
        shed = None
        if self.max_queue is not None:
            if c.depth >= self.max_queue:
                victim = self._least_worth(now)
                if victim is None or worth(e, now) <= worth(victim, now):
                    e.state = State.REJECTED
                    c.rejected_queue_full += 1
                    return Rejected(e, QUEUE_FULL, 0.0)
                victim.state = State.REJECTED
                c.depth -= 1
                c.queued_size_s -= victim.size_s
                c.rejected_queue_full += 1
                c.shed += 1
                shed = Rejected(victim, QUEUE_FULL, now - victim.arrival)
            self._held.append(e)
        if e.key is not None and not e.readmitted and self.refusals.readmits(e.key, now):
            e.readmitted = True
        e.state = State.QUEUED
        c.admitted += 1
        c.depth += 1
        c.queued_size_s += e.size_s
        if c.depth > c.max_depth:
            c.max_depth = c.depth
        if self.immediate:
            self._pending.append(e)
            return None
        at = self.wait_bound(e)
        if at != math.inf:
            heapq.heappush(self._expiry, (at, e.seq, e))
        self.readiness.observe(e.slo_s)  # an adaptive threshold follows the traffic's SLOs
        self.order.push(e, now)
        return shed

    def _least_worth(self, now: float) -> Entry | None:
        """The queued entry worth least (:func:`worth`), the gone ones pruned."""
        held = self._held = [x for x in self._held if x.state is State.QUEUED]
        return min(held, key=lambda x: worth(x, now), default=None)

    def bypassed(self, slo_s: float) -> None:
        """A request the :attr:`bypass` rule dispatched at once instead of admitting it:
        counted, and its SLO taken into an adaptive threshold's window (the traffic's)."""
        self.counters.bypassed += 1
        self.readiness.observe(slo_s)

    @property
    def bounds_waits(self) -> bool:
        """Whether this queue refuses requests for their wait (``max_wait_k`` or
        ``max_queue_wait_s`` set): only then has it refusals to remember."""
        return self.max_wait_k is not None or self.max_queue_wait_s is not None

    def wait_bound(self, e: Entry) -> float:
        """When ``e`` must have left the queue: ``arrival + min(max_wait_k x slo_s,
        max_queue_wait_s)`` (``inf``: unbounded)."""
        lim = math.inf
        if self.max_wait_k is not None:
            lim = self.max_wait_k * e.slo_s
        if self.max_queue_wait_s is not None and self.max_queue_wait_s < lim:
            lim = self.max_queue_wait_s
        return e.arrival + lim

    def expire(self, now: float) -> list[Rejected]:
        """Reject the entries whose wait bound (:meth:`wait_bound`) has passed."""
        h = self._expiry
        out: list[Rejected] = []
        c = self.counters
        while h:
            at, _, e = h[0]
            if e.state is not State.QUEUED:
                heapq.heappop(h)
                continue
            if now <= at:
                break
            heapq.heappop(h)
            if e.readmitted:  # refused once already: it leaves now, routed at once
                self._released(e, now)
                c.overdue += 1
                self._overdue.append(e)
                continue
            e.state = State.REJECTED
            c.depth -= 1
            c.queued_size_s -= e.size_s
            c.rejected_max_wait += 1
            if e.key is not None:
                self.refusals.remember(e.key, now)
            out.append(Rejected(e, MAX_QUEUE_WAIT, now - e.arrival))
        if c.depth == 0:
            c.queued_size_s = 0.0  # no float residue once empty
        return out

    def take_overdue(self) -> list[Entry]:
        """The readmitted entries :meth:`expire` released at their bound (see the class
        docstring), once each: the driver routes them at once over every instance."""
        out, self._overdue = self._overdue, []
        return out

    def drain_s(self, instances: int) -> float:
        """Estimated seconds until what is queued now has started, spread over ``instances``
        (the prefill seconds queued, divided among them): what an overload answer tells the
        client to wait before it retries (``Retry-After``)."""
        return max(0.0, self.counters.queued_size_s) / max(1, instances)

    def retry_after(self, instances: int, floor_s: float = 1.0, time_factor: float = 1.0) -> int:
        """``Retry-After`` of an overload answer, whole seconds: :meth:`drain_s` (in wall
        seconds: times ``time_factor``), at least ``floor_s`` and at most
        :data:`RETRY_AFTER_MAX_S`. The rule of both drivers (the router's answer, the
        simulator's clients)."""
        wall = self.drain_s(instances) * time_factor
        return int(min(RETRY_AFTER_MAX_S, max(floor_s, math.ceil(wall))))

    def cancel(self, e: Entry) -> bool:
        """Take a queued ``e`` out (its client left): the orders skip it when met. True if
        it was queued."""
        if e.state is not State.QUEUED:
            return False
        e.state = State.CANCELLED
        c = self.counters
        c.depth -= 1
        c.queued_size_s -= e.size_s
        c.cancelled += 1
        if self.immediate:
            try:
                self._pending.remove(e)
            except ValueError:
                pass
        return True

    # ------------------------------------------------------------------ release
    def ready_mask(self, states: Sequence[InstanceState]) -> list[bool] | None:
        """Which instances the policy may choose for the entry just popped (``None``: all).
        Called right after :meth:`pop` with the same, unchanged ``states`` (as both drivers
        do), it reuses the mask that pop's readiness pass computed."""
        if self.immediate:
            return None
        if self._mask_of is not None and self._mask_of[0] is states:
            return self._mask_of[1]
        return self.readiness.mask(states)

    def pop(self, now: float, states: Sequence[InstanceState]) -> Entry | None:
        """The next entry to route now, or ``None`` (queue empty, or no instance ready).
        The driver routes it and updates ``states`` before popping again."""
        if self.immediate:
            if not self._pending:
                return None
            e = self._pending.popleft()
            return self._released(e, now)
        self._mask_of = None
        if self.counters.depth == 0:
            return None
        start, mask = self.readiness.scan(states)
        if start is None:
            return None
        self._mask_of = (states, mask)
        order = self.order
        e = order.pop(now, start)
        self.counters.deferrals = order.n_deferrals
        if e is None:
            return None
        return self._released(e, now)

    def head_key(self, now: float, states: Sequence[InstanceState]) -> tuple[int, float, float] | None:
        """The cluster-wide rank of the entry this queue would release next (smaller goes
        first), or ``None`` when nothing would be released now (empty queue, no instance
        ready). Router replicas that each hold a queue (``replica_mode=claims``) give the
        next ready instance to the replica whose key is smallest, so that together they
        release in the order one queue would: ``(tier, key, arrival)`` with tier 0 a
        feasible request keyed by its deadline (laxity: its latest start; fifo: its
        arrival), 1 an aged one, 2 a deferred one, 3 one past its far deadline
        (``far_k``). The order then releases what it would (an aged request's turn, a
        stolen deferred one): the key only says which replica goes. Judging the head (moving hopeless entries to the deferred queue) is what the
        next :meth:`pop` does anyway, so asking changes no release."""
        if self.counters.depth == 0:
            return None
        if self.immediate:
            e = self._pending[0] if self._pending else None
            return None if e is None else (0, e.arrival, e.arrival)
        start, _ = self.readiness.scan(states)
        if start is None:
            return None
        return self.order.head_key(now, start)

    def rank(self, now: float, start: float) -> tuple[int, float, float] | None:
        """:meth:`head_key` for an estimated start ``start`` given by the driver (the live
        router publishes its rank also while no instance is ready); None: queue empty."""
        if self.counters.depth == 0 or self.immediate:
            return None
        return self.order.head_key(now, start)

    def _released(self, e: Entry, now: float) -> Entry:
        e.state = State.RELEASED
        c = self.counters
        c.depth -= 1
        c.queued_size_s -= e.size_s
        c.released += 1
        w = now - e.arrival
        c.wait_sum_s += w
        if w > c.wait_max_s:
            c.wait_max_s = w
        if e.aged:
            c.aged += 1
        return e

    def next_timer(self, now: float, states: Sequence[InstanceState]) -> float:
        """When to run the cycle again if nothing else happens (``inf``: no need): a fetch
        backlog draining below the threshold, or the next wait bound to run out."""
        if self.immediate or self.counters.depth == 0:
            return math.inf
        t = self.readiness.next_change(now, states)
        h = self._expiry
        while h and h[0][2].state is not State.QUEUED:
            heapq.heappop(h)
        if h:
            at = h[0][0] + 1e-6
            if at < t:
                t = at
        return t

    def __len__(self) -> int:
        return self.counters.depth
