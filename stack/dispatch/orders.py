"""Release orders: which queued request goes next when an instance is ready.

Every order keeps its own structure over the queued :class:`Entry` objects, with lazy
deletion (an entry released or rejected elsewhere is skipped when met), and answers
``pop(now, start)``: the next entry to release, where ``start`` is the estimated start of
work sent now (the smallest load over the ready instances, see
:class:`~stack.dispatch.readiness.Readiness`). An entry is *feasible* when
``now + start + size_s <= deadline``; one that is not is *hopeless*: it will miss its SLO
wherever it goes.

Why plain deadline order collapses (the domino effect): under a burst, the earliest
deadlines belong to requests that are already late; serving them first spends capacity
on requests that miss anyway while the next ones become late in turn, until nobody
meets their deadline. Every useful deadline order therefore puts hopeless requests after
feasible ones. Deferring them *without bound* is starvation: with load at or past the
knee the feasible stream never dries up and the deferred wait minutes (an agent times
out or retries). The orders here differ in how that deferral is bounded.

Ties are broken by admission order (``seq``) everywhere.
"""

from __future__ import annotations

import heapq
import math
from collections import deque

from stack.dispatch.entry import Entry, State


class Order:
    """Base class: a release order. ``immediate`` orders hold nothing (the driver routes at
    admission); the others implement ``push`` / ``pop``."""

    name = "order"
    immediate = False
    #: entries put behind others because they could no longer meet their deadline
    n_deferrals = 0

    def push(self, e: Entry, now: float) -> None:  # pragma: no cover
        raise NotImplementedError

    def pop(self, now: float, start: float) -> Entry | None:  # pragma: no cover
        raise NotImplementedError

    def head_key(self, now: float, start: float) -> tuple[int, float, float] | None:
        """How urgent the entry :meth:`pop` would release is, to rank queues against each
        other (router replicas, :meth:`~stack.dispatch.dispatcher.Dispatcher.head_key`):
        ``(tier, deadline, arrival)``, smaller first; None when nothing is queued. An order
        that does not say ranks all its entries alike."""
        return (0, 0.0, 0.0)

    def params(self) -> dict[str, float]:
        return {}


class Immediate(Order):
    """Today's behaviour: no queue at the router, every request routed at its arrival over
    the whole cluster (instances queue it FCFS)."""

    name = "immediate"
    immediate = True


def _live(e: Entry) -> bool:
    return e.state is State.QUEUED


class Fifo(Order):
    """Late binding in arrival order: requests wait at the router until an instance is
    ready, and leave in the order they came."""

    name = "fifo"

    def __init__(self) -> None:
        self.q: deque[Entry] = deque()

    def push(self, e: Entry, now: float) -> None:
        self.q.append(e)

    def pop(self, now: float, start: float) -> Entry | None:
        q = self.q
        while q:
            e = q.popleft()
            if _live(e):
                return e
        return None

    def head_key(self, now: float, start: float) -> tuple[int, float, float] | None:
        q = self.q
        while q and not _live(q[0]):
            q.popleft()
        return (0, q[0].arrival, q[0].arrival) if q else None


class Deadline(Order):
    """Earliest deadline first (deadline = arrival + ttft_slo(L)), hopeless or not. Kept as
    the reference that shows the domino effect; do not use it under overload."""

    name = "deadline"

    def __init__(self) -> None:
        self.h: list[tuple[float, int, Entry]] = []

    def push(self, e: Entry, now: float) -> None:
        heapq.heappush(self.h, (e.deadline, e.seq, e))

    def pop(self, now: float, start: float) -> Entry | None:
        h = self.h
        while h:
            e = heapq.heappop(h)[2]
            if _live(e):
                return e
        return None

    def head_key(self, now: float, start: float) -> tuple[int, float, float] | None:
        e = _peek_live(self.h)
        return None if e is None else (0, self.h[0][0], e.arrival)


#: ``aged_share=0`` (DeadlineDefer.late_share): the late class's share is measured over about
#: this many admissions (the readiness's own ``slo_window``) and kept within these bounds, so a
#: class that is never or always late cannot starve the other
SHARE_WINDOW = 256
SHARE_BOUNDS = (1 / 64, 1 / 2)
_SHARE_DECAY = 2.0 ** (-1.0 / SHARE_WINDOW)


class DeadlineDefer(Order):
    """Deadline order among feasible requests; hopeless ones after all feasible ones (in
    deadline order), aged back in at the front once they have waited ``age_k`` times their
    SLO (``age_k = inf``: unbounded deferral, the starvation reference).

    ``aged_share`` bounds the front of the queue that aged requests take while feasible
    ones wait: at most that share of such contended releases goes to an aged request
    (1 = all of them, the plain backstop; 0.5 = every other one; 0 = the late class's measured
    share of the arriving work, :meth:`late_share`: candidate C1 of docs/research/dispatch.md's
    protocol). Below 1 the backstop
    cannot hand the whole cluster to a crowd of aged requests at once past the knee (the
    domino effect through ageing), and an aged request still leaves within a bounded
    number of releases.

    A request is judged hopeless when it reaches the head of the feasible queue; once
    deferred it is not judged again (the estimated start moves by less than the readiness
    threshold). The queue stays work-conserving: when no feasible request is left, the
    deferred ones go, oldest deadline first.

    ``far_k`` (0: off) gives the deferred and aged requests a second, far deadline,
    ``arrival + far_k x SLO``, and orders them by it: among requests that already missed
    their SLO, the ones that can still stay under ``far_k`` times it go first, and a request
    past its far deadline waits behind them (in the *lost* queue, by deadline). Past the knee
    that stops the backstop from spending its turns on requests lost to both marks while the
    next ones cross them (the same domino as plain deadline order, one level down). A lost
    request is never dropped: it takes the backstop's turns whenever no savable aged request
    waits, and goes whenever nothing else does. With ``far_k`` at the mark the figures report
    (5: the share of requests past 5x SLO), the order aims at that mark.

    The product's default order (router config, ``smetric demo``), with ``age_k`` 1.5,
    ``aged_share`` 0.125 and ``far_k`` 5: docs/research/dispatch.md, "The default".
    """

    name = "deadline-defer"

    def __init__(self, age_k: float = 5.0, aged_share: float = 1.0, far_k: float = 0.0) -> None:
        if not age_k > 0:
            raise ValueError("deadline-defer: age_k must be > 0")
        if not 0 <= aged_share <= 1:
            raise ValueError("deadline-defer: aged_share must be in [0, 1] (0: measured)")
        if not (far_k == 0 or far_k >= 1):
            raise ValueError("deadline-defer: far_k must be 0 (off) or >= 1")
        self.age_k = float(age_k)
        self.aged_share = float(aged_share)
        self.far_k = float(far_k)
        self.lost: list[tuple[float, int, Entry]] = []  # past far_k x SLO, by deadline
        self._aged_credit = 0.0
        self.main: list[tuple[float, int, Entry]] = []  # by deadline
        self.deferred: list[tuple[float, int, Entry]] = []  # by deadline (far_k: the far one)
        self.ageing: list[tuple[float, int, Entry]] = []  # deferred, by when they age
        self.aged: list[tuple[float, int, Entry]] = []  # aged back in, by deadline (far_k: the far one)
        self.n_aged = 0
        #: ``aged_share=0``: the late class's measured share of the arriving work, as decayed
        #: sums of the estimated prefill seconds admitted and of those judged hopeless
        self._work_in = 0.0
        self._work_late = 0.0

    def params(self) -> dict[str, float]:
        return {"age_k": self.age_k, "aged_share": self.aged_share, "far_k": self.far_k}

    def late_share(self) -> float:
        """The share of releases aged requests may take while feasible ones wait: ``aged_share``,
        or with ``aged_share=0`` the late class's measured share of the arriving work (the
        estimated prefill seconds of the requests judged hopeless over those admitted, decayed
        over about :data:`SHARE_WINDOW` admissions), within :data:`SHARE_BOUNDS`."""
        if self.aged_share:
            return self.aged_share
        lo, hi = SHARE_BOUNDS
        share = self._work_late / self._work_in if self._work_in > 0 else lo
        return min(hi, max(lo, share))

    def _key(self, e: Entry) -> float:
        """The deferred and aged queues' key: the deadline, or with ``far_k`` the far one."""
        return e.arrival + self.far_k * e.slo_s if self.far_k else e.deadline

    def _savable(self, h: list[tuple[float, int, Entry]], now: float) -> Entry | None:
        """The live head of ``h`` that has not passed its far deadline; the ones that have
        go to the lost queue on the way."""
        while h:
            k, _, e = h[0]
            if not _live(e) or e.lost:
                heapq.heappop(h)
                continue
            if self.far_k and k < now:
                heapq.heappop(h)
                e.lost = True
                heapq.heappush(self.lost, (e.deadline, e.seq, e))
                continue
            return e
        return None

    def _backstop(self, now: float) -> list[tuple[float, int, Entry]] | None:
        """The queue whose head takes an aged turn: the aged (savable first), then the lost."""
        if self._savable(self.aged, now) is not None:
            return self.aged
        if _peek_live(self.lost) is not None:
            return self.lost
        return None

    def _aged_turn(self) -> bool:
        """Whether an aged request takes this release from a waiting feasible one."""
        self._aged_credit += self.aged_share or self.late_share()
        if self._aged_credit >= 1.0:
            self._aged_credit -= 1.0
            return True
        return False

    def _age_at(self, e: Entry) -> float:
        return e.arrival + self.age_k * e.slo_s

    def push(self, e: Entry, now: float) -> None:
        heapq.heappush(self.main, (e.deadline, e.seq, e))
        if not self.aged_share:
            self._work_in = self._work_in * _SHARE_DECAY + e.size_s
            self._work_late *= _SHARE_DECAY

    def _promote(self, now: float) -> None:
        ag = self.ageing
        while ag and ag[0][0] <= now:
            e = heapq.heappop(ag)[2]
            if _live(e) and not e.aged and not e.lost:
                e.aged = True
                self.n_aged += 1
                heapq.heappush(self.aged, (self._key(e), e.seq, e))

    def _judge(self, now: float, start: float) -> Entry | None:
        """Move the hopeless entries at the head of the feasible queue to the deferred one
        (to the aged one if they have waited long enough already); return the feasible head,
        left in place, or None."""
        main = self.main
        while main:
            e = main[0][2]
            if not _live(e):
                heapq.heappop(main)
                continue
            if now + start + e.size_s <= e.deadline:
                return e
            heapq.heappop(main)
            if not self.aged_share:
                self._work_late += e.size_s
            if self._age_at(e) <= now:
                e.aged = True
                self.n_aged += 1
                heapq.heappush(self.aged, (self._key(e), e.seq, e))
                continue
            e.deferrals += 1
            self.n_deferrals += 1
            heapq.heappush(self.deferred, (self._key(e), e.seq, e))
            if math.isfinite(self.age_k):
                heapq.heappush(self.ageing, (self._age_at(e), e.seq, e))
        return None

    def _steal(self, now: float, start: float, head: Entry, d: Entry) -> bool:
        """Whether the deferred ``d`` goes before the feasible ``head`` (never, here)."""
        return False

    def _idle_turn(self, now: float) -> tuple[int, list[tuple[float, int, Entry]]] | None:
        """With no feasible request waiting, the queue whose head goes, and its tier: the
        savable aged (1), then the savable deferred (2), then the lost (3); a deferred request
        past its far deadline moves to the lost queue on the way. None: nothing waits."""
        if self._savable(self.aged, now) is not None:
            return 1, self.aged
        if self._savable(self.deferred, now) is not None:
            return 2, self.deferred
        if _peek_live(self.lost) is not None:
            return 3, self.lost
        return None

    def pop(self, now: float, start: float) -> Entry | None:
        if math.isfinite(self.age_k):
            self._promote(now)
        head = self._judge(now, start)
        if head is None:
            turn = self._idle_turn(now)
            return None if turn is None else heapq.heappop(turn[1])[2]
        back = self._backstop(now)
        if back is not None and self._aged_turn():
            return heapq.heappop(back)[2]
        d = self._savable(self.deferred, now)
        if d is not None and self._steal(now, start, head, d):
            return heapq.heappop(self.deferred)[2]
        heapq.heappop(self.main)
        return head

    def head_key(self, now: float, start: float) -> tuple[int, float, float] | None:
        """Tier 0: the feasible head; else the tier of :meth:`_idle_turn`. Judging the head
        (moving hopeless entries to the deferred queue) is what the next :meth:`pop` does
        anyway, so asking changes no release."""
        if math.isfinite(self.age_k):
            self._promote(now)
        e = self._judge(now, start)
        if e is not None:
            return (0, e.deadline, e.arrival)
        turn = self._idle_turn(now)
        if turn is None:
            return None
        e = turn[1][0][2]
        return (turn[0], e.deadline, e.arrival)


class Slack(DeadlineDefer):
    """Deadline-defer with slack stealing (our non-starving candidate).

    As deadline-defer, hopeless requests leave the feasible queue, but they do not wait
    for a lull: the most overdue deferred request goes *before* the most urgent feasible
    one whenever that one has slack enough to absorb it, i.e. when
    ``head.deadline - (now + start + head.size_s) >= steal * deferred.size_s`` (as if both
    ran on one instance, back to back: conservative with many instances). That is slack
    stealing from real-time scheduling: best-effort work goes as early as it can without
    making a request that can still meet its deadline miss it, so the deferred requests'
    wait tracks the feasible queue's slack instead of the length of the busy period; the
    ageing bound (``age_k`` x SLO, default 3) stays as the backstop past the knee, and aged
    requests take at most ``aged_share`` (default 0.25) of the releases while feasible ones
    wait, so past the knee the backstop does not hand the cluster to a crowd of aged
    requests at once (with ``aged_share=1``, the first version, slack fell below immediate
    dispatch far past the knee: docs/research/dispatch.md).

    The product's default order until the stealing was found to cost more than it saves once
    ``far_k`` orders the late requests (docs/research/dispatch.md, "The default").
    """

    name = "slack"

    def __init__(
        self, age_k: float = 3.0, steal: float = 1.0, aged_share: float = 0.25, far_k: float = 0.0
    ) -> None:
        super().__init__(age_k, aged_share, far_k)
        if not steal >= 0:
            raise ValueError("slack: steal must be >= 0")
        self.steal = float(steal)
        self.n_stolen = 0

    def params(self) -> dict[str, float]:
        return {**super().params(), "steal": self.steal}

    def _steal(self, now: float, start: float, head: Entry, d: Entry) -> bool:
        if head.deadline - (now + start + head.size_s) >= self.steal * d.size_s:
            self.n_stolen += 1
            return True
        return False


def _peek_live(h: list[tuple[float, int, Entry]]) -> Entry | None:
    while h:
        e = h[0][2]
        if _live(e):
            return e
        heapq.heappop(h)
    return None


class Laxity(Order):
    """Least laxity first with a bounded, *priced* deferral (our non-starving candidate).

    Key = latest start that still meets the deadline, ``deadline - size_s`` (size-aware: of
    two requests with one deadline, the longer prefill must start first). A request found
    hopeless at the head is re-keyed once, to the latest start for a relaxed deadline of
    ``arrival + relax_k * slo_s``, and competes again from there: it yields to feasible
    requests whose deadlines fall before its relaxed one (no domino), but requests that
    arrived later than about ``(relax_k - 1) x SLO`` after it have later keys, so it is
    served within about ``relax_k`` times its SLO plus the work ahead of it, whatever the
    load: deferral is bounded by construction, without an ageing step that later hands
    all the aged requests the front of the queue at once.
    """

    name = "laxity"

    def __init__(self, relax_k: float = 2.0) -> None:
        if not relax_k >= 1:
            raise ValueError("laxity: relax_k must be >= 1")
        self.relax_k = float(relax_k)
        self.h: list[tuple[float, int, Entry]] = []

    def params(self) -> dict[str, float]:
        return {"relax_k": self.relax_k}

    def push(self, e: Entry, now: float) -> None:
        heapq.heappush(self.h, (e.deadline - e.size_s, e.seq, e))

    def pop(self, now: float, start: float) -> Entry | None:
        h = self.h
        while h:
            key, _, e = heapq.heappop(h)
            if not _live(e):
                continue
            if now + start <= key or e.deferrals:
                return e
            e.deferrals = 1
            self.n_deferrals += 1
            relaxed = e.arrival + self.relax_k * e.slo_s - e.size_s
            if relaxed <= now + start:  # already past its relaxed deadline: go now
                return e
            heapq.heappush(h, (relaxed, e.seq, e))
        return None

    def head_key(self, now: float, start: float) -> tuple[int, float, float] | None:
        e = _peek_live(self.h)
        return None if e is None else (0, self.h[0][0], e.arrival)


ORDERS: dict[str, type[Order]] = {
    o.name: o for o in (Immediate, Fifo, Deadline, DeadlineDefer, Slack, Laxity)
}
