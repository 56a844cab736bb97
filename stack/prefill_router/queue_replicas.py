"""The dispatch queue across router replicas: what a :class:`~stack.prefill_router.queue.LiveQueue`
asks of the replicas' shared state, and the release order of ``replica_mode: claims``.

Router replicas (``router.redis_url``) with ``router.dispatch.replica_mode: claims`` (the
default there) release in one order across replicas: the queue publishes the rank of its next
release (:meth:`~stack.dispatch.Dispatcher.rank`) through the shared state and releases only
while fewer replicas rank before it than workers are ready (:meth:`Replicas.may_release`).
Each exchange of ranks (every ``redis_flush_s``) runs the queue's pump again; a replica whose
view is older than that (nothing waited here a moment ago) reads it before it releases. A
replica's waiting requests stay with it (its clients are connected to it): nothing is handed
over, so a replica that dies takes only its own clients' requests, and its rank expires with
its heartbeat. In either replica mode the others' figures are read every ``redis_flush_s``
while requests wait (:meth:`Replicas.want_view`): readiness needs them, and no routing reads
them while nothing is released (without that read, a worker freed by another replica's
finished request stayed busy in this replica's view).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Protocol

from stack.core.types import InstanceState
from stack.dispatch import Dispatcher

#: a release's rank on the replicas' shared clock (:meth:`~stack.dispatch.Dispatcher.rank`)
Rank = tuple[int, float, float]


class Replicas(Protocol):
    """The shared state's side, as the dispatch queue uses it
    (:class:`~stack.prefill_router.shared_heads.SharedHeads` over Redis)."""

    def subscribe(self, poke: Callable[[], None], claims: bool) -> None:
        """Run ``poke`` after each read of the others' figures; ``claims``: exchange ranks."""

    def want_view(self, on: bool) -> None:
        """Read the others' figures every flush while ``on`` (requests wait here)."""

    def fresh(self) -> bool:
        """Whether the others' figures were read within a flush (otherwise a read is asked)."""

    def set_head(self, key: Rank | None) -> None:
        """This replica's next release ranks ``key`` (None: nothing to release)."""

    def may_release(self, key: Rank, n_ready: int) -> bool:
        """Whether fewer live replicas rank before ``key`` than ``n_ready`` workers are ready."""


#: reads of the wall clock between two of the queue's clock, of which the tightest is kept
OFFSET_READS = 3


def wall_offset(clock: Callable[[], float], time_factor: float) -> float:
    """The wall clock (over ``time_factor``) less ``clock``, read between two readings of
    ``clock`` and set against their midpoint; of :data:`OFFSET_READS` tries, the one whose two
    readings lie closest. A pause between two reads (a garbage collection, another thread)
    would otherwise shift the offset by its whole length (the unit suite saw 3.3 ms)."""
    best_gap, best = float("inf"), 0.0
    for _ in range(OFFSET_READS):
        a = clock()
        w = time.time()
        b = clock()
        if b - a < best_gap:
            best_gap, best = b - a, w / time_factor - 0.5 * (a + b)
    return best


class ClaimedRelease:
    """``replica_mode: claims``: this replica's place in the one release order (see the
    module docstring). ``clock``: the queue's (the pool's seconds); ``time_factor``: wall
    seconds per pool second, for the replicas' shared clock."""

    def __init__(
        self, replicas: Replicas, disp: Dispatcher, clock: Callable[[], float], time_factor: float
    ) -> None:
        self.replicas = replicas
        self.disp = disp
        self.clock = clock
        self.time_factor = time_factor

    def _shared(self, key: Rank) -> Rank:
        """``key`` on the replicas' shared clock (wall seconds in the pool's time): each
        replica's monotonic clock has its own origin."""
        off = wall_offset(self.clock, self.time_factor)
        return (key[0], key[1] + off, key[2] + off)

    def may_release(self, now: float, states: list[InstanceState]) -> bool:
        """Whether this replica's next release goes now; False also when no worker is ready
        (the dispatcher would not release)."""
        d = self.disp
        start, mask = d.readiness.scan(states)
        if start is None or not self.replicas.fresh():  # a view older than a flush: read it first
            return False
        key = d.rank(now, start)
        return key is not None and self.replicas.may_release(self._shared(key), sum(mask))

    def publish(self, now: float, states: list[InstanceState]) -> None:
        """Tell the other replicas the rank of this replica's next release (None: none waits).
        With no worker ready, ranked at the earliest estimated start of any worker."""
        d = self.disp
        key = None
        if d.counters.depth:
            start, _ = d.readiness.scan(states)
            if start is None:
                start = min((d.readiness.load(s) for s in states if s.healthy), default=0.0)
            key = d.rank(now, start)
        self.replicas.set_head(None if key is None else self._shared(key))

    def withdraw(self) -> None:
        """Nothing of this replica's waits or is being booked: its rank leaves."""
        self.replicas.set_head(None)
