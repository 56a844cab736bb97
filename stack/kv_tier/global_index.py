"""What the global (Mooncake) KV tier holds, seen from the router.

Backends share one small async interface, :class:`GlobalTier`:

- :class:`NoGlobalTier`: no global tier (global hit always 0).
- :class:`WrittenIndex`: the router's own index of what was written there (blocks stored
  on any prefill worker are written through by HiCache), LRU-bounded in blocks.
- :class:`MooncakeExistence`: asks the Mooncake store with one batched existence check
  (``batch_is_exist(keys) -> list[bool]``, e.g. ``stack.kv_tier.mooncake_store``), the
  keys derived from the router's block hashes by a pluggable ``key_fn``; results are
  cached briefly and the call is bounded by a timeout so a slow store never stalls routing.
- :class:`stack.kv_tier.lmcache_view.LMCacheLookup`: asks LMCache's controller (tier LMCache).
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from itertools import takewhile
from typing import Protocol


class ExistenceChecker(Protocol):
    def batch_is_exist(self, keys: list[str]) -> list[bool]: ...


class GlobalTier(Protocol):
    name: str

    async def hit_blocks(self, hashes: list[int], tokens: Sequence[int] | None = None) -> int:
        """Leading blocks of ``hashes`` present in the global tier (``tokens``: the prompt's
        token ids, for a tier that is asked by tokens, e.g. LMCache's controller)."""
        ...

    def record_written(self, hashes: list[int]) -> None: ...


class NoGlobalTier:
    name = "none"

    async def hit_blocks(self, hashes: list[int], tokens: Sequence[int] | None = None) -> int:
        return 0

    def record_written(self, hashes: list[int]) -> None:
        pass


class WrittenIndex:
    name = "written"

    def __init__(self, capacity_blocks: int = 1_000_000) -> None:
        self.capacity = capacity_blocks
        self.lru: OrderedDict[int, None] = OrderedDict()

    def record_written(self, hashes: list[int]) -> None:
        lru = self.lru
        for h in hashes:
            if h in lru:
                lru.move_to_end(h)
            else:
                lru[h] = None
        while len(lru) > self.capacity:
            lru.popitem(last=False)

    def hit_sync(self, hashes: list[int]) -> int:
        """Leading ``hashes`` present (one C-level pass)."""
        return len(list(takewhile(self.lru.__contains__, hashes)))

    async def hit_blocks(self, hashes: list[int], tokens: Sequence[int] | None = None) -> int:
        return self.hit_sync(hashes)

    def __len__(self) -> int:
        return len(self.lru)


def default_key(h: int) -> str:
    return f"{h:016x}"


class MooncakeExistence:
    """Global hits by asking the Mooncake store (batched existence checks)."""

    name = "mooncake"

    def __init__(
        self,
        checker: ExistenceChecker,
        key_fn: Callable[[int], str] = default_key,
        timeout_s: float = 0.02,
        cache_ttl_s: float = 1.0,
        cache_size: int = 4096,
        clock: Callable[[], float] = time.monotonic,
        max_inflight: int = 4,
    ) -> None:
        self.checker = checker
        self.key_fn = key_fn
        self.timeout_s = timeout_s
        self.cache_ttl_s = cache_ttl_s
        self.cache_size = cache_size
        self.clock = clock
        self._cache: OrderedDict[tuple[int, int], tuple[float, int]] = OrderedDict()
        self.timeouts = 0
        self.errors = 0
        # checks still running in threads (a timed-out call keeps its thread until the store
        # answers): past this many, lookups miss at once instead of queueing behind a dead store
        self.max_inflight = max_inflight
        self.inflight = 0
        self.skipped = 0

    def record_written(self, hashes: list[int]) -> None:
        pass  # the store knows

    async def hit_blocks(self, hashes: list[int], tokens: Sequence[int] | None = None) -> int:
        if not hashes:
            return 0
        key = (hashes[-1], len(hashes))
        now = self.clock()
        c = self._cache.get(key)
        if c is not None and c[0] > now:
            return c[1]
        if self.inflight >= self.max_inflight:
            self.skipped += 1
            return 0
        keys = [self.key_fn(h) for h in hashes]
        self.inflight += 1
        fut = asyncio.ensure_future(asyncio.to_thread(self.checker.batch_is_exist, keys))
        fut.add_done_callback(self._done)
        try:
            found = await asyncio.wait_for(asyncio.shield(fut), self.timeout_s)
        except (asyncio.TimeoutError, TimeoutError):  # distinct types before 3.11
            self.timeouts += 1
            return 0
        except Exception:
            self.errors += 1
            return 0
        n = 0
        for ok in found or ():
            if not ok:
                break
            n += 1
        self._cache[key] = (now + self.cache_ttl_s, n)
        while len(self._cache) > self.cache_size:
            self._cache.popitem(last=False)
        return n

    def _done(self, fut: asyncio.Future) -> None:
        self.inflight -= 1
        if not fut.cancelled():
            fut.exception()  # retrieved: a late failure is not an "exception never retrieved"
