"""Per-worker prefix index keyed on the router's own chained block hashes.

One dict maps a router block hash to a bitmask of the workers holding that block, so a
request's local hit on *every* worker is one walk over its hashes (a few hundred ns per
block whatever the number of workers).

Two sources fill a worker's bits:

- KV events (exact): ``BlockStored`` carries the engine's hashes, its parent and the
  token ids; the router re-hashes the tokens with its own scheme, chaining from the router
  hash mapped from the engine parent, and keeps ``engine hash -> router hash`` to apply
  ``BlockRemoved``. Mediums (GPU / CPU host) are refcounted: a block is local while any
  medium holds it. A sequence gap drops the worker's index (``drop_worker``).
- Routing history (approximate, for workers that publish no events): the blocks of every
  request routed to the worker, with a TTL and an LRU capacity in blocks.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from itertools import repeat

import numpy as np

from stack.kv_tier.events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch
from stack.kv_tier.hashing import ROOT, block_hashes


class _EventState:
    __slots__ = ("e2r", "refs", "orphans", "mismatched", "stored", "removed")

    def __init__(self) -> None:
        self.e2r: dict[int, int] = {}  # engine hash -> router hash
        self.refs: dict[int, int] = {}  # router hash -> number of (engine hash, medium) holders
        self.orphans = 0  # BlockStored whose parent we never saw
        self.mismatched = 0  # BlockStored with another block size
        self.stored = 0
        self.removed = 0


class _ApproxState:
    __slots__ = ("lru",)

    def __init__(self) -> None:
        self.lru: OrderedDict[int, float] = OrderedDict()  # router hash -> expiry


class PrefixIndex:
    def __init__(
        self,
        block_size: int,
        approx_ttl_s: float = 300.0,
        approx_capacity_blocks: int = 4096,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.block_size = block_size
        self.approx_ttl_s = approx_ttl_s
        self.approx_capacity_blocks = approx_capacity_blocks
        self.clock = clock
        self.masks: dict[int, int] = {}
        self.workers: dict[int, _EventState | _ApproxState] = {}
        self.all_bits = 0

    # -- workers ------------------------------------------------------------------------
    def add_worker(self, wid: int, events: bool) -> None:
        self.drop_worker(wid)
        self.workers[wid] = _EventState() if events else _ApproxState()
        self.all_bits |= 1 << wid

    def remove_worker(self, wid: int) -> None:
        self.drop_worker(wid)
        self.workers.pop(wid, None)
        self.all_bits &= ~(1 << wid)

    def drop_worker(self, wid: int) -> None:
        """Forget every block of worker ``wid`` (kept registered)."""
        st = self.workers.get(wid)
        if st is None:
            return
        keys = st.refs.keys() if isinstance(st, _EventState) else st.lru.keys()
        for h in list(keys):
            self._clear(h, wid)
        if isinstance(st, _EventState):
            st.e2r.clear()
            st.refs.clear()
        else:
            st.lru.clear()

    def uses_events(self, wid: int) -> bool:
        return isinstance(self.workers.get(wid), _EventState)

    def blocks(self, wid: int) -> int:
        st = self.workers.get(wid)
        if st is None:
            return 0
        return len(st.refs) if isinstance(st, _EventState) else len(st.lru)

    def _set(self, h: int, wid: int) -> None:
        self.masks[h] = self.masks.get(h, 0) | (1 << wid)

    def _clear(self, h: int, wid: int) -> None:
        m = self.masks.get(h)
        if m is None:
            return
        m &= ~(1 << wid)
        if m:
            self.masks[h] = m
        else:
            del self.masks[h]

    # -- lookups ------------------------------------------------------------------------
    def hits(self, hashes: list[int]) -> dict[int, int]:
        """Leading blocks of ``hashes`` held by each worker: ``{wid: blocks}`` (absent = 0).

        With worker ids below 64 the walk is vectorised (the masks looked up in one C-level
        pass, their running AND in numpy: ~2.5x faster on a 1,500-block agent prompt, the
        same answer); otherwise one Python pass."""
        if len(hashes) > 32 and self.all_bits < _U64:
            return self._hits_vector(hashes)
        return self._hits_walk(hashes)

    def _hits_walk(self, hashes: list[int]) -> dict[int, int]:
        alive = self.all_bits
        masks = self.masks
        out: dict[int, int] = {}
        k = 0
        for k, h in enumerate(hashes):  # noqa: B007
            m = masks.get(h, 0) & alive
            dead = alive & ~m
            if dead and k:
                _each_bit(out, dead, k)
            alive = m
            if not alive:
                return out
        _each_bit(out, alive, len(hashes))
        return out

    def _hits_vector(self, hashes: list[int]) -> dict[int, int]:
        n = len(hashes)
        ms = np.fromiter(map(self.masks.get, hashes, repeat(0)), dtype=np.uint64, count=n)
        # acc[k]: the workers holding blocks 0..k
        acc = np.bitwise_and.accumulate(ms & np.uint64(self.all_bits))
        out: dict[int, int] = {}
        for k in (np.flatnonzero(acc[1:] != acc[:-1]) + 1).tolist():
            _each_bit(out, int(acc[k - 1]) & ~int(acc[k]), k)
        _each_bit(out, int(acc[-1]), n)
        return out

    # -- KV events ----------------------------------------------------------------------
    def apply(self, wid: int, batch: EventBatch) -> list[int]:
        """Apply a batch of events of worker ``wid``; returns the router hashes stored."""
        st = self.workers.get(wid)
        if not isinstance(st, _EventState):
            return []
        stored: list[int] = []
        for ev in batch.events:
            if isinstance(ev, BlockStored):
                stored.extend(self._stored(wid, st, ev))
            elif isinstance(ev, BlockRemoved):
                self._removed(wid, st, ev)
            elif isinstance(ev, AllBlocksCleared):
                self.drop_worker(wid)
        return stored

    def _stored(self, wid: int, st: _EventState, ev: BlockStored) -> list[int]:
        bs = ev.block_size or self.block_size
        if bs != self.block_size or len(ev.token_ids) < bs * len(ev.block_hashes):
            st.mismatched += 1
            return []
        if ev.parent_block_hash is None:
            parent = ROOT
        else:
            p = st.e2r.get(ev.parent_block_hash)
            if p is None:
                st.orphans += 1
                return []
            parent = p
        rh = block_hashes(ev.token_ids[: bs * len(ev.block_hashes)], bs, parent)
        for eh, r in zip(ev.block_hashes, rh, strict=True):
            if st.e2r.get(eh) is None:
                st.e2r[eh] = r
            n = st.refs.get(r, 0)
            st.refs[r] = n + 1
            if n == 0:
                self._set(r, wid)
        st.stored += len(rh)
        return rh

    def _removed(self, wid: int, st: _EventState, ev: BlockRemoved) -> None:
        for eh in ev.block_hashes:
            r = st.e2r.get(eh)
            if r is None:
                continue
            n = st.refs.get(r, 0) - 1
            st.removed += 1
            if n <= 0:
                st.refs.pop(r, None)
                st.e2r.pop(eh, None)
                self._clear(r, wid)
            else:
                st.refs[r] = n

    # -- routing history (approximate) ----------------------------------------------------
    def record_routed(self, wid: int, hashes: list[int]) -> None:
        st = self.workers.get(wid)
        if not isinstance(st, _ApproxState) or self.approx_capacity_blocks <= 0:
            return
        exp = self.clock() + self.approx_ttl_s
        lru = st.lru
        bit = 1 << wid
        masks = self.masks
        for h in hashes:
            if h in lru:
                lru.move_to_end(h)
            else:
                masks[h] = masks.get(h, 0) | bit
            lru[h] = exp
        self._evict(wid, st)

    def expire(self) -> None:
        """Drop expired and over-capacity approximate entries (call periodically)."""
        for wid, st in self.workers.items():
            if isinstance(st, _ApproxState):
                self._evict(wid, st)

    def _evict(self, wid: int, st: _ApproxState) -> None:
        now = self.clock()
        lru = st.lru
        while lru:
            h, exp = next(iter(lru.items()))
            if len(lru) > self.approx_capacity_blocks or exp <= now:
                lru.popitem(last=False)
                self._clear(h, wid)
            else:
                break


_U64 = 1 << 64


def _each_bit(out: dict[int, int], bits: int, blocks: int) -> None:
    """``out[wid] = blocks`` for every worker whose bit is set in ``bits``."""
    while bits:
        b = bits & -bits
        out[b.bit_length() - 1] = blocks
        bits ^= b
