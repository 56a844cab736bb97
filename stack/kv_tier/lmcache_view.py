"""The router's global-tier view when LMCache is the tier: the LMCache controller's lookup.

``lmcache_controller`` (LMCache's cache controller) tracks which LMCache instance holds which
256-token chunk: each engine reports the chunks it admits and evicts. ``POST /lookup
{"tokens": [...]}`` answers ``{"layout_info": {instance_id: [location, end]}}``: walking the
prompt's chunks in order, each found chunk is credited to ONE holder (its ``end`` the token
position that chunk ends at) and the walk stops at the first chunk no one holds. The prefix
LMCache holds is therefore the largest ``end`` over the instances (:func:`prefix_hit_tokens`),
always a whole number of chunks; with the Mooncake store behind LMCache any instance can load
it.

:class:`LMCacheLookup` is the :class:`~stack.kv_tier.global_index.GlobalTier` over it, shaped
like :class:`~stack.kv_tier.global_index.MooncakeExistence`: one call per prompt (all its
chunks in one lookup), bounded by ``timeout_s``, answers cached briefly, at most
``max_inflight`` calls outstanding; while the controller is slow, down or answers nonsense the
view falls back to the router's own index of what it routed (:class:`WrittenIndex`), as the
Mooncake view does when its master is unreachable. The HTTP call is injected (``lookup``):
:func:`http_lookup` is the real one.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

from stack.kv_tier.global_index import WrittenIndex

__all__ = ["LMCacheLookup", "BadLookupAnswer", "http_lookup", "prefix_hit_tokens", "aligned_tokens"]

Lookup = Callable[[list[int]], Awaitable[Mapping[str, Any]]]


class BadLookupAnswer(RuntimeError):
    """The controller's answer is not a lookup answer."""


def prefix_hit_tokens(layout_info: Mapping[str, Any]) -> int:
    """Tokens of the prompt's prefix LMCache holds: the largest chunk end credited to anyone."""
    best = 0
    for inst, v in layout_info.items():
        if not isinstance(inst, str) or not isinstance(v, Sequence) or len(v) != 2:
            raise BadLookupAnswer(f"layout_info entry {inst!r}: {v!r} is not [location, end]")
        end = v[1]
        if not isinstance(end, int) or isinstance(end, bool) or end < 0:
            raise BadLookupAnswer(f"layout_info entry {inst!r}: end {end!r} is not a token count")
        best = max(best, end)
    return best


def aligned_tokens(tokens: Sequence[int], n_blocks: int, block_size: int, chunk_size: int) -> list[int]:
    """What to ask about: the prompt's hashed blocks, cut to whole LMCache chunks (a partial
    chunk is never stored, so never a hit)."""
    n = min(len(tokens), n_blocks * block_size)
    n = n // chunk_size * chunk_size
    head = tokens[:n]
    tolist = getattr(head, "tolist", None)  # a numpy array (the router's Features.tokens)
    return [int(t) for t in (tolist() if tolist is not None else head)]


def http_lookup(base_url: str, client: Any = None) -> Lookup:
    """The real lookup: ``POST {base_url}/lookup`` with httpx (one shared async client)."""
    import httpx

    url = base_url.rstrip("/") + "/lookup"
    holder: dict[str, Any] = {"client": client}

    async def lookup(tokens: list[int]) -> Mapping[str, Any]:
        c = holder["client"]
        if c is None:
            c = holder["client"] = httpx.AsyncClient(timeout=httpx.Timeout(5.0))
        r = await c.post(url, json={"tokens": tokens})
        r.raise_for_status()
        body = r.json()
        info = body.get("layout_info") if isinstance(body, dict) else None
        if not isinstance(info, dict):
            raise BadLookupAnswer(f"{url}: answer has no layout_info mapping")
        return info

    return lookup


class LMCacheLookup:
    """Global hits from the LMCache controller's lookup (see the module docstring)."""

    name = "lmcache"

    def __init__(
        self,
        lookup: Lookup,
        block_size: int,
        chunk_size: int = 256,
        timeout_s: float = 0.02,
        cache_ttl_s: float = 1.0,
        cache_size: int = 4096,
        max_inflight: int = 4,
        fallback: WrittenIndex | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if block_size < 1 or chunk_size < 1:
            raise ValueError("block_size and chunk_size must be positive")
        self.lookup = lookup
        self.block_size = block_size
        self.chunk_size = chunk_size
        self.timeout_s = timeout_s
        self.cache_ttl_s = cache_ttl_s
        self.cache_size = cache_size
        self.max_inflight = max_inflight
        self.fallback = fallback if fallback is not None else WrittenIndex()
        self.clock = clock
        self._cache: OrderedDict[tuple[int, int], tuple[float, int]] = OrderedDict()
        self.inflight = 0
        self.timeouts = 0
        self.errors = 0
        self.skipped = 0
        self.answered = 0

    def record_written(self, hashes: list[int]) -> None:
        self.fallback.record_written(hashes)  # the fallback's view of what LMCache was given

    async def hit_blocks(self, hashes: list[int], tokens: Sequence[int] | None = None) -> int:
        if not hashes:
            return 0
        if tokens is None:  # nothing to ask the controller with
            return self.fallback.hit_sync(hashes)
        key = (hashes[-1], len(hashes))
        now = self.clock()
        c = self._cache.get(key)
        if c is not None and c[0] > now:
            return c[1]
        ask = aligned_tokens(tokens, len(hashes), self.block_size, self.chunk_size)
        if not ask:
            return 0
        if self.inflight >= self.max_inflight:
            self.skipped += 1
            return self.fallback.hit_sync(hashes)
        self.inflight += 1
        fut = asyncio.ensure_future(self.lookup(ask))
        fut.add_done_callback(self._done)
        try:
            info = await asyncio.wait_for(asyncio.shield(fut), self.timeout_s)
            hit = min(prefix_hit_tokens(info), len(ask))
        except (asyncio.TimeoutError, TimeoutError):
            self.timeouts += 1
            return self.fallback.hit_sync(hashes)
        except Exception:  # noqa: BLE001 - down, refused, nonsense: route on the fallback
            self.errors += 1
            return self.fallback.hit_sync(hashes)
        self.answered += 1
        n = min(len(hashes), hit // self.block_size)
        self._cache[key] = (now + self.cache_ttl_s, n)
        while len(self._cache) > self.cache_size:
            self._cache.popitem(last=False)
        return n

    def _done(self, fut: asyncio.Future) -> None:
        self.inflight -= 1
        if not fut.cancelled():
            fut.exception()  # a late failure is retrieved, never "exception never retrieved"
