"""A block-level prefix cache with LRU eviction, stored as runs (SGLang radix-tree style).

A request's prompt is a *path*: a tuple of runs ``(owner, start, end)`` in blocks, where
``owner`` names a chain of blocks that requests extend (see stack/traces/intern.py). Runs
of one owner always start at the same block, so the cached part of an owner is the prefix
``[start, cached_end)``. The cache keeps ``owner -> cached_end`` in LRU order.

Invariant (prefix closure, as in a radix tree that evicts leaves first): a path's runs are
touched leaf-first, so an ancestor is always more recent than its descendants and the LRU
front never has cached descendants. Eviction trims the tail of the LRU-front run.

``hit`` is O(runs in the path) dictionary lookups; ``insert`` / ``touch`` likewise.
:class:`LockingPrefixCache` adds SGLang-style locks that eviction must respect.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

Run = tuple[int, int, int]  # (owner, start_block, end_block)
Path = Sequence[Run]


class PrefixCache:
    """LRU prefix cache with a capacity in blocks (``None`` = unbounded)."""

    __slots__ = ("capacity", "used", "_runs", "_start", "evicted_blocks")

    def __init__(self, capacity_blocks: int | None) -> None:
        if capacity_blocks is not None and capacity_blocks < 0:
            raise ValueError("capacity must be >= 0")
        self.capacity = capacity_blocks
        self.used = 0
        self._runs: OrderedDict[int, int] = OrderedDict()  # owner -> cached end (block)
        self._start: dict[int, int] = {}  # owner -> start block
        self.evicted_blocks = 0

    def __len__(self) -> int:
        return self.used

    def hit(self, path: Path) -> int:
        """Blocks of ``path``'s prefix held here (no LRU update)."""
        runs = self._runs
        for owner, start, end in path:
            ce = runs.get(owner)
            if ce is None:
                return start
            if ce < end:
                return ce
        return path[-1][2] if path else 0

    def touch(self, path: Path, upto: int) -> None:
        """Mark the cached part of ``path`` up to block ``upto`` as just used (leaf first)."""
        runs = self._runs
        for owner, start, _end in reversed(path):
            if start >= upto:
                continue
            if owner in runs:
                runs.move_to_end(owner)

    def insert(self, path: Path, upto: int | None = None) -> int:
        """Cache ``path`` up to block ``upto`` (default: all); returns blocks newly added.

        Evicts least-recently-used blocks to stay within capacity. If the path alone is
        larger than the capacity, only its first ``capacity`` blocks are kept.
        """
        if not path:
            return 0
        if upto is None:
            upto = path[-1][2]
        if self.capacity is not None:
            upto = min(upto, self.capacity)
        runs = self._runs
        added = 0
        for owner, start, end in path:
            if start >= upto:
                break
            e = end if end < upto else upto
            ce = runs.get(owner)
            if ce is None:
                runs[owner] = e
                self._start[owner] = start
                added += e - start
            elif ce < e:
                runs[owner] = e
                added += e - ce
        self.used += added
        self.touch(path, upto)
        if self.capacity is not None and self.used > self.capacity:
            self._evict(self.used - self.capacity)
        return added

    def resize(self, capacity_blocks: int) -> None:
        """Set the capacity (the room other KV leaves this cache), evicting LRU blocks to fit."""
        if capacity_blocks < 0:
            raise ValueError("capacity must be >= 0")
        self.capacity = capacity_blocks
        if self.used > capacity_blocks:
            self._evict(self.used - capacity_blocks)

    def _evict(self, blocks: int) -> None:
        self._evict_above(blocks, None)

    def _evict_above(self, blocks: int, locks: dict[int, list[int]] | None) -> None:
        """Free ``blocks`` blocks from the LRU front, never below a run's floor: its start,
        or the furthest end locked on it (``locks``: owner -> locked ends). The front run is
        a leaf (prefix closure), so trimming its tail keeps every cached path a prefix."""
        runs = self._runs
        starts = self._start
        plan: list[tuple[int, int]] = []  # (owner, new cached end), applied after the scan
        for owner, ce in runs.items():  # LRU order
            if blocks <= 0:
                break
            held = locks.get(owner) if locks else None
            floor = max(held) if held is not None else starts[owner]
            size = ce - floor
            if size <= 0:
                continue
            if size <= blocks:
                plan.append((owner, floor))
                blocks -= size
            else:
                plan.append((owner, ce - blocks))
                blocks = 0
        for owner, ne in plan:
            freed = runs[owner] - ne
            if ne <= starts[owner]:
                del runs[owner]
                del starts[owner]
            else:
                runs[owner] = ne
            self.used -= freed
            self.evicted_blocks += freed

    def clear(self) -> None:
        self._runs.clear()
        self._start.clear()
        self.used = 0


class LockingPrefixCache(PrefixCache):
    """A prefix cache whose matched prefixes can be locked (SGLang's ``inc_lock_ref``):
    eviction skips locked blocks (the cache may then exceed its capacity until they are
    unlocked). Locks are prefix-closed, so skipping them keeps the LRU front a leaf.

    The simulator uses it for ``match_at=schedule``: a request's matched prefix must stay
    cached from the moment it enters a prefill batch until its prefill completes."""

    __slots__ = ("_locks",)

    def __init__(self, capacity_blocks: int | None) -> None:
        super().__init__(capacity_blocks)
        self._locks: dict[int, list[int]] = {}  # owner -> locked end (block), one per holder

    def lock(self, path: Path, upto: int) -> list[tuple[int, int]]:
        """Lock ``path``'s first ``upto`` blocks; returns the handle for :meth:`unlock`."""
        locks = self._locks
        held = []
        for owner, start, end in path:
            if start >= upto:
                break
            e = end if end < upto else upto
            lst = locks.get(owner)
            if lst is None:
                locks[owner] = [e]
            else:
                lst.append(e)
            held.append((owner, e))
        return held

    def unlock(self, held: list[tuple[int, int]]) -> None:
        """Release a :meth:`lock` handle; evicts what is over capacity once unlocked."""
        locks = self._locks
        for owner, e in held:
            lst = locks[owner]
            lst.remove(e)
            if not lst:
                del locks[owner]
        if self.capacity is not None and self.used > self.capacity:
            self._evict(self.used - self.capacity)

    def _evict(self, blocks: int) -> None:
        self._evict_above(blocks, self._locks)
