"""Shared state of router replicas through Redis (``router.redis_url``).

Several router processes in front of one pool share what routing and the dispatch queue need
to act as one router. :class:`SharedState` is what the router builds, starts and stops; each
concern is a part of its own, and all of them talk to Redis through one connection:

- :mod:`~stack.prefill_router.shared_connection`: the client, the replica's identity and
  sequence numbers, and whether the shared state is up;
- :mod:`~stack.prefill_router.shared_bookings`: dispatch accounting, each replica's
  published figures per prefill worker, and the claims that keep an idle instance from being
  booked twice;
- :mod:`~stack.prefill_router.shared_links`: the global-tier links, whose backlogs carry
  every replica's fetches;
- :mod:`~stack.prefill_router.shared_heads`: one queue order across replicas
  (``replica_mode: claims``), the ranks of the requests each would release next;
- :mod:`~stack.prefill_router.shared_refusals`: the requests the dispatch queues refused for
  their wait, so that a retry is known whichever replica it reaches;
- :mod:`~stack.prefill_router.shared_registry`: admin changes to the worker registry, made on
  any replica and applied by all;
- :mod:`~stack.prefill_router.shared_heartbeat`: which replicas are live, and the resync that
  brings a replica's shared state up;
- :mod:`~stack.prefill_router.shared_view`: what a read of the shared state returns.

Losing Redis never fails or blocks a request for longer than ``redis_timeout_s``: the first
failed call marks the shared state down, routing then uses local state only, and the
heartbeat tries Redis again; when it answers, the replica replays the admin changes it made
meanwhile, re-publishes all its figures, re-reads the registry, and marks it up (``/health``
``shared_state``, gauge ``smetric_shared_state_up``).

Keys (``ns`` = ``router.redis_namespace``): ``ns:hb:<replica>`` (heartbeat, PX TTL),
``ns:replicas`` (set), ``ns:heads`` (hash ``<replica>`` -> ``seq tier key arrival``),
``ns:acct`` (hash ``<replica>\\t<role>|<url>`` -> ``seq tokens seconds running fetched``),
``ns:ver`` (hash ``<role>|<url>`` -> booking version), ``ns:workers`` (hash
``<role>|<url>`` -> JSON spec), ``ns:workers_ver``, ``ns:refused:<tokens>:<last block>``
(refusals for their wait not yet retried, PX TTL). Single Redis (the scripts build
key names, so not Redis Cluster). The scripts are in
:mod:`stack.prefill_router.shared_scripts`.
"""

from __future__ import annotations

import asyncio
import contextlib

from stack.pool import WorkerRegistry
from stack.prefill_router.shared_bookings import SharedBookings
from stack.prefill_router.shared_connection import SharedConnection
from stack.prefill_router.shared_heads import SharedHeads
from stack.prefill_router.shared_heartbeat import SharedHeartbeat
from stack.prefill_router.shared_links import SharedLinks
from stack.prefill_router.shared_refusals import SharedRefusals
from stack.prefill_router.shared_registry import SharedRegistry


class SharedState:
    """One replica's connection to the shared state, as the router uses it. All of it is safe
    to call while Redis is down: it then does nothing (routing runs on local state).

    The parts: :attr:`conn`, :attr:`bookings`, :attr:`links`, :attr:`heads` (the dispatch
    queue's :class:`~stack.prefill_router.queue_replicas.Replicas`), :attr:`registry` (the
    admin API's and the drains' side), :attr:`heartbeat`, :attr:`refusals` (the dispatch
    queue's memory of the requests it refused for their wait)."""

    def __init__(
        self,
        url: str,
        registry: WorkerRegistry,
        *,
        namespace: str = "smetric",
        replica_id: str | None = None,
        timeout_s: float = 0.1,
        heartbeat_s: float = 0.5,
        ttl_s: float = 2.0,
        flush_s: float = 0.05,
        metrics_registry=None,
        head_stale_s: float = 0.5,
        time_factor: float = 1.0,
    ) -> None:
        self.timeout_s = timeout_s
        self.conn = SharedConnection(
            url,
            namespace=namespace,
            replica_id=replica_id,
            timeout_s=timeout_s,
            metrics_registry=metrics_registry,
        )
        self.links = SharedLinks(registry, time_factor)
        self.bookings = SharedBookings(
            self.conn, registry, self.links, flush_s=flush_s, metrics_registry=metrics_registry
        )
        self.heads = SharedHeads(self.conn, flush_s=flush_s, head_stale_s=head_stale_s)
        self.refusals = SharedRefusals(self.conn, time_factor)
        self.registry = SharedRegistry(self.conn, registry, self.bookings)
        self.heartbeat = SharedHeartbeat(
            self.conn, self.registry, self.bookings, heartbeat_s=heartbeat_s, ttl_s=ttl_s
        )
        # every view read reaches every part, and so does the shared state going down
        self.conn.on_view += [self.heads.apply, self.bookings.apply, self.links.apply, self.registry.apply]
        self.conn.on_down += [self.heads.reset, self.bookings.reset, self.links.reset]
        self._tasks: list[asyncio.Task] = []

    @property
    def up(self) -> bool:
        return self.conn.up

    @property
    def rid(self) -> str:
        return self.conn.rid

    # -- lifecycle ----------------------------------------------------------------------------
    async def start(self) -> None:
        """Connect (if Redis answers; otherwise keep trying in the background), add this
        replica's configured workers to the shared registry, adopt the shared registry."""
        with contextlib.suppress(Exception):
            await self.heartbeat.resync(seed=True)
        loop = asyncio.get_running_loop()
        self._tasks = [
            loop.create_task(self.heartbeat.loop()),
            loop.create_task(self.bookings.loop()),
            loop.create_task(self.heads.loop()),
        ]

    async def stop(self) -> None:
        await self.refusals.settle()
        for t in self._tasks:
            t.cancel()
        self.registry.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        self._tasks = []
        if self.conn.up:  # leave at once rather than after the TTL
            with contextlib.suppress(Exception):
                await self.heartbeat.leave()
                await self.heads.leave()
        with contextlib.suppress(Exception):
            await self.conn.close()

    def info(self) -> dict:
        return {"up": self.conn.up, "replica": self.conn.rid, **self.conn.stats}
