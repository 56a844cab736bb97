"""Liveness of router replicas, and recovery when Redis comes back.

Each replica refreshes its heartbeat key ``ns:hb:<replica>`` every ``heartbeat_s`` with a
time to live of ``ttl_s``. A replica is live while that key exists: a dead replica's figures
and head are ignored at once, and the next heartbeat of any replica garbage-collects them.
The heartbeat also reads the shared registry's version, and warns once when another process
beats under this replica's id.

While the shared state is down the heartbeat tries to resync instead: heartbeat, seed the
shared registry or replay the admin changes made meanwhile, adopt the shared registry,
re-publish every figure, read the others' view, and only then mark the shared state up. A
heartbeat that finds Redis empty (restarted) or its own key expired (a stall) resyncs too.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from stack.prefill_router import shared_scripts as lua
from stack.prefill_router.shared_bookings import SharedBookings
from stack.prefill_router.shared_connection import SharedConnection
from stack.prefill_router.shared_registry import SharedRegistry

log = logging.getLogger("stack.router.shared")


class SharedHeartbeat:
    """This replica's heartbeat, and the resync that brings its shared state up."""

    def __init__(
        self,
        conn: SharedConnection,
        registry: SharedRegistry,
        bookings: SharedBookings,
        *,
        heartbeat_s: float,
        ttl_s: float,
    ) -> None:
        self.conn = conn
        self.registry = registry
        self.bookings = bookings
        self.heartbeat_s = heartbeat_s
        self.ttl_ms = max(1, int(ttl_s * 1000))
        self._script = conn.r.register_script(lua.HEARTBEAT)
        self._dup_warned = False

    async def resync(self, seed: bool = False) -> None:
        """(Re)connect: heartbeat, replay admin changes made while down (or seed the registry
        when Redis has none), adopt the shared registry, re-publish every figure, read the
        others'."""
        conn = self.conn
        alive, _, exists, dup = await self._beat(warn=False)
        await self.registry.catch_up(seed or not int(exists))
        self.bookings.forget_all()
        conn.up = True
        await self.registry.reload()
        if not conn.up:
            raise ConnectionError("registry read failed")
        await self.bookings.flush()
        if not conn.up:
            raise ConnectionError("publish failed")
        await conn.refresh()  # the others' figures, and their link counters to learn from
        if not conn.up:
            raise ConnectionError("read failed")
        conn.resynced()

    async def _beat(self, warn: bool = True):
        conn = self.conn
        alive, wver, exists, dup = await conn.call(
            self._script(args=[conn.ns, conn.rid, self.ttl_ms, conn.token])
        )
        if warn and int(dup) and not self._dup_warned:  # (at a resync: our own earlier life)
            self._dup_warned = True
            log.warning("another router beats under replica id %r: give each replica its own id", conn.rid)
        return alive, wver, exists, dup

    async def loop(self) -> None:
        """Beat every ``heartbeat_s`` while up; try to resync while down."""
        conn = self.conn
        while True:
            await asyncio.sleep(self.heartbeat_s)
            if not conn.up:
                try:
                    await self.resync()
                except Exception as e:  # noqa: BLE001
                    conn.up = False
                    log.debug("shared state still down: %s", type(e).__name__)
                continue
            try:
                alive, wver, exists, dup = await self._beat()
            except Exception as e:  # noqa: BLE001
                conn.down("heartbeat", e)
                continue
            if not int(exists) or not int(alive):
                # Redis restarted empty, or our heartbeat expired (stall): publish everything again
                log.info(
                    "shared state: %s; resyncing",
                    "Redis came back empty" if not int(exists) else "heartbeat had expired",
                )
                conn.down("resync", None)
                with contextlib.suppress(Exception):
                    await self.resync()
                continue
            try:
                if self.registry.behind(wver):
                    await self.registry.reload()
            except Exception as e:  # noqa: BLE001 - the loop must outlive any one bad reply
                log.exception("shared state: registry reload failed")
                conn.down("reload", e)

    async def leave(self) -> None:
        """A clean exit: this replica stops being live at once rather than after the TTL."""
        await self.conn.call(self.conn.r.delete(f"{self.conn.ns}:hb:{self.conn.rid}"))
