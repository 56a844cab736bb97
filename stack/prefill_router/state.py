"""What one router instance holds, and its lifecycle.

:class:`RouterState` builds the components from the deployment config (cost model,
policy, feature extractor, prefix index, global tier, worker pool, metrics, optional
shared state of router replicas, the routing step), starts and stops the background
parts (health checks, KV-event subscribers, HTTP clients, shared state) and keeps the
prefix index, the policy and the subscribers in step with the pool's membership. It
serves no request itself: that is :mod:`stack.prefill_router.api`.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from collections.abc import Callable
from pathlib import Path

import aiohttp
import httpx

from stack.config import DeploymentConfig
from stack.core.cost_model import CostModel, SwitchableCost, load_hardware
from stack.core.types import SLO
from stack.decode_router.handoff import PDForwarder
from stack.decode_router.upstream import make_session
from stack.kv_tier.events import KVEventSubscriber
from stack.kv_tier.global_index import MooncakeExistence, NoGlobalTier, WrittenIndex
from stack.kv_tier.index import PrefixIndex
from stack.policies import PolicyContext, make_policy
from stack.pool import HealthChecker, LoopWatch, Worker, WorkerRegistry
from stack.prefill_router.auth import worker_headers
from stack.prefill_router.drain import Drain
from stack.prefill_router.features import FeatureExtractor
from stack.prefill_router.learned_cost import CostLearner
from stack.prefill_router.metrics import RouterMetrics
from stack.prefill_router.offload import FeaturePool
from stack.prefill_router.queue import LiveQueue
from stack.prefill_router.record import Recorder
from stack.prefill_router.routing import PrefillRouter
from stack.prefill_router.tracing import RouterTracing
from stack.prefill_router.worker_drain import WorkerDrains

log = logging.getLogger("stack.router")


class RouterState:
    """Everything one router instance holds (created per app)."""

    def __init__(
        self, cfg: DeploymentConfig, transport: httpx.AsyncBaseTransport | None = None, global_checker=None
    ):
        self.cfg = cfg
        rc = cfg.router
        self.block_size = cfg.model.page_size
        hw = load_hardware(rc.hardware)
        # router.cost_model learn: one switchable model every user of the cost model holds
        learn = rc.cost_model.mode == "learn"
        self.cost: CostModel = SwitchableCost(hw.cost) if learn else hw.cost  # type: ignore[assignment]
        self.slo = SLO(b=rc.slo.b, a=rc.slo.a_per_1k / 1000.0)
        #: draining (SIGTERM, POST /admin/drain) and the inference requests held
        self.drain = Drain()
        #: the pool's clock (router.time_factor): wall seconds / time_factor, the seconds of the
        #: SLO and the cost model; the dispatch queue's deadlines and waits and the TTFTs fed
        #: back to a learning policy read it
        self.time_factor = rc.time_factor
        self.clock = pool_clock(rc.time_factor)
        #: PD colocation (router.mode): the workers decode what they prefill
        self.colocated = cfg.colocated
        ctx = PolicyContext(
            self.cost, self.slo, self.block_size, colocated=self.colocated, chunk_tokens=hw.chunk_tokens
        )
        self.policy = make_policy(rc.policy, ctx, **rc.policy_params)
        self.policy_name = rc.policy
        self.features = FeatureExtractor(cfg.model.path, self.block_size, rc.token_cache_tokens)
        self.features.context_length = cfg.model.context_length  # refuse early, mid-tokenize
        self.needs_features = self.policy.needs_prompt_features
        self.feature_pool = FeaturePool(  # large or cold bodies' features, off the event loop
            rc.feature_threads,
            inline_bytes=rc.feature_inline_bytes,
            attempt_bytes=rc.feature_attempt_bytes,
            budget_chars=rc.feature_budget_chars,
            max_wait_s=rc.feature_wait_s,
            retry_after_s=rc.retry_after_s,
        )
        self.index = PrefixIndex(
            self.block_size,
            approx_ttl_s=rc.approx_ttl_s,
            approx_capacity_blocks=rc.approx_capacity_tokens // self.block_size,
        )
        self.global_tier = _global_tier(cfg, global_checker)
        self.fetch_tps = rc.fetch_tokens_per_s if rc.global_tier != "none" else 0.0
        self.metrics = RouterMetrics()
        self.tracing = RouterTracing.from_config(rc.tracing)  # router.tracing off: NO_TRACING
        #: router.record: a trace of what this replica serves (off: None)
        self.recorder = _recorder(rc, cfg.model.page_size)
        #: router.cost_model observe | learn: the pool's cost model, learned from prefill answers
        self.learner: CostLearner | None = None
        if rc.cost_model.mode != "static":
            switch = self.cost if isinstance(self.cost, SwitchableCost) else None
            self.learner = CostLearner(hw, rc.cost_model, self.metrics.registry, switch)
        self.registry = WorkerRegistry(rc.eject_cooldown_s, link=rc.link)
        self.registry.on_add.append(self._on_add)
        self.registry.on_remove.append(self._on_remove)
        self.registry.on_eject.append(self._on_eject)
        self.subscribers: dict[int, KVEventSubscriber] = {}
        self.transport = transport
        self.client: httpx.AsyncClient | None = None  # health checks, load polls
        self.session: aiohttp.ClientSession | None = None  # the hot path
        self.fresh_session: aiohttp.ClientSession | None = None  # retries on a new connection
        #: the router's own event-loop stalls: worker failures in one are not counted
        self.watch = LoopWatch()
        self.forwarder: PDForwarder | None = None
        self.health: HealthChecker | None = None
        self.shared = None  # SharedState with router.redis_url (router replicas), else None
        if rc.redis_url:
            from stack.prefill_router.shared_state import SharedState

            self.shared = SharedState(
                rc.redis_url,
                self.registry,
                namespace=rc.redis_namespace,
                replica_id=rc.replica_id,
                timeout_s=rc.redis_timeout_s,
                heartbeat_s=rc.redis_heartbeat_s,
                ttl_s=rc.redis_ttl_s,
                flush_s=rc.redis_flush_s,
                metrics_registry=self.metrics.registry,
                time_factor=rc.time_factor,
            )
            if rc.redis_token_cache and cfg.model.path:
                from stack.prefill_router.shared_tokens import SharedTokens

                self.features.tok.shared = SharedTokens(
                    rc.redis_url,
                    Path(cfg.model.path) / "tokenizer.json",
                    namespace=rc.redis_namespace,
                    ttl_s=rc.redis_token_ttl_s,
                    timeout_s=rc.redis_timeout_s,
                    min_chars=rc.redis_token_min_chars,
                    metrics_registry=self.metrics.registry,
                )
        #: workers draining before they leave the pool (POST /admin/workers/drain); with
        #: replicas, judged idle on fresh figures, once every replica has read the drain
        sh = self.shared
        self.worker_drains = WorkerDrains(
            self.registry,
            self.remove_worker,
            refresh=sh.conn.refresh if sh is not None else None,
            settle_s=rc.redis_heartbeat_s + 2 * rc.redis_flush_s + 0.1 if sh is not None else 0.0,
        )
        if sh is not None:
            sh.registry.on_drain = self.worker_drains.start  # another replica drains a worker
        self.routing, self.queue = self._routing_and_queue(hw)
        self.started = False
        for p in cfg.prefill:
            self.registry.add("prefill", p.url, p.bootstrap_port, p.kv_events, p.kv_topic, p.kv_replay)
        for d in cfg.decode:
            self.registry.add("decode", d.url)
        self.admin_token = os.environ.get(rc.admin_token_env) or None
        #: the workers' keys (router.auth.worker_*_env): on every call, and the admin one on aborts
        self.worker_headers, self.abort_headers = worker_headers(rc.auth)

    def _routing_and_queue(self, hw) -> tuple[PrefillRouter, LiveQueue]:
        """The routing step, and the dispatch queue in front of it (router.dispatch; order
        immediate: the queue's route() is routing's)."""
        rc = self.cfg.router
        routing = PrefillRouter(
            self.registry,
            self.index,
            self.global_tier,
            self.policy,
            self.cost,
            self.block_size,
            self.fetch_tps,
            self.shared,
            decode_cost=hw.decode if self.colocated else None,
            clock=self.clock,
            time_factor=rc.time_factor,
        )
        queue = LiveQueue(
            rc.dispatch.build(),
            routing,
            self.registry,
            self.cost,
            self.slo,
            self.metrics.registry,
            rc.retry_after_s,
            clock=self.clock,
            time_factor=rc.time_factor,
            replicas=self.shared.heads if self.shared is not None else None,
            refusals=self.shared.refusals if self.shared is not None else None,
        )
        return routing, queue

    # -- lifecycle ----------------------------------------------------------------------
    async def start(self) -> None:
        rc = self.cfg.router
        limits = httpx.Limits(max_connections=4096, max_keepalive_connections=1024, keepalive_expiry=60)
        timeout = httpx.Timeout(rc.request_timeout_s, connect=rc.connect_timeout_s)
        kw = {"transport": self.transport} if self.transport is not None else {}
        self.client = httpx.AsyncClient(limits=limits, timeout=timeout, headers=self.worker_headers, **kw)
        self.session = make_session(rc.request_timeout_s, rc.connect_timeout_s, headers=self.worker_headers)
        # a call that met a stale pooled connection is sent once more on a fresh one
        self.fresh_session = make_session(
            rc.request_timeout_s, rc.connect_timeout_s, headers=self.worker_headers, fresh=True
        )
        m = self.metrics
        self.forwarder = PDForwarder(
            self.session,
            self.abort_headers,
            self.fresh_session,
            self.learner,
            m.stale_retries,
            m.stream_errors,
        )
        self.watch.start()
        self.health = HealthChecker(
            self.registry,
            self.client if self.transport is not None else self.session,
            rc.health_interval_s,
            rc.health_timeout_s,
            rc.health_failures,
            rc.load_poll,
            on_tick=self._tick,
            watch=self.watch,
        )
        self.health.start()
        self.started = True
        for w in self.registry.role("prefill"):
            self._subscribe(w)
        if self.shared is not None:
            await self.shared.start()

    async def stop(self) -> None:
        """Let go of everything :meth:`start` took. Each step is bounded (``STOP_STEP_S``): one
        that hangs (a peer that never answers) is logged by name and skipped, so the process
        still exits and the later steps (the recorder's flush) still run."""
        self.queue.close()
        await _step("worker drains", self.worker_drains.stop())
        if self.shared is not None:
            await _step("shared state", self.shared.stop())
        tok = self.features.tok
        if tok is not None and tok.shared is not None:
            await _step("tokenizer cache", asyncio.to_thread(tok.shared.close))
        if self.health:
            await _step("health checks", self.health.stop())
        for wid, s in list(self.subscribers.items()):
            await _step(f"KV events of {wid}", s.stop())
        self.subscribers.clear()
        if self.client:
            await _step("HTTP client", self.client.aclose())
        if self.session:
            await _step("HTTP session", self.session.close())
        if self.fresh_session:
            await _step("HTTP session (fresh)", self.fresh_session.close())
        await _step("loop watch", self.watch.stop())
        self.feature_pool.close()
        if self.tracing.enabled:
            await _step("tracing", asyncio.to_thread(self.tracing.shutdown))  # flushes the exporter
        if self.recorder is not None:
            await _step("recorder", asyncio.to_thread(self.recorder.close))  # writes what is queued

    def _tick(self) -> None:
        self.index.expire()
        self.registry.purge_stale(self.cfg.router.request_timeout_s)

    async def remove_worker(self, w: Worker) -> None:
        """Take ``w`` out of the pool: this replica's registry, and with replicas the shared one."""
        if self.registry.workers.get(w.wid) is w:
            self.registry.remove(w.wid)
        if self.shared is not None:
            await self.shared.registry.remove(w)

    # -- registry callbacks ---------------------------------------------------------------
    def _on_add(self, w: Worker) -> None:
        if w.role == "prefill":
            self.index.add_worker(w.wid, events=bool(w.kv_events))
            if self.started:
                self._subscribe(w)

    def _on_remove(self, w: Worker) -> None:
        if w.role == "prefill":
            self.index.remove_worker(w.wid)
            self.policy.forget(w.wid)
            s = self.subscribers.pop(w.wid, None)
            if s is not None:
                asyncio.get_running_loop().create_task(s.stop())

    def _on_eject(self, w: Worker) -> None:
        self.metrics.ejections.inc()
        if w.role == "prefill":
            self.policy.forget(w.wid)

    def _subscribe(self, w: Worker) -> None:
        if not w.kv_events or w.wid in self.subscribers:
            return
        wid = w.wid
        label = w.url

        def on_batch(batch, wid=wid, label=label):
            stored = self.index.apply(wid, batch)
            if stored:
                self.global_tier.record_written(stored)
            self.metrics.kv_batch(label, batch.ts)

        def on_gap(wid=wid, label=label):  # a gap the worker's replay buffer could not cover
            self.index.drop_worker(wid)
            self.metrics.kv_gaps.labels(label).inc()

        s = KVEventSubscriber(w.kv_events, w.kv_topic, on_batch, on_gap, replay=w.kv_replay)
        s.start()
        self.subscribers[wid] = s


def _global_tier(cfg: DeploymentConfig, global_checker=None):
    """The global KV tier the router asks for hits: none, Mooncake existence checks, the LMCache
    controller's lookup (``global_checker`` then is its lookup callable), or (Mooncake
    unreachable, or ``global_tier: index``) the router's own written index."""
    rc = cfg.router
    if rc.global_tier == "mooncake" and global_checker is None:
        global_checker = _connect_mooncake(cfg)
    if rc.global_tier == "none":
        return NoGlobalTier()
    written = WrittenIndex(max(1, rc.global_capacity_tokens // cfg.model.page_size))
    if rc.global_tier == "lmcache":
        if not rc.lmcache_controller_url:
            log.warning(
                "global_tier=lmcache but no router.lmcache_controller_url: using the router's own index"
            )
            return written
        from stack.kv_tier.lmcache_view import LMCacheLookup, http_lookup

        return LMCacheLookup(
            global_checker or http_lookup(rc.lmcache_controller_url),
            block_size=cfg.model.page_size,
            chunk_size=rc.lmcache_chunk_size,
            timeout_s=rc.global_check_timeout_s,
            fallback=written,
        )
    if rc.global_tier == "mooncake" and global_checker is not None:
        prefix = rc.global_key_prefix
        return MooncakeExistence(
            global_checker,
            key_fn=lambda h: f"{prefix}{h & 0xFFFFFFFFFFFFFFFF:016x}",
            timeout_s=rc.global_check_timeout_s,
        )
    return written


def _connect_mooncake(cfg: DeploymentConfig):
    """A Mooncake store client for existence checks, or None (then the router's own index)."""
    mc = cfg.mooncake
    if mc is None or not mc.master:
        log.warning("global_tier=mooncake but no mooncake.master configured: using the router's own index")
        return None
    try:
        from stack.kv_tier.mooncake_store import MooncakeStore, StoreConfig

        sc = StoreConfig(master=mc.master, metadata=mc.metadata_url or "P2PHANDSHAKE", global_segment_bytes=0)
        return MooncakeStore(sc).connect()
    except Exception as e:  # noqa: BLE001 - optional component
        log.warning("cannot reach the Mooncake store (%s): using the router's own index", type(e).__name__)
        return None


def _recorder(rc, page_size: int) -> Recorder | None:
    """``router.record``'s recorder, named for this replica (``router.replica_id``, else the
    host and process), or None when recording is off."""
    if not rc.record.enabled:
        return None
    return Recorder(
        rc.record, rc.replica_id or f"{socket.gethostname()}-{os.getpid()}", page_size, rc.time_factor
    )


def pool_clock(time_factor: float) -> Callable[[], float]:
    """A monotonic clock in the pool's seconds: wall seconds divided by ``time_factor``
    (router.time_factor; 1 for a real engine)."""
    if time_factor == 1.0:
        return time.monotonic
    return lambda: time.monotonic() / time_factor


#: seconds one step of :meth:`RouterState.stop` may take before it is skipped
STOP_STEP_S = 5.0


async def _step(name: str, aw) -> None:
    """Await one shutdown step, at most ``STOP_STEP_S``; a step that fails or hangs is logged."""
    try:
        await asyncio.wait_for(aw, STOP_STEP_S)
    except TimeoutError:
        log.warning("shutdown: %s did not stop within %.0f s; going on without it", name, STOP_STEP_S)
    except Exception as e:  # noqa: BLE001 - shutting down: the next steps still run
        log.warning("shutdown: %s failed (%s: %s); going on", name, type(e).__name__, e)
