"""The LRU prefix cache (runs, prefix closure) and prompt interning."""

from __future__ import annotations

import pytest

from stack.kv_tier.prefix_cache import PrefixCache
from stack.traces.intern import Interner


def test_hit_is_longest_cached_prefix():
    c = PrefixCache(None)
    a = ((0, 0, 10),)
    assert c.hit(a) == 0
    c.insert(a)
    assert c.hit(a) == 10
    # a path extending a: the shared part hits
    assert c.hit(((0, 0, 10), (1, 10, 15))) == 10
    # a shorter reference to the same owner
    assert c.hit(((0, 0, 6),)) == 6


def test_lru_evicts_least_recent_and_keeps_prefix_closure():
    c = PrefixCache(30)
    a, b, d = ((0, 0, 10),), ((1, 0, 10),), ((2, 0, 10),)
    c.insert(a)
    c.insert(b)
    c.insert(d)
    c.touch(a, 10)  # a becomes most recent
    c.insert(((3, 0, 10),))  # 40 blocks > 30 -> evict the LRU run: b
    assert c.hit(b) == 0
    assert c.hit(a) == 10 and c.hit(d) == 10
    assert c.used == 30
    assert c.evicted_blocks == 10


def test_eviction_trims_leaves_before_parents():
    c = PrefixCache(25)
    parent = (0, 0, 10)
    child = ((0, 0, 10), (1, 10, 20))  # branches off owner 0
    c.insert(child)
    assert c.hit(child) == 20
    # a newer unrelated path forces eviction of 5 blocks: the child's tail goes first
    c.insert(((2, 0, 10),))
    assert c.used == 25
    assert c.hit((parent,)) == 10
    assert c.hit(child) == 15


def test_path_larger_than_capacity_is_truncated():
    c = PrefixCache(8)
    c.insert(((0, 0, 20),))
    assert c.hit(((0, 0, 20),)) == 8
    assert c.used == 8


def test_zero_capacity_caches_nothing():
    c = PrefixCache(0)
    c.insert(((0, 0, 5),))
    assert c.hit(((0, 0, 5),)) == 0 and c.used == 0


def test_negative_capacity_rejected():
    with pytest.raises(ValueError):
        PrefixCache(-1)


def test_interner_extends_owner_for_append_only_turns():
    it = Interner()
    p1 = it.extend((), 0, 10)
    p2 = it.extend(p1, 10, 14)  # appends to turn 1
    p3 = it.extend(p2, 14, 20)
    assert len(p3) == 1  # one owner however many turns
    assert p3[0][1:] == (0, 20)
    # a request that diverges at block 12 branches off
    p4 = it.extend(p3, 12, 16)
    assert len(p4) == 2 and p4[0][2] == 12 and p4[1][1:] == (12, 16)
    # shared prefix is hit in a cache holding p3
    c = PrefixCache(None)
    c.insert(p3)
    assert c.hit(p4) == 12
    assert c.hit(p2) == 14


def test_interner_prefix_of_existing_path():
    it = Interner()
    p1 = it.extend((), 0, 10)
    p2 = it.extend(p1, 6, 6)
    assert p2 == ((p1[0][0], 0, 6),)
