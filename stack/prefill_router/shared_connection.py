"""One replica's connection to the shared state in Redis, and whether it is up.

The parts of the shared state (bookings, links, heads, registry, heartbeat) all talk to Redis
through one :class:`SharedConnection`, which holds what they have in common:

- the client, which tries each call once and gives up after the timeout, so a failure is
  handled at once by the caller and never retried behind its back;
- the replica's identity: its id, and a random token that tells apart two processes
  configured with the same id;
- the sequence number stamped on every value the replica writes, so that a late write never
  overwrites a newer one (it starts from the wall clock, so it grows across restarts);
- the up/down flag, the gauge ``smetric_shared_state_up`` and the counters of ``/health``.

A read of the view, whichever part made it, is handed to every part (:attr:`on_view`). The
first failed call marks the shared state down and tells every part (:attr:`on_down`): each
forgets what it had learned from the other replicas, and routing runs on local state until
the heartbeat resyncs.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import socket
import time
from collections.abc import Callable

from stack.prefill_router import shared_scripts as lua
from stack.prefill_router.shared_view import Snapshot, parse_view

log = logging.getLogger("stack.router.shared")


def default_replica_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"


def one_try_client(url: str, timeout_s: float, asyncio: bool):
    """A Redis client (``redis.asyncio`` or the blocking one) that tries each call once and
    gives up after ``timeout_s``: a failure is the caller's to handle at once, never retried
    behind its back."""
    from redis.backoff import NoBackoff

    if asyncio:
        from redis.asyncio import Redis
        from redis.asyncio.retry import Retry
    else:
        from redis import Redis
        from redis.retry import Retry
    return Redis.from_url(
        url,
        socket_timeout=timeout_s,
        socket_connect_timeout=timeout_s,
        retry=Retry(NoBackoff(), 0),
        retry_on_timeout=False,
        health_check_interval=0,
    )


class SharedConnection:
    """The Redis client, identity and up/down state one replica's shared-state parts share."""

    def __init__(
        self,
        url: str,
        *,
        namespace: str,
        replica_id: str | None,
        timeout_s: float,
        metrics_registry=None,
    ) -> None:
        self.url = url
        self.ns = namespace
        self.rid = (replica_id or default_replica_id()).replace("\t", " ")
        self.timeout_s = timeout_s
        self.r = one_try_client(url, timeout_s, asyncio=True)
        self._read = self.r.register_script(lua.READ)
        #: the value of this replica's heartbeat key: tells two processes with one id apart
        self.token = secrets.token_hex(8)
        self.up = False
        self._seq = int(time.time() * 1000) * 1000  # monotonic across restarts of this replica
        self.stats = {"conflicts": 0, "errors": 0, "resyncs": 0, "claims": 0}
        #: called with every view read, whichever part read it
        self.on_view: list[Callable[[Snapshot], None]] = []
        #: called when the shared state goes down: forget what the others published
        self.on_down: list[Callable[[], None]] = []
        self._gauge = None
        if metrics_registry is not None:
            from prometheus_client import Gauge

            self._gauge = Gauge(
                "smetric_shared_state_up",
                "1 while the replicas' Redis shared state is reachable",
                registry=metrics_registry,
            )
            self._gauge.set(0)

    async def call(self, coro):
        """Await one Redis call, never longer than its timeouts allow."""
        return await asyncio.wait_for(coro, self.timeout_s * 2 + 0.05)

    def next_seq(self) -> int:
        self._seq += 1
        return self._seq

    def down(self, where: str, e: BaseException | None) -> None:
        """Mark the shared state down (``e``: the failure, None for a resync of a live
        connection): every part forgets what it learned from the others."""
        if e is not None:
            self.stats["errors"] += 1
            if self.up:
                log.warning("shared state down (%s: %s): routing on local state", where, type(e).__name__)
        self.up = False
        for forget in self.on_down:
            forget()
        self.set_gauge(0)

    def set_gauge(self, value: int) -> None:
        if self._gauge is not None:
            self._gauge.set(value)

    def resynced(self) -> None:
        """The heartbeat brought the shared state back (or up for the first time)."""
        self.set_gauge(1)
        self.stats["resyncs"] += 1
        log.info("shared state up (replica %s, %s)", self.rid, self.url)

    def apply(self, snap: Snapshot) -> None:
        """Hand a view read to every part."""
        for take in self.on_view:
            take(snap)

    async def refresh(self) -> Snapshot | None:
        """Read the others' figures into the workers; None while Redis is down."""
        if not self.up:
            return None
        try:
            snap = parse_view(await self.call(self._read(args=[self.ns, self.rid])))
        except Exception as e:  # noqa: BLE001 - any Redis failure: local state only
            self.down("read", e)
            return None
        self.apply(snap)
        return snap

    async def close(self) -> None:
        await self.r.aclose()
