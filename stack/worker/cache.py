"""Block-level prefix cache of the emulated engine (SGLang radix cache with page_size pages).

Pages are keyed by a chained hash (``h_k = xxh3_64(h_{k-1} || tokens of page k)`` with the
engine's own seed, as a signed int64 like SGLang's events). Only full pages are cached. Eviction
removes least-recently-used *leaves* that no running request holds, so a cached page always has
its parent cached: prefix match by set membership equals a tree walk, which is what a KV-event
subscriber mirroring BlockStored/BlockRemoved reproduces.

Every mutation is reported to ``on_event`` as SGLang 0.5.23 tagged maps, which the worker
publishes over ZMQ.
"""

from __future__ import annotations

import heapq
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import xxhash

_I64 = struct.Struct("<q")

ENGINE_HASH_SEED = 0x5347_4C41  # "SGLA": the engine's hashes differ from the router's on purpose


def _signed64(x: int) -> int:
    return x - (1 << 64) if x >= (1 << 63) else x


def page_hashes(tokens: Sequence[int], page_size: int, seed: int = ENGINE_HASH_SEED) -> list[int]:
    """Chained signed-int64 hashes of every full page of ``tokens``:
    ``h_k = xxh3_64(h_{k-1} as int64 LE || page tokens as uint32 LE, seed)``."""
    n_full = len(tokens) // page_size
    if n_full == 0:
        return []
    buf = np.asarray(tokens[: n_full * page_size], dtype=np.int64).astype("<u4").tobytes()
    step = page_size * 4
    out: list[int] = []
    parent = 0
    h64 = xxhash.xxh3_64_intdigest
    pack = _I64.pack
    for k in range(n_full):
        h = h64(pack(parent) + buf[k * step : (k + 1) * step], seed)
        parent = h - (1 << 64) if h >= (1 << 63) else h
        out.append(parent)
    return out


def matchable_pages(n_tokens: int, page_size: int) -> int:
    """How many leading pages a request of ``n_tokens`` may take from any cache: SGLang always
    computes at least the last prompt token, so the match covers at most ``n_tokens - 1``."""
    return max(0, (n_tokens - 1) // page_size)


@dataclass(slots=True)
class _Block:
    hash: int
    parent: int | None
    tokens: tuple[int, ...]
    children: int = 0
    ref: int = 0
    last_access: int = 0


@dataclass
class CacheStats:
    stored_pages: int = 0
    removed_pages: int = 0
    evictions: int = 0
    clears: int = 0
    insert_skipped_pages: int = 0  # pages computed but not cached (cache full of held pages)


@dataclass
class PrefixCache:
    """LRU page cache with capacity ``capacity_pages``.

    ``on_event(list_of_event_maps)`` is called once per mutation batch.
    """

    page_size: int
    capacity_pages: int
    on_event: Callable[[list[dict]], None] | None = None
    medium: str = "GPU"
    blocks: dict[int, _Block] = field(default_factory=dict)
    stats: CacheStats = field(default_factory=CacheStats)
    _clock: int = 0
    _heap: list[tuple[int, int]] = field(default_factory=list)

    # -- queries ---------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.blocks)

    def __contains__(self, h: int) -> bool:
        return h in self.blocks

    @property
    def used_tokens(self) -> int:
        return len(self.blocks) * self.page_size

    def match(self, hashes: Sequence[int], limit_pages: int | None = None) -> int:
        """Number of leading pages of ``hashes`` present (no side effects)."""
        n = len(hashes) if limit_pages is None else min(limit_pages, len(hashes))
        k = 0
        while k < n and hashes[k] in self.blocks:
            k += 1
        return k

    # -- request life cycle -------------------------------------------------------------------
    def acquire(self, hashes: Sequence[int]) -> None:
        """Touch and hold (ref+1) the given cached pages (a request's matched prefix)."""
        self._clock += 1
        for h in hashes:
            b = self.blocks[h]
            b.ref += 1
            b.last_access = self._clock

    def release(self, hashes: Sequence[int]) -> None:
        self._clock += 1
        for h in hashes:
            b = self.blocks.get(h)
            if b is None:
                continue
            b.ref = max(0, b.ref - 1)
            b.last_access = self._clock
            if b.children == 0:
                heapq.heappush(self._heap, (b.last_access, h))

    def insert(
        self, hashes: Sequence[int], tokens: Sequence[int], start_page: int, hold: bool = True
    ) -> list[int]:
        """Insert pages ``start_page..len(hashes)-1`` (page k's tokens are
        ``tokens[k*page:(k+1)*page]``); pages already present are touched (and held when
        ``hold``). Returns the hashes now held by the caller (to ``release`` later). The parent
        of ``start_page`` must be cached (or ``start_page == 0``). Emits one BlockStored for the
        run of new pages (and BlockRemoved for evictions made to fit them)."""
        ps = self.page_size
        held: list[int] = []
        events: list[dict] = []
        new_hashes: list[int] = []
        new_tokens: list[int] = []
        new_parent: int | None = None
        self._clock += 1
        for k in range(start_page, len(hashes)):
            h = hashes[k]
            parent = hashes[k - 1] if k > 0 else None
            if parent is not None and parent not in self.blocks:
                break  # the chain was cut (parent evicted or never cached): stop
            b = self.blocks.get(h)
            if b is None:
                if len(self.blocks) >= self.capacity_pages and not self._evict(1, events, protect=parent):
                    self.stats.insert_skipped_pages += len(hashes) - k
                    break
                page = tuple(tokens[k * ps : (k + 1) * ps])
                b = _Block(h, parent, page)
                self.blocks[h] = b
                if parent is not None:
                    pb = self.blocks[parent]
                    pb.children += 1
                if not new_hashes:
                    new_parent = parent
                new_hashes.append(h)
                new_tokens.extend(page)
                self.stats.stored_pages += 1
            b.last_access = self._clock
            if hold:
                b.ref += 1
                held.append(h)
            elif b.children == 0:
                heapq.heappush(self._heap, (b.last_access, h))
        if new_hashes:
            # Evictions made room before the new pages existed: report them first.
            events.append(
                {
                    "type": "BlockStored",
                    "block_hashes": new_hashes,
                    "parent_block_hash": new_parent,
                    "token_ids": new_tokens,
                    "block_size": ps,
                    "lora_id": None,
                    "medium": self.medium,
                }
            )
        self._emit(events)
        return held

    def clear(self) -> bool:
        """Drop every page (``/flush_cache``); refused (False) while requests hold pages."""
        if any(b.ref for b in self.blocks.values()):
            return False
        self.blocks.clear()
        self._heap.clear()
        self.stats.clears += 1
        self._emit([{"type": "AllBlocksCleared"}])
        return True

    # -- eviction ------------------------------------------------------------------------------
    def _evict(self, n: int, events: list[dict], protect: int | None = None) -> bool:
        """Evict ``n`` LRU unheld leaves; False if impossible."""
        removed: list[int] = []
        skipped: list[tuple[int, int]] = []
        while len(removed) < n and self._heap:
            ts, h = heapq.heappop(self._heap)
            b = self.blocks.get(h)
            if b is None or b.children or b.last_access != ts:
                continue  # stale entry
            if b.ref or h == protect:
                skipped.append((ts, h))
                continue
            del self.blocks[h]
            removed.append(h)
            if b.parent is not None:
                pb = self.blocks.get(b.parent)
                if pb is not None:
                    pb.children -= 1
                    if pb.children == 0:
                        heapq.heappush(self._heap, (pb.last_access, pb.hash))
        for item in skipped:
            heapq.heappush(self._heap, item)
        if not removed and n:
            # stale heap (leaves touched without a push): rebuild once
            if self._rebuild_heap():
                return self._evict(n, events, protect)
            return False
        if removed:
            self.stats.removed_pages += len(removed)
            self.stats.evictions += 1
            events.append({"type": "BlockRemoved", "block_hashes": removed, "medium": self.medium})
        return len(removed) >= n

    def _rebuild_heap(self) -> bool:
        entries = [(b.last_access, h) for h, b in self.blocks.items() if b.children == 0 and b.ref == 0]
        known = set(self._heap)
        if all(e in known for e in entries):
            return False
        self._heap = entries
        heapq.heapify(self._heap)
        return bool(entries)

    def _emit(self, events: list[dict]) -> None:
        if events and self.on_event is not None:
            self.on_event(events)
