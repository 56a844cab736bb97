"""A worker that drains: it takes no new requests, finishes what it holds, then leaves the pool.

``POST /admin/workers/drain`` (or ``/admin/workers/{id}/drain``) starts it. From then on the
worker is no candidate for routing: neither the prefill policy nor the decode balancer picks
it. The requests it holds run to their end. The worker is removed from the registry once it
holds none, or at its deadline (``timeout_s``, default ``router.drain_timeout_s`` or the
request timeout) whatever it still holds. Re-adding it is ``POST /admin/workers``.

With router replicas, the drain's deadline is written into the worker's entry of the shared
registry: every replica stops routing to it as it reads the registry, and each watches it.
"Holds none" counts every replica's requests (its own, and the others' running figures from
the shared state), and the first replica to see the worker idle removes it for all.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from stack.pool import Worker, WorkerRegistry

log = logging.getLogger("stack.router")

#: seconds between two looks at a draining worker
POLL_S = 0.1


def holds_work(w: Worker) -> bool:
    """Whether ``w`` still holds requests: this replica's (booked, answer not ended) or the
    other replicas' (their running figure in the shared state)."""
    return w.inflight > 0 or bool(w.queued) or bool(w.decoding) or w.shared_running > 0


class WorkerDrains:
    """The drains in progress on this replica's registry. ``remove`` takes a worker out of the
    pool (the registry, and the shared registry with replicas)."""

    def __init__(
        self,
        registry: WorkerRegistry,
        remove: Callable[[Worker], Awaitable[None]],
        refresh: Callable[[], Awaitable[object]] | None = None,
        settle_s: float = 0.0,
    ) -> None:
        self.registry = registry
        self.remove = remove
        #: reads the other replicas' figures into the workers (None: no replicas)
        self.refresh = refresh
        #: seconds after a drain starts before the worker may be judged idle: with replicas,
        #: until every replica has read the drain and published what it sent meanwhile
        self.settle_s = settle_s
        self._tasks: dict[str, asyncio.Task] = {}

    def start(self, w: Worker, deadline: float) -> None:
        """Drain ``w`` until ``deadline`` (wall-clock epoch seconds, shared by the replicas)."""
        if w.draining_until is None or deadline < w.draining_until:
            w.draining_until = deadline
        key = f"{w.role}|{w.url}"
        if key not in self._tasks or self._tasks[key].done():
            self._tasks[key] = asyncio.get_running_loop().create_task(self._watch(w))
            log.warning("worker %s (%s) draining: no new requests; %d held", w.url, w.role, w.inflight)

    async def _watch(self, w: Worker) -> None:
        if self.settle_s > 0:
            await asyncio.sleep(self.settle_s)
        while self.registry.workers.get(w.wid) is w:
            if self.refresh is not None:
                await self.refresh()
            late = w.draining_until is not None and time.time() >= w.draining_until
            if late or not holds_work(w):
                if late and holds_work(w):
                    log.warning(
                        "worker %s (%s): drain deadline with %d held; removed", w.url, w.role, w.inflight
                    )
                else:
                    log.warning("worker %s (%s) drained: removed", w.url, w.role)
                await self.remove(w)
                return
            await asyncio.sleep(POLL_S)

    async def stop(self) -> None:
        for t in self._tasks.values():
            t.cancel()
        for t in self._tasks.values():
            try:
                await t
            except (asyncio.CancelledError, Exception):
                pass
        self._tasks.clear()
