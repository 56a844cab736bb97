"""One queue order across router replicas: the heads they exchange.

With ``router.dispatch.replica_mode: claims`` (the default with Redis) each replica keeps its
own waiting requests and publishes, in ``ns:heads``, the rank of the one it would release
next (:meth:`~stack.dispatch.Dispatcher.rank`, on the replicas' shared clock). A replica
releases only while fewer live replicas rank before it than instances are ready
(:meth:`SharedHeads.may_release`): the ready instances go to the most urgent requests of the
whole cluster, as with one queue.

The ranks are exchanged every ``flush_s`` while requests wait, and at once when this
replica's rank changes; each exchange also reads the other replicas' figures (the view), so
the dispatch queue's readiness sees them while no routing reads them. Ranks that have kept
this replica waiting for ``head_stale_s`` without moving (their replica sees no ready
instance, or stalls) stop holding it back. A dead replica's rank is ignored once its heartbeat
expired, and dropped from Redis by the next heartbeat of any replica. The dispatch queue's
side is :class:`stack.prefill_router.queue_replicas.ClaimedRelease`; :class:`SharedHeads` is
its :class:`~stack.prefill_router.queue_replicas.Replicas`.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import Callable

from stack.prefill_router import shared_scripts as lua
from stack.prefill_router.shared_connection import SharedConnection
from stack.prefill_router.shared_view import Snapshot, parse_view

#: a release's rank on the replicas' shared clock
Rank = tuple[int, float, float]


class SharedHeads:
    """This replica's head, the other live replicas' heads, and the exchange of both."""

    def __init__(self, conn: SharedConnection, *, flush_s: float, head_stale_s: float) -> None:
        self.conn = conn
        self.flush_s = flush_s
        self.head_stale_s = head_stale_s
        self._script = conn.r.register_script(lua.HEADS)
        #: replica_mode claims (the dispatch queue's :meth:`subscribe`): exchange heads
        self.heads_on = False
        #: the dispatch queue holds requests: read the others' figures every ``flush_s`` (its
        #: readiness needs them while no routing reads them), in either replica mode
        self.view_wanted = False
        self._head: Rank | None = None  # this replica's, on the shared clock
        self._head_sent: Rank | None = None
        self._head_changed = asyncio.Event()
        #: the other live replicas' heads: replica -> key
        self.others_heads: dict[str, Rank] = {}
        #: (the heads ranked before ours, since when) while they keep this replica waiting
        self._blocked: tuple[frozenset, float] | None = None
        self._read_at = -math.inf  # when the view was last read (monotonic)
        #: called after each exchange of heads (the queue's pump)
        self.on_heads: list[Callable[[], None]] = []

    # -- the dispatch queue's side ----------------------------------------------------------------
    def subscribe(self, poke: Callable[[], None], claims: bool) -> None:
        """The dispatch queue's hook: ``poke`` runs after each exchange of heads; ``claims``
        (replica_mode claims): this replica publishes the rank of its next release."""
        self.on_heads.append(poke)
        if claims:
            self.heads_on = True

    def want_view(self, on: bool) -> None:
        """Read the others' figures every ``flush_s`` while ``on`` (requests wait here)."""
        self.view_wanted = on

    def set_head(self, key: Rank | None) -> None:
        """This replica's next release ranks ``key`` (on the replicas' shared clock: wall
        seconds), or it has nothing to release (None); published soon."""
        if not self.heads_on:
            return
        if key != self._head:
            self._head = key
            if key != self._head_sent:
                self._head_changed.set()

    def fresh(self) -> bool:
        """Whether this replica read the shared view (the others' heads and figures) within
        ``flush_s``; otherwise it asks for a read (:attr:`on_heads` runs when it is done).
        True while Redis is down (local state only)."""
        if not self.conn.up or time.monotonic() - self._read_at < self.flush_s:
            return True
        self.view_wanted = True
        self._head_changed.set()
        return False

    def may_release(self, key: Rank, n_ready: int) -> bool:
        """Whether this replica may release its head ranked ``key`` now: fewer live
        replicas hold a head ranked before it than ``n_ready`` instances are ready. Heads
        that have kept this replica waiting for ``head_stale_s`` without moving stop
        counting (their replica sees no ready worker, or stalls). Always True while Redis
        is down."""
        if not self.conn.up or not self.others_heads:
            self._blocked = None
            return True
        ahead = frozenset((rid, k) for rid, k in self.others_heads.items() if k < key)
        if len(ahead) < n_ready:
            self._blocked = None
            return True
        now = time.monotonic()
        if self._blocked is None or self._blocked[0] != ahead:
            self._blocked = (ahead, now)
            return False
        return now - self._blocked[1] >= self.head_stale_s

    # -- the shared state's side ------------------------------------------------------------------
    def apply(self, snap: Snapshot) -> None:
        """A view was read: the others' heads as of now."""
        self.others_heads = snap.heads
        self._read_at = time.monotonic()

    def reset(self) -> None:
        """Redis is down: no other head counts, and ours is published again after the resync."""
        self.others_heads = {}
        self._head_sent = None

    async def loop(self) -> None:
        """Exchange heads when ours changes, or every ``flush_s`` while there is one to
        publish or the view is wanted."""
        while True:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._head_changed.wait(), self.flush_s)
            self._head_changed.clear()
            if not self.conn.up:
                continue
            if self._head is None and self._head_sent is None and not self.view_wanted:
                self.others_heads = {}  # nothing to publish, nothing to decide
                continue
            try:
                await self._exchange()
            except Exception as e:  # noqa: BLE001
                self.conn.down("heads", e)
                self.others_heads = {}

    async def _exchange(self) -> None:
        """Publish this replica's head (none unless ``heads_on``), read the others' heads and
        figures."""
        conn = self.conn
        head = self._head
        seq = conn.next_seq()
        value = "-" if head is None else f"{seq} {head[0]} {head[1]!r} {head[2]!r}"
        view = await conn.call(self._script(args=[conn.ns, conn.rid, seq, value]))
        self._head_sent = head
        conn.apply(parse_view(view))
        for cb in self.on_heads:
            cb()

    async def leave(self) -> None:
        """A clean exit: this replica's rank leaves at once."""
        await self.conn.call(self.conn.r.hdel(f"{self.conn.ns}:heads", self.conn.rid))
