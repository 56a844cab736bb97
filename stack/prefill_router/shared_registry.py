"""The worker registry shared by router replicas.

An admin change (a worker added, removed, or set draining) made on any replica is written to
Redis, in ``ns:workers`` (one JSON spec per worker) with a version in ``ns:workers_ver``, and
the other replicas apply it: the version is read with every heartbeat and every view, and a
new one makes the replica adopt the shared registry. A drain set by another replica is
handed to :attr:`SharedRegistry.on_drain` (``stack/prefill_router/worker_drain.py``).

A replica seeds the shared registry with its configured workers when it starts, and again
when Redis comes back empty. Admin changes made while Redis was down are queued and replayed,
in order, when it answers again.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import orjson

from stack.pool import Worker, WorkerRegistry
from stack.prefill_router import shared_scripts as lua
from stack.prefill_router.shared_bookings import SharedBookings
from stack.prefill_router.shared_connection import SharedConnection
from stack.prefill_router.shared_view import Snapshot, text, wkey

log = logging.getLogger("stack.router.shared")


def spec_of(w: Worker) -> dict:
    """What the shared registry holds of a worker."""
    return {
        "role": w.role,
        "url": w.url,
        "bootstrap_port": w.bootstrap_port,
        "kv_events": w.kv_events,
        "kv_topic": w.kv_topic,
        "kv_replay": w.kv_replay,
        "draining_until": w.draining_until,
    }


class SharedRegistry:
    """Keeps the local worker registry and the shared one in step."""

    def __init__(self, conn: SharedConnection, registry: WorkerRegistry, bookings: SharedBookings) -> None:
        self.conn = conn
        self.reg = registry
        self.bookings = bookings
        self._script = conn.r.register_script(lua.REGISTRY)
        #: called with a worker the shared registry says drains, and the drain's deadline
        #: (stack/prefill_router/worker_drain.py); None: ignored
        self.on_drain: Callable[[Worker, float], None] | None = None
        self._ops: list[tuple[str, str, dict]] = []  # admin changes made while Redis was down
        self._need_seed = False  # configured workers not yet added to the shared registry
        self._ver = -1  # the shared registry's version the local one matches
        self._reload: asyncio.Task | None = None

    # -- admin --------------------------------------------------------------------------------
    async def add(self, w: Worker) -> None:
        """An admin added ``w`` (or set it draining) here: the other replicas follow."""
        await self._op("add", wkey(w), spec_of(w))

    async def remove(self, w: Worker) -> None:
        """An admin removed ``w`` here: the other replicas follow."""
        await self._op("remove", wkey(w), {})

    async def _op(self, op: str, k: str, spec: dict) -> None:
        conn = self.conn
        if conn.up:
            try:
                await conn.call(self._script(args=[conn.ns, op, k, orjson.dumps(spec).decode()]))
                return
            except Exception as e:  # noqa: BLE001
                conn.down("registry", e)
        self._ops.append((op, k, spec))  # replayed on resync

    async def catch_up(self, seed: bool) -> None:
        """At a resync: add the configured workers the shared registry lacks (``seed``: first
        start, or Redis lost its data), then replay the admin changes made while down."""
        conn = self.conn
        if seed:
            # first start, or Redis lost its data: the shared registry is (also) ours
            self._need_seed = True
        if self._need_seed:
            for w in list(self.reg.workers.values()):
                await conn.call(
                    self._script(args=[conn.ns, "addnx", wkey(w), orjson.dumps(spec_of(w)).decode()])
                )
            self._need_seed = False
        while self._ops:  # each admin change leaves the queue only once Redis has it
            op, k, spec = self._ops[0]
            await conn.call(self._script(args=[conn.ns, op, k, orjson.dumps(spec).decode()]))
            self._ops.pop(0)

    # -- following the shared registry ----------------------------------------------------------
    def behind(self, ver) -> bool:
        """Whether the shared registry's version ``ver`` (as Redis answers it) is not the
        local registry's, and no reload is under way."""
        return int(text(ver)) != self._ver and (self._reload is None or self._reload.done())

    def apply(self, snap: Snapshot) -> None:
        """A view was read: reload in the background if the shared registry changed."""
        if self.behind(snap.workers_ver):
            self._reload = asyncio.get_running_loop().create_task(self.reload())

    async def reload(self) -> None:
        """Make the local registry match the shared one."""
        try:
            raw, ver = await self.conn.call(self._read())
        except Exception as e:  # noqa: BLE001
            self.conn.down("registry read", e)
            return
        shared = {}
        for k, v in raw.items():
            try:
                shared[text(k)] = orjson.loads(v)
            except orjson.JSONDecodeError:
                continue
        local = {wkey(w): w for w in self.reg.workers.values()}
        for k, spec in shared.items():
            if k not in local:
                try:
                    local[k] = self.reg.add(
                        spec["role"],
                        spec["url"],
                        spec.get("bootstrap_port"),
                        spec.get("kv_events"),
                        spec.get("kv_topic") or "kv",
                        spec.get("kv_replay"),
                    )
                    log.info("shared registry: added %s", k)
                except (ValueError, KeyError, TypeError) as e:
                    log.warning("shared registry: cannot add %s: %s", k, e)
                    continue
            until = spec.get("draining_until")
            if until is not None and self.on_drain is not None and local[k].draining_until is None:
                self.on_drain(local[k], float(until))  # a replica drains it
        for k, w in list(local.items()):
            if k not in shared:
                self.reg.remove(w.wid)
                self.bookings.forget(k)
                log.info("shared registry: removed %s", k)
        self._ver = int(text(ver or b"0"))

    async def _read(self):
        async with self.conn.r.pipeline(transaction=True) as pipe:
            pipe.hgetall(f"{self.conn.ns}:workers")
            pipe.get(f"{self.conn.ns}:workers_ver")
            return await pipe.execute()

    def cancel(self) -> None:
        """Stop a reload under way (the replica stops)."""
        if self._reload is not None:
            self._reload.cancel()
