"""Shared state of router replicas through Redis (``router.redis_url``).

Several router processes in front of one pool share two things:

- **dispatch accounting**: each replica publishes, per prefill worker, its own in-flight
  prefill work (queued tokens, queued seconds, requests whose prefill is not done). A
  replica's routing view is its own accounting plus the other *live* replicas' published
  figures (a replica is live while its heartbeat key, refreshed every ``redis_heartbeat_s``,
  has not expired after ``redis_ttl_s``; a dead replica's figures are ignored at once and
  garbage-collected by the next heartbeat of any replica).
- **the global-tier links**: with its figures, each replica publishes the seconds of fetches
  it has booked on the worker's link so far (:attr:`stack.pool.worker.BookedLink.booked`, a
  counter that only grows). A read sums the other live replicas' counters, and what they
  grew by since the last read is queued on this replica's FIFO of that link, behind its own
  fetches: each replica's view of a link carries every replica's fetches on it, learned a
  read late, as the simulator's one link does.
- **the worker registry**: admin add/remove on any replica is written to Redis and applied
  by the others (a registry version is read with every heartbeat and every routing read).

No double-booking of an idle instance: routing reads the others' figures and a per-worker
booking version (one round trip, a Lua script), runs the policy, then *claims* the chosen
worker with a compare-and-set on that version which also writes the replica's new figures
for the worker (a second round trip). If another replica (or a concurrent request of this
one: claims in flight count in the local view) booked the same worker in between, the
claim fails and returns a fresh view; the policy runs again (at most ``_MAX_CLAIMS`` times, then the last choice is booked anyway).
Completions (prefill done, answer ended) are published by a flusher every
``redis_flush_s``; late publication only over-states a load, never hides one. Every value
carries the replica's sequence number, so a late write never overwrites a newer one.

**One queue order across replicas** (``router.dispatch.replica_mode: claims``, the default
with Redis): each replica keeps its own waiting requests, and publishes the rank of the one
it would release next (:meth:`~stack.dispatch.Dispatcher.rank`) in ``ns:heads``. A replica
releases only while fewer live replicas rank before it than instances are ready
(:meth:`SharedState.may_release`), so the ready instances go to the most urgent requests
cluster-wide, as with one queue. Every read of the view (routing's, and the exchange that
runs every ``redis_flush_s`` while requests wait and at once when this replica's rank
changes) returns the other live replicas' ranks with their figures. Ranks that have kept a
replica waiting for ``head_stale_s`` without moving (their replica sees no ready instance,
or stalls) stop holding it back; a dead replica's rank is ignored once its heartbeat
expired and dropped by the next heartbeat of any replica, like its figures.

Losing Redis never fails or blocks a request for longer than ``redis_timeout_s``: the
first failed call marks shared state down, routing then uses local state only, and a
background task pings Redis; when it answers, the replica replays the admin changes it
made meanwhile, re-publishes all its figures, re-reads the registry, and marks it up
(``/health`` ``shared_state``, gauge ``smetric_shared_state_up``).

Keys (``ns`` = ``router.redis_namespace``): ``ns:hb:<replica>`` (heartbeat, PX TTL),
``ns:replicas`` (set), ``ns:heads`` (hash ``<replica>`` -> ``seq tier key arrival``),
``ns:acct`` (hash ``<replica>\\t<role>|<url>`` -> ``seq tokens seconds running fetched``),
``ns:ver`` (hash ``<role>|<url>`` -> booking version), ``ns:workers`` (hash
``<role>|<url>`` -> JSON spec), ``ns:workers_ver``. Single Redis (the scripts build
key names, so not Redis Cluster). The scripts are in
:mod:`stack.prefill_router.shared_scripts`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import secrets
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import orjson

from stack.pool import Worker, WorkerRegistry
from stack.pool.worker import BookedLink
from stack.prefill_router import shared_scripts as lua

log = logging.getLogger("stack.router.shared")

_MAX_CLAIMS = 4


def wkey(w: Worker) -> str:
    return f"{w.role}|{w.url}"


def spec_of(w: Worker) -> dict:
    return {
        "role": w.role,
        "url": w.url,
        "bootstrap_port": w.bootstrap_port,
        "kv_events": w.kv_events,
        "kv_topic": w.kv_topic,
        "kv_replay": w.kv_replay,
        "draining_until": w.draining_until,
    }


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


@dataclass(slots=True)
class Snapshot:
    """The other live replicas' figures per worker key, and the booking versions."""

    others: dict[str, tuple[int, float, int]]
    versions: dict[str, int]
    workers_ver: int
    #: the other live replicas' heads (replica_mode claims): replica -> rank
    heads: dict[str, tuple[int, float, float]] = field(default_factory=dict)
    #: per worker key, the wall seconds of global-tier fetches the other live replicas have
    #: booked on its link since they started (a sum of counters that only grow)
    links: dict[str, float] = field(default_factory=dict)


def _s(x) -> str:
    return x.decode() if isinstance(x, bytes | bytearray) else str(x)


def _parse_view(reply) -> Snapshot:
    wver, flat, vers, hflat = reply
    others, links = {}, {}
    for i in range(0, len(flat), 5):
        k = _s(flat[i])
        others[k] = (
            int(float(_s(flat[i + 1]))),
            float(_s(flat[i + 2])),
            int(float(_s(flat[i + 3]))),
        )
        links[k] = float(_s(flat[i + 4]))
    versions = {_s(vers[i]): int(_s(vers[i + 1])) for i in range(0, len(vers), 2)}
    heads = {}
    for i in range(0, len(hflat), 2):
        parts = _s(hflat[i + 1]).split()
        if len(parts) == 4:
            heads[_s(hflat[i])] = (int(parts[1]), float(parts[2]), float(parts[3]))
    return Snapshot(others, versions, int(_s(wver)), heads, links)


class SharedState:
    """One replica's connection to the shared state. All methods are safe to call while Redis
    is down: they then do nothing (routing runs on local state)."""

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
        self.url = url
        self.reg = registry
        self.ns = namespace
        self.rid = (replica_id or default_replica_id()).replace("\t", " ")
        self.timeout_s = timeout_s
        self.heartbeat_s = heartbeat_s
        self.ttl_ms = max(1, int(ttl_s * 1000))
        self.flush_s = flush_s
        #: wall seconds per second of the pool (router.time_factor): the links' FIFOs run on
        #: the pool's clock, what replicas publish of them is in wall seconds
        self.time_factor = time_factor
        #: per link, the others' booked seconds (wall) already queued on it
        self._links_seen: dict[BookedLink, float] = {}
        self.r = one_try_client(url, timeout_s, asyncio=True)
        self._read = self.r.register_script(lua.READ)
        self._claim = self.r.register_script(lua.CLAIM)
        self._publish = self.r.register_script(lua.PUBLISH)
        self._heartbeat = self.r.register_script(lua.HEARTBEAT)
        self._registry = self.r.register_script(lua.REGISTRY)
        #: called with a worker the shared registry says drains, and the drain's deadline
        #: (stack/prefill_router/worker_drain.py); None: ignored
        self.on_drain: Callable[[Worker, float], None] | None = None
        self._heads = self.r.register_script(lua.HEADS)
        #: replica_mode claims (the dispatch queue's :meth:`subscribe`): exchange heads (see the
        #: module docstring)
        self.heads_on = False
        #: the dispatch queue holds requests: read the others' figures every ``flush_s`` (its
        #: readiness needs them while no routing reads them), in either replica mode
        self.view_wanted = False
        self.head_stale_s = head_stale_s
        self._head: tuple[int, float, float] | None = None  # this replica's, on the shared clock
        self._head_sent: tuple[int, float, float] | None = None
        self._head_changed = asyncio.Event()
        #: the other live replicas' heads: replica -> key
        self.others_heads: dict[str, tuple[int, float, float]] = {}
        #: (the heads ranked before ours, since when) while they keep this replica waiting
        self._blocked: tuple[frozenset, float] | None = None
        self._read_at = -math.inf  # when the view was last read (monotonic)
        #: called after each exchange of heads (the queue's pump)
        self.on_heads: list = []
        self.up = False
        self._seq = int(time.time() * 1000) * 1000  # monotonic across restarts of this replica
        self._token = secrets.token_hex(8)  # tells two processes configured with one replica id apart
        self._dup_warned = False
        self._pending: dict[str, list] = {}  # claims in flight: wkey -> [tokens, seconds, running]
        self._published: dict[str, tuple] = {}  # wkey -> figures last written
        self._ops: list[tuple[str, str, dict]] = []  # admin changes made while Redis was down
        self._need_seed = False  # configured workers not yet added to the shared registry
        self._workers_ver = -1
        self._reload: asyncio.Task | None = None
        self._tasks: list[asyncio.Task] = []
        self.stats = {"conflicts": 0, "errors": 0, "resyncs": 0, "claims": 0}
        self._gauge = self._conflicts = None
        if metrics_registry is not None:
            from prometheus_client import Counter, Gauge

            self._gauge = Gauge(
                "smetric_shared_state_up",
                "1 while the replicas' Redis shared state is reachable",
                registry=metrics_registry,
            )
            self._conflicts = Counter(
                "smetric_shared_claim_conflicts",
                "claims retried because another booking won",
                registry=metrics_registry,
            )
            self._gauge.set(0)

    # -- lifecycle ----------------------------------------------------------------------------
    async def start(self) -> None:
        """Connect (if Redis answers; otherwise keep trying in the background), add this
        replica's configured workers to the shared registry, adopt the shared registry."""
        with contextlib.suppress(Exception):
            await self._resync(seed=True)
        loop = asyncio.get_running_loop()
        self._tasks = [
            loop.create_task(self._heartbeat_loop()),
            loop.create_task(self._flush_loop()),
            loop.create_task(self._heads_loop()),
        ]

    async def stop(self) -> None:
        for t in self._tasks + ([self._reload] if self._reload else []):
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        self._tasks = []
        if self.up:  # leave at once rather than after the TTL
            with contextlib.suppress(Exception):
                await self._call(self.r.delete(f"{self.ns}:hb:{self.rid}"))
                await self._call(self.r.hdel(f"{self.ns}:heads", self.rid))
        with contextlib.suppress(Exception):
            await self.r.aclose()

    def info(self) -> dict:
        return {"up": self.up, "replica": self.rid, **self.stats}

    # -- plumbing -----------------------------------------------------------------------------
    async def _call(self, coro):
        return await asyncio.wait_for(coro, self.timeout_s * 2 + 0.05)

    def _down(self, where: str, e: BaseException | None) -> None:
        if e is not None:
            self.stats["errors"] += 1
            if self.up:
                log.warning("shared state down (%s: %s): routing on local state", where, type(e).__name__)
        self.up = False
        self.others_heads = {}
        self._head_sent = None  # published again after the resync
        if self._gauge is not None:
            self._gauge.set(0)
        for w in self.reg.workers.values():
            w.shared_tokens, w.shared_seconds, w.shared_running = 0, 0.0, 0
        self._links_seen = {}  # what the others book meanwhile is not learned: start afresh

    def _figures(self, w: Worker) -> tuple[int, float, int, float]:
        p = self._pending.get(wkey(w))
        t, s, r = w.queued_tokens, w.queued_seconds, len(w.queued)
        if p:
            t, s, r = t + p[0], s + p[1], r + p[2]
        return t, s, r, w.link.booked * self.time_factor

    def _value(self, fig: tuple[int, float, int, float], seq: int) -> str:
        s = fig[1] if math.isfinite(fig[1]) else 0.0
        return f"{seq} {fig[0]} {s!r} {fig[2]} {fig[3]!r}"

    def _learn_links(self, seen: dict[BookedLink, float]) -> None:
        """Queue on each link the fetches the other replicas booked on it since the last read
        (``seen``: their counters' sum now, wall seconds), behind this replica's own: one FIFO
        for one link. The first read of a link (and the first after Redis was down) only takes
        the counters as they are; a counter that fell (its replica died or restarted) is taken
        as it is now."""
        now = time.monotonic() / self.time_factor
        for link, total in seen.items():
            before = self._links_seen.get(link)
            if before is not None and total > before:
                link.push(now, (total - before) / self.time_factor)
        self._links_seen = seen

    def _next_seq(self) -> int:
        self._seq += 1
        return self._seq

    def apply(self, snap: Snapshot) -> None:
        """Set each local worker's view of the other replicas' figures, plus this replica's
        claims in flight (concurrent requests here must see them too)."""
        others, links = snap.others, snap.links
        self.others_heads = snap.heads
        self._read_at = time.monotonic()
        pending = self._pending
        fetched: dict[BookedLink, float] = {}  # the others' link counters, per link
        for w in self.reg.workers.values():
            k = wkey(w)
            t, s, r = others.get(k, (0, 0.0, 0))
            p = pending.get(k)
            if p:
                t, s, r = t + p[0], s + p[1], r + p[2]
            w.shared_tokens, w.shared_seconds, w.shared_running = t, s, r
            if w.role == "prefill":
                # a host's link is published under each of its workers: the same counters
                total = links.get(k, 0.0)
                if fetched.get(w.link, -1.0) < total:
                    fetched[w.link] = total
        self._learn_links(fetched)
        if snap.workers_ver != self._workers_ver and (self._reload is None or self._reload.done()):
            self._reload = asyncio.get_running_loop().create_task(self._reload_registry())

    # -- the routing path -----------------------------------------------------------------------
    async def refresh(self) -> Snapshot | None:
        """Read the others' figures into the workers; None while Redis is down."""
        if not self.up:
            return None
        try:
            snap = _parse_view(await self._call(self._read(args=[self.ns, self.rid])))
        except Exception as e:  # noqa: BLE001 - any Redis failure: local state only
            self._down("read", e)
            return None
        self.apply(snap)
        return snap

    async def claim(
        self,
        w: Worker,
        tokens: int,
        seconds: float,
        snap: Snapshot,
        attempt: int = 1,
        deadline: float | None = None,
    ) -> Snapshot | None:
        """Book ``w`` if nobody booked it since ``snap`` (unconditionally from the
        ``_MAX_CLAIMS``-th attempt on, or once ``deadline`` (monotonic) has passed, so a slow
        Redis cannot hold a request for several round trips): None when booked (or Redis
        down), else a fresh snapshot (already applied) to choose again with. The caller must
        account the dispatch locally before its next await."""
        force = attempt >= _MAX_CLAIMS or (deadline is not None and time.monotonic() > deadline)
        if not self.up:
            return None
        k = wkey(w)
        p = self._pending.setdefault(k, [0, 0.0, 0])
        p[0] += tokens
        p[1] += seconds
        p[2] += 1
        w.shared_tokens += tokens
        w.shared_seconds += seconds
        w.shared_running += 1
        try:
            seq = self._next_seq()
            value = self._value(self._figures(w), seq)
            expected = -1 if force else snap.versions.get(k, 0)
            reply = await self._call(self._claim(args=[self.ns, self.rid, k, expected, seq, value]))
        except Exception as e:  # noqa: BLE001
            self._down("claim", e)
            return None
        finally:
            p[0] -= tokens
            p[1] -= seconds
            p[2] -= 1
            if p[2] <= 0:
                self._pending.pop(k, None)
            w.shared_tokens = max(0, w.shared_tokens - tokens)
            w.shared_seconds = max(0.0, w.shared_seconds - seconds)
            w.shared_running = max(0, w.shared_running - 1)
            # the claim may have written figures (even if cancelled): let the flusher rewrite them
            self._published.pop(k, None)
        self.stats["claims"] += 1
        if int(reply[0]) == 1:
            return None
        self.stats["conflicts"] += 1
        if self._conflicts is not None:
            self._conflicts.inc()
        fresh = _parse_view(reply[1])
        self.apply(fresh)
        return fresh

    # -- one queue order (replica_mode claims) ---------------------------------------------------
    # (the dispatch queue's side: stack.prefill_router.queue_replicas.Replicas)
    def subscribe(self, poke: Callable[[], None], claims: bool) -> None:
        """The dispatch queue's hook: ``poke`` runs after each exchange of heads; ``claims``
        (replica_mode claims): this replica publishes the rank of its next release."""
        self.on_heads.append(poke)
        if claims:
            self.heads_on = True

    def want_view(self, on: bool) -> None:
        """Read the others' figures every ``flush_s`` while ``on`` (requests wait here)."""
        self.view_wanted = on

    def set_head(self, key: tuple[int, float, float] | None) -> None:
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
        if not self.up or time.monotonic() - self._read_at < self.flush_s:
            return True
        self.view_wanted = True
        self._head_changed.set()
        return False

    def may_release(self, key: tuple[int, float, float], n_ready: int) -> bool:
        """Whether this replica may release its head ranked ``key`` now: fewer live
        replicas hold a head ranked before it than ``n_ready`` instances are ready. Heads
        that have kept this replica waiting for ``head_stale_s`` without moving stop
        counting (their replica sees no ready worker, or stalls). Always True while Redis
        is down."""
        if not self.up or not self.others_heads:
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

    async def _heads_loop(self) -> None:
        while True:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._head_changed.wait(), self.flush_s)
            self._head_changed.clear()
            if not self.up:
                continue
            if self._head is None and self._head_sent is None and not self.view_wanted:
                self.others_heads = {}  # nothing to publish, nothing to decide
                continue
            try:
                await self._exchange_heads()
            except Exception as e:  # noqa: BLE001
                self._down("heads", e)
                self.others_heads = {}

    async def _exchange_heads(self) -> None:
        """Publish this replica's head (none unless ``heads_on``), read the others' heads and
        figures."""
        head = self._head
        seq = self._next_seq()
        value = "-" if head is None else f"{seq} {head[0]} {head[1]!r} {head[2]!r}"
        view = await self._call(self._heads(args=[self.ns, self.rid, seq, value]))
        self._head_sent = head
        self.apply(_parse_view(view))
        for cb in self.on_heads:
            cb()

    # -- admin ------------------------------------------------------------------------------------
    async def registry_add(self, w: Worker) -> None:
        await self._registry_op("add", wkey(w), spec_of(w))

    async def registry_remove(self, w: Worker) -> None:
        await self._registry_op("remove", wkey(w), {})

    async def _registry_op(self, op: str, k: str, spec: dict) -> None:
        if self.up:
            try:
                await self._call(self._registry(args=[self.ns, op, k, orjson.dumps(spec).decode()]))
                return
            except Exception as e:  # noqa: BLE001
                self._down("registry", e)
        self._ops.append((op, k, spec))  # replayed on resync

    async def _reload_registry(self) -> None:
        """Make the local registry match the shared one."""
        try:
            raw, ver = await self._call(self._pipeline_registry())
        except Exception as e:  # noqa: BLE001
            self._down("registry read", e)
            return
        shared = {}
        for k, v in raw.items():
            try:
                shared[_s(k)] = orjson.loads(v)
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
                self._published.pop(k, None)
                log.info("shared registry: removed %s", k)
        self._workers_ver = int(_s(ver or b"0"))

    async def _pipeline_registry(self):
        async with self.r.pipeline(transaction=True) as pipe:
            pipe.hgetall(f"{self.ns}:workers")
            pipe.get(f"{self.ns}:workers_ver")
            return await pipe.execute()

    # -- background ---------------------------------------------------------------------------
    async def _resync(self, seed: bool = False) -> None:
        """(Re)connect: heartbeat, replay admin changes made while down (or seed the registry
        when Redis has none), adopt the shared registry, re-publish every figure, read the
        others'."""
        alive, _, exists, dup = await self._beat(warn=False)
        if seed or not int(exists):
            # first start, or Redis lost its data: the shared registry is (also) ours
            self._need_seed = True
        if self._need_seed:
            for w in list(self.reg.workers.values()):
                await self._call(
                    self._registry(args=[self.ns, "addnx", wkey(w), orjson.dumps(spec_of(w)).decode()])
                )
            self._need_seed = False
        while self._ops:  # each admin change leaves the queue only once Redis has it
            op, k, spec = self._ops[0]
            await self._call(self._registry(args=[self.ns, op, k, orjson.dumps(spec).decode()]))
            self._ops.pop(0)
        self._published.clear()
        self.up = True
        await self._reload_registry()
        if not self.up:
            raise ConnectionError("registry read failed")
        await self._flush()
        if not self.up:
            raise ConnectionError("publish failed")
        await self.refresh()  # the others' figures, and their link counters to learn from
        if not self.up:
            raise ConnectionError("read failed")
        if self._gauge is not None:
            self._gauge.set(1)
        self.stats["resyncs"] += 1
        log.info("shared state up (replica %s, %s)", self.rid, self.url)

    async def _beat(self, warn: bool = True):
        alive, wver, exists, dup = await self._call(
            self._heartbeat(args=[self.ns, self.rid, self.ttl_ms, self._token])
        )
        if warn and int(dup) and not self._dup_warned:  # (at a resync: our own earlier life)
            self._dup_warned = True
            log.warning("another router beats under replica id %r: give each replica its own id", self.rid)
        return alive, wver, exists, dup

    async def _heartbeat_loop(self) -> None:
        while True:
            await asyncio.sleep(self.heartbeat_s)
            if not self.up:
                try:
                    await self._resync()
                except Exception as e:  # noqa: BLE001
                    self.up = False
                    log.debug("shared state still down: %s", type(e).__name__)
                continue
            try:
                alive, wver, exists, dup = await self._beat()
            except Exception as e:  # noqa: BLE001
                self._down("heartbeat", e)
                continue
            if not int(exists) or not int(alive):
                # Redis restarted empty, or our heartbeat expired (stall): publish everything again
                log.info(
                    "shared state: %s; resyncing",
                    "Redis came back empty" if not int(exists) else "heartbeat had expired",
                )
                self._down("resync", None)
                with contextlib.suppress(Exception):
                    await self._resync()
                continue
            try:
                if int(_s(wver)) != self._workers_ver and (self._reload is None or self._reload.done()):
                    await self._reload_registry()
            except Exception as e:  # noqa: BLE001 - the loop must outlive any one bad reply
                log.exception("shared state: registry reload failed")
                self._down("reload", e)

    async def _flush_loop(self) -> None:
        while True:
            await asyncio.sleep(self.flush_s)
            if self.up:
                try:
                    await self._flush()
                except Exception as e:  # noqa: BLE001
                    log.exception("shared state: publishing failed")
                    self._down("flush", e)

    async def _flush(self) -> None:
        """Publish the figures that changed since last written (and drop removed workers)."""
        args: list = []
        current = {}
        for w in self.reg.workers.values():
            if w.role != "prefill":
                continue
            k = wkey(w)
            fig = self._figures(w)
            current[k] = fig
            if self._published.get(k) != fig:
                args.append(k)
                args.append(fig)
        gone = [k for k in self._published if k not in current]
        if not args and not gone:
            return
        seq = self._next_seq()
        flat: list = [self.ns, self.rid, seq]
        for i in range(0, len(args), 2):
            flat += [args[i], self._value(args[i + 1], seq)]
        for k in gone:
            flat += [k, "-"]
        try:
            await self._call(self._publish(args=flat))
        except Exception as e:  # noqa: BLE001
            self._down("publish", e)
            return
        for i in range(0, len(args), 2):
            self._published[args[i]] = args[i + 1]
        for k in gone:
            self._published.pop(k, None)
