"""The memory of requests refused for their wait, shared by the router replicas in Redis.

The dispatch queue refuses a request for its wait once, not again: its retry is known by its
prompt's fingerprint and waits as long as the bound promises (:mod:`stack.dispatch.refusals`).
A load balancer sends that retry to any replica, so the replicas keep the memory in Redis:
``ns:refused:<tokens>:<last block>`` counts the refusals of that fingerprint not yet retried,
and expires :data:`~stack.dispatch.refusals.READMIT_WINDOW_S` after the latest one.

A replica that refuses a request writes its fingerprint there (:meth:`SharedRefusals.refused`,
in the background: the client's Retry-After is at least a second, the write takes a
millisecond). A replica that admits a request with a fingerprint asks Redis first
(:meth:`SharedRefusals.readmits`, one round trip, only while the queue bounds waits): one
script checks the count and uses one up. While Redis is down each replica knows only its own
refusals (its dispatcher's own :class:`~stack.dispatch.refusals.Refusals`, kept in step).
"""

from __future__ import annotations

import asyncio
from collections.abc import Hashable

from stack.dispatch.refusals import READMIT_WINDOW_S
from stack.prefill_router import shared_scripts as lua
from stack.prefill_router.shared_connection import SharedConnection


def field(key: Hashable) -> str:
    """A fingerprint (``(prompt tokens, last block hash)``) as a Redis key's last part."""
    if isinstance(key, tuple):
        return ":".join(str(k) for k in key)
    return str(key)


class SharedRefusals:
    """One replica's side of the shared memory (see the module docstring). ``time_factor``:
    wall seconds per second of the pool (the window is in the pool's seconds)."""

    def __init__(self, conn: SharedConnection, time_factor: float = 1.0) -> None:
        self.conn = conn
        self.ttl_ms = max(1000, int(READMIT_WINDOW_S * time_factor * 1000))
        self._refused = conn.r.register_script(lua.REFUSED)
        self._readmit = conn.r.register_script(lua.READMIT)
        self._writes: set[asyncio.Task] = set()

    def refused(self, key: Hashable) -> None:
        """A request with fingerprint ``key`` was refused for its wait here: remembered in
        Redis soon (nothing while Redis is down)."""
        if not self.conn.up:
            return
        t = asyncio.get_running_loop().create_task(self._write(key))
        self._writes.add(t)
        t.add_done_callback(self._writes.discard)

    async def _write(self, key: Hashable) -> None:
        conn = self.conn
        try:
            await conn.call(self._refused(args=[conn.ns, field(key), self.ttl_ms]))
        except Exception as e:  # noqa: BLE001 - any Redis failure: local memory only
            conn.down("refused", e)

    async def readmits(self, key: Hashable) -> bool | None:
        """Whether a request with fingerprint ``key`` was refused for its wait by any replica
        within the window (that refusal is then used up); None while Redis is down (the
        replica's own memory decides)."""
        conn = self.conn
        if not conn.up:
            return None
        try:
            return bool(await conn.call(self._readmit(args=[conn.ns, field(key)])))
        except Exception as e:  # noqa: BLE001
            conn.down("readmit", e)
            return None

    async def settle(self) -> None:
        """Wait for the writes in flight (a clean stop, and tests)."""
        await asyncio.gather(*list(self._writes), return_exceptions=True)
