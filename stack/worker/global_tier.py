"""The engine's global KV tier: a Mooncake store (or the LMCache adapter,
:mod:`stack.worker.lmcache_tier`) that prefill and colocated workers read prefix pages back
from and write their newly computed pages to.

Keys are the router's block hashes (:mod:`stack.kv_tier.hashing`), so the router can ask the
store what it holds; values are the pages' emulated KV bytes (:mod:`stack.worker.kvbytes`),
checked on the way back. Every call runs on the tier's own threads, bounded by
``store_timeout_s``; after a failure the tier is skipped (a miss, no write) for
``store_retry_s``, as HiCache's storage backend degrades to the local tiers when its store is
gone. Real I/O takes the time it takes; the link time of a read is modelled on top when
``model_fetch_time`` is set.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
from collections.abc import Sequence
from typing import Any

from stack.core.cost_model import Hardware
from stack.kv_tier.hashing import block_hashes
from stack.worker import kvbytes
from stack.worker.link import make_link
from stack.worker.request import Counters, Req
from stack.worker.settings import WorkerSettings

log = logging.getLogger("stack.worker")


class StoreUnavailable(RuntimeError):
    """The global tier is skipped for a while after a failed or timed-out call."""


def log_store_error(ex: BaseException, op: str, rid: str) -> None:
    if isinstance(ex, StoreUnavailable):
        log.debug("global-tier %s skipped for %s: %s", op, rid, ex)
    elif isinstance(ex, asyncio.TimeoutError | TimeoutError):
        log.warning("global-tier %s timed out for %s", op, rid)
    else:
        log.warning("global-tier %s failed for %s: %s", op, rid, ex)


#: the longest wait between two tries to reach mooncake_master at start-up
CONNECT_BACKOFF_MAX_S = 8.0


async def _connect_waiting(connect, master: str):
    """``connect()`` in a thread until it succeeds: a worker started while ``mooncake_master``
    is down (or still starting) waits for it, trying again after 1, 2, 4, then every 8 s,
    instead of exiting; it is not ready (``/health``) meanwhile."""
    from stack.kv_tier.mooncake_store import MooncakeError

    delay = 1.0
    while True:
        try:
            return await asyncio.to_thread(connect)
        except MooncakeError as ex:
            log.warning(
                "mooncake_master %s not reachable (%s): waiting for it, next try in %.0f s", master, ex, delay
            )
        await asyncio.sleep(delay)
        delay = min(delay * 2, CONNECT_BACKOFF_MAX_S)


def leading_run(exist: Sequence[bool]) -> int:
    """How many of the pages asked about are present before the first missing one."""
    g = 0
    while g < len(exist) and exist[g]:
        g += 1
    return g


class GlobalTier:
    """The store client of one worker (``store`` stays None when the worker has no global tier)."""

    def __init__(self, s: WorkerSettings, hw: Hardware, counters: Counters):
        self.s = s
        self.hw = hw
        self.c = counters
        self.store: Any = None
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._down_until = 0.0
        #: the modelled link its fetches queue on (model_fetch_time): its own, or one shared
        #: through ``link_file`` with the workers given the same file (stack/worker/link.py)
        self.link = make_link(s.link_file)

    async def open(self) -> None:
        """Connect the store a prefill or colocated worker is configured with (LMCache sidecar:
        docs/research/lmcache.md, or a Mooncake master)."""
        s = self.s
        if s.lmcache_url and s.mode in ("prefill", "colocated"):
            from stack.worker.lmcache_tier import LMCacheStore

            self.store = LMCacheStore(s.lmcache_url, s.page_size, s.kv_bytes_per_token)
            self._pool = concurrent.futures.ThreadPoolExecutor(4, thread_name_prefix="store")
        elif s.mooncake_master and s.mode in ("prefill", "colocated"):
            from stack.kv_tier.mooncake_store import MooncakeStore, StoreConfig

            cfg = StoreConfig(
                master=s.mooncake_master,
                metadata=s.mooncake_metadata,
                local_host=s.host,
                global_segment_bytes=s.store_segment_bytes,
            )
            self.store = await _connect_waiting(lambda: MooncakeStore(cfg).connect(), s.mooncake_master)
            self._pool = concurrent.futures.ThreadPoolExecutor(4, thread_name_prefix="store")

    async def close(self) -> None:
        if self.store is not None:
            await asyncio.to_thread(self.store.close)
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)

    def keys(self, tokens: list[int]) -> list[str]:
        """Global-tier keys: the router's block hashes (``stack.kv_tier.hashing``), so the router
        can ask the store what it holds (``global_index.MooncakeExistence``'s default key)."""
        keys = [kvbytes.store_key(self.s.store_key_prefix, h) for h in block_hashes(tokens, self.s.page_size)]
        keys_for = getattr(self.store, "keys_for", None)  # LMCache's tier maps keys to tokens
        return keys_for(tokens, keys) if keys_for is not None else keys

    async def call(self, fn, *args):
        """One global-tier call on the store's own threads, bounded by ``store_timeout_s``. After a
        failure the store is skipped (a miss, no write) for ``store_retry_s``, as HiCache's
        storage backend degrades to the local tiers when its store is gone."""
        if time.monotonic() < self._down_until:
            raise StoreUnavailable("global tier skipped after a recent failure")
        loop = asyncio.get_running_loop()
        try:
            return await asyncio.wait_for(loop.run_in_executor(self._pool, fn, *args), self.s.store_timeout_s)
        except Exception:
            self._down_until = time.monotonic() + self.s.store_retry_s
            raise

    def failed(self, ex: BaseException, op: str, rid: str) -> None:
        """Count and log a failed (or skipped) global-tier call."""
        self.c.store_errors += 1
        log_store_error(ex, op, rid)

    async def read(self, req: Req, c: int, limit: int) -> int:
        """Read back the pages ``c..limit`` of ``req`` that the tier holds (the leading run of
        present keys), verify their bytes (stopping at the first bad page) and, with
        ``model_fetch_time``, wait their modelled link time behind the transfers already queued
        on the link (:meth:`link_wait`). Returns how many pages came back
        good; raises on a failed call."""
        ps = self.s.page_size
        keys = req.store_keys[c:limit]
        exist = await self.call(self.store.batch_is_exist, keys)
        g = leading_run(exist)
        if g:
            vals = await self.call(self.store.get_many, keys[:g])
            pb = ps * self.s.kv_bytes_per_token
            ok = 0
            for k, v in enumerate(vals):  # verify what came back; stop at the first bad page
                if v is None or v != kvbytes.page_bytes(req.hashes[c + k], pb):
                    break
                ok += 1
            g = ok
            self.c.store_fetch_bytes += ok * pb
            if g and self.s.model_fetch_time:
                link = self.hw.link_tokens_per_s(self.s.shared_nic)
                await asyncio.sleep(self.link_wait(time.monotonic(), g * ps / link * self.s.time_factor))
        return g

    def link_wait(self, now: float, seconds: float) -> float:
        """Queue a modelled transfer of ``seconds`` (wall) on this worker's link at ``now``
        and return how long it waits until it is through: the link is one FIFO at its full
        bandwidth, so concurrent fetches queue behind each other (as the simulator's
        :class:`stack.sim.instance.Link` and the router's accounting,
        :meth:`stack.pool.Worker.fetch_booked`); shared with the workers given the same
        ``link_file``."""
        return self.link.push(now, seconds) - now

    async def write(self, req: Req) -> None:
        """Write the request's newly computed full pages that the global tier lacks
        (content-addressed). Its hit pages are skipped: fetched from the tier, or computed here
        before and written then (HiCache's write-through of new pages). No-op without a store."""
        if self.store is None:
            return
        t0 = time.monotonic()
        pb = self.s.page_size * self.s.kv_bytes_per_token
        skip = req.local_pages + req.global_pages
        keys = req.store_keys[skip:]
        vals = [kvbytes.page_bytes(h, pb) for h in req.hashes[skip : len(req.store_keys)]]
        try:
            n = await self.call(self.store.put_many, keys, vals)
            req.store_written_pages = n
            self.c.store_write_pages += n
            self.c.store_write_bytes += n * pb
        except Exception as ex:
            self.failed(ex, "write", req.rid)
        req.store_write_s = time.monotonic() - t0
