"""The global-tier links as the replicas share them.

A prefill worker fetches the part of a prefix that lives in the global tier over its link,
and each replica books those fetches on its own FIFO of that link
(:class:`stack.pool.worker.BookedLink`). So that every replica's FIFO carries every replica's
fetches, each one publishes with its figures the seconds it has booked on the link so far
(:attr:`~stack.pool.worker.BookedLink.booked`, a counter that only grows), in wall seconds.

On each read, :class:`SharedLinks` sums the other live replicas' counters per link and queues
what they grew by since the last read behind this replica's own fetches: one FIFO for one
link, learned one read late, as the simulator's one link. The first read of a link (and the
first after Redis was down) only takes the counters as they are; a counter that fell (its
replica died or restarted) is taken as it is now, and what the dead replica's fetches still
hold of the link stays queued (the workers fetch, not the router).
"""

from __future__ import annotations

import time

from stack.pool import Worker, WorkerRegistry
from stack.pool.worker import BookedLink
from stack.prefill_router.shared_view import Snapshot, wkey


class SharedLinks:
    """One replica's side of the shared link backlogs. ``time_factor``: wall seconds per
    second of the pool (``router.time_factor``): the links' FIFOs run on the pool's clock,
    what replicas publish of them is in wall seconds."""

    def __init__(self, registry: WorkerRegistry, time_factor: float) -> None:
        self.reg = registry
        self.time_factor = time_factor
        #: per link, the others' booked seconds (wall) already queued on it
        self._seen: dict[BookedLink, float] = {}

    def booked(self, w: Worker) -> float:
        """What this replica publishes of ``w``'s link: the seconds it booked on it (wall)."""
        return w.link.booked * self.time_factor

    def apply(self, snap: Snapshot) -> None:
        """Queue on each link what the others booked on it since the last read."""
        fetched: dict[BookedLink, float] = {}  # the others' link counters, per link
        for w in self.reg.workers.values():
            if w.role == "prefill":
                # a host's link is published under each of its workers: the same counters
                total = snap.links.get(wkey(w), 0.0)
                if fetched.get(w.link, -1.0) < total:
                    fetched[w.link] = total
        self._learn(fetched)

    def _learn(self, seen: dict[BookedLink, float]) -> None:
        """Queue on each link the fetches the other replicas booked on it since the last read
        (``seen``: their counters' sum now, wall seconds), behind this replica's own."""
        now = time.monotonic() / self.time_factor
        for link, total in seen.items():
            before = self._seen.get(link)
            if before is not None and total > before:
                link.push(now, (total - before) / self.time_factor)
        self._seen = seen

    def reset(self) -> None:
        """Redis is down: what the others book meanwhile is not learned, start afresh."""
        self._seen = {}
