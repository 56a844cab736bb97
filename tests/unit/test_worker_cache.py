"""The emulator's prefix cache: LRU of unheld leaves, capacity, and KV events that describe it."""

from __future__ import annotations

import random

import pytest

from stack.worker.cache import PrefixCache, matchable_pages, page_hashes
from support.kv_mirror import KVMirror

pytestmark = pytest.mark.timeout(60)


class _Events:
    """A KVMirror without a socket: applies the cache's events directly."""

    def __init__(self):
        self.m = KVMirror.__new__(KVMirror)
        self.m.blocks, self.m.events = {}, []

    def __call__(self, events):
        for e in events:
            self.m.apply(e)


def _req(cache: PrefixCache, tokens: list[int]) -> int:
    """A request's life in the engine: match, hold, compute the rest, insert, release."""
    ps = cache.page_size
    hs = page_hashes(tokens, ps)
    c = cache.match(hs, matchable_pages(len(tokens), ps))
    cache.acquire(hs[:c])
    held = list(hs[:c]) + cache.insert(hs, tokens, c)
    cache.release(held)
    return c


def test_hashes_chain_and_full_pages_only():
    t = list(range(100))
    h = page_hashes(t, 16)
    assert len(h) == 6
    assert page_hashes(t[:96], 16) == h
    assert page_hashes([999] + t[1:], 16)[1] != h[1]  # chained: a change propagates
    assert all(-(1 << 63) <= x < (1 << 63) for x in h)


def test_match_leaves_the_last_token_to_compute():
    assert matchable_pages(64, 16) == 3
    assert matchable_pages(65, 16) == 4
    assert matchable_pages(1, 16) == 0


def test_lru_eviction_removes_leaves_and_reports_them():
    ev = _Events()
    c = PrefixCache(page_size=4, capacity_pages=6, on_event=ev)
    a = [1] * 12 + [0]  # 3 pages
    b = [2] * 12 + [0]
    _req(c, a)
    _req(c, b)
    assert len(c) == 6
    assert _req(c, a) == 3  # touch a: b is now LRU
    d = [3] * 8 + [0]
    _req(c, d)  # needs 2 pages: evicts b's two deepest pages
    hb = page_hashes(b, 4)
    assert hb[0] in c and hb[1] not in c and hb[2] not in c
    assert set(ev.m.blocks) == set(c.blocks)
    kinds = [e["type"] for e in ev.m.events]
    assert "BlockRemoved" in kinds


def test_held_pages_are_not_evicted():
    c = PrefixCache(page_size=4, capacity_pages=2)
    hs = page_hashes([5] * 8, 4)
    held = c.insert(hs, [5] * 8, 0)  # hold both
    got = c.insert(page_hashes([6] * 8, 4), [6] * 8, 0)
    assert got == [] and c.stats.insert_skipped_pages == 2
    c.release(held)
    assert c.insert(page_hashes([6] * 8, 4), [6] * 8, 0, hold=False) == []
    assert page_hashes([6] * 8, 4)[0] in c


def test_clear_refused_while_held_then_reported():
    ev = _Events()
    c = PrefixCache(page_size=4, capacity_pages=8, on_event=ev)
    held = c.insert(page_hashes([1] * 8, 4), [1] * 8, 0)
    assert not c.clear()
    c.release(held)
    assert c.clear() and len(c) == 0
    assert ev.m.events[-1] == {"type": "AllBlocksCleared"}


def test_block_stored_event_format():
    ev = _Events()
    c = PrefixCache(page_size=4, capacity_pages=8, on_event=ev)
    toks = [7, 8, 9, 10, 11, 12, 13, 14, 15]
    _req(c, toks)
    e = ev.m.events[0]
    assert (
        e["type"] == "BlockStored" and e["block_size"] == 4 and e["medium"] == "GPU" and e["lora_id"] is None
    )
    assert e["parent_block_hash"] is None
    assert e["token_ids"] == toks[:8]  # only full pages
    assert e["block_hashes"] == page_hashes(toks, 4)
    _req(c, toks[:8] + [1, 2, 3, 4, 5])
    e2 = ev.m.events[-1]
    assert e2["parent_block_hash"] == page_hashes(toks, 4)[1] and e2["token_ids"] == [1, 2, 3, 4]


def test_random_workload_mirror_predicts_every_hit():
    """Sessions growing their prompts under a small capacity: the event mirror's prefix match
    equals the cache's own match for every request, and the state sets agree throughout."""
    rng = random.Random(7)
    ev = _Events()
    c = PrefixCache(page_size=8, capacity_pages=40, on_event=ev)
    sessions = [[rng.randrange(1000) for _ in range(rng.randrange(8, 60))] for _ in range(12)]
    evictions = 0
    for _ in range(400):
        i = rng.randrange(len(sessions))
        s = sessions[i]
        s.extend(rng.randrange(1000) for _ in range(rng.randrange(1, 30)))
        if len(s) > 200:
            sessions[i] = s = s[:20]
        hs = page_hashes(s, 8)
        lim = matchable_pages(len(s), 8)
        predicted = ev.m.match_pages(hs, lim)
        assert _req(c, s) == predicted
        assert set(ev.m.blocks) == set(c.blocks)
        evictions = c.stats.evictions
    assert evictions > 10
    assert len(c) <= 40
