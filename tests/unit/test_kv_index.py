"""Block hashing, KV event decoding (array and map forms), the prefix index, global tier."""

from __future__ import annotations

import asyncio

import msgpack
import numpy as np
import pytest
import xxhash

from stack.kv_tier.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    SequenceTracker,
    decode_payload,
    encode_batch,
)
from stack.kv_tier.global_index import MooncakeExistence, WrittenIndex
from stack.kv_tier.hashing import ROOT, block_hashes, chain_one
from stack.kv_tier.index import PrefixIndex

pytestmark = pytest.mark.timeout(30)

BS = 4


def test_block_hashes_chain_and_definition():
    toks = list(range(10))
    hs = block_hashes(toks, BS)
    assert len(hs) == 2  # only full blocks
    h0 = xxhash.xxh3_64_intdigest(ROOT.to_bytes(8, "little") + np.arange(4, dtype="<u4").tobytes())
    assert hs[0] == h0
    assert hs[1] == chain_one(h0, [4, 5, 6, 7])
    # continuing from a parent gives the same chain
    assert block_hashes(toks[4:], BS, parent=hs[0]) == hs[1:]
    # a different first block changes every later hash
    assert block_hashes([99] + toks[1:], BS)[1] != hs[1]
    with pytest.raises(ValueError):
        block_hashes([-1, 2, 3, 4], BS)


def test_decode_array_and_map_forms():
    arr = [
        1.5,
        [
            ["BlockStored", [11, 12], None, list(range(8)), 4, None, "GPU"],
            ["BlockStored", [13], 12, [8, 9, 10, 11], 4],  # trailing defaults omitted
            ["BlockRemoved", [11], "GPU"],
            ["BlockRemoved", [12]],
            ["AllBlocksCleared"],
            ["SomethingNew", 1],
        ],
        0,
    ]
    b = decode_payload(msgpack.packb(arr))
    assert b.dp_rank == 0 and b.ts == 1.5
    assert [type(e) for e in b.events] == [
        BlockStored,
        BlockStored,
        BlockRemoved,
        BlockRemoved,
        AllBlocksCleared,
    ]
    assert b.events[1].parent_block_hash == 12 and b.events[1].medium is None
    mp = [
        2.0,
        [
            {
                "type": "BlockStored",
                "block_hashes": [-5, 7],
                "parent_block_hash": None,
                "token_ids": list(range(8)),
                "block_size": 4,
                "lora_id": None,
                "medium": "GPU",
            },
            {"type": "BlockRemoved", "block_hashes": [-5], "medium": "GPU"},
            {"type": "AllBlocksCleared"},
        ],
    ]
    b2 = decode_payload(msgpack.packb(mp))
    assert b2.dp_rank is None
    assert b2.events[0].block_hashes == [-5, 7] and b2.events[0].medium == "GPU"
    assert isinstance(b2.events[2], AllBlocksCleared)


def test_encode_batch_roundtrip_and_seq():
    topic, seq, payload = encode_batch(7, [["AllBlocksCleared"]], 1.0, 3)
    assert topic == b"kv" and int.from_bytes(seq, "big") == 7
    assert decode_payload(payload).dp_rank == 3
    t = SequenceTracker()
    assert t.check(5) and t.check(6) and not t.check(8) and t.gaps == 1


def _stored(hashes, parent, tokens, medium="GPU"):
    return BlockStored(hashes, parent, tokens, BS, None, medium)


def test_index_from_events_maps_engine_hashes():
    idx = PrefixIndex(BS)
    idx.add_worker(0, events=True)
    idx.add_worker(1, events=True)
    toks = list(range(16))
    mine = block_hashes(toks, BS)
    # engine hashes are arbitrary (here negative, as SGLang's signed int64)
    idx.apply(0, EventBatch(0, [_stored([-1, -2], None, toks[:8]), _stored([-3], -2, toks[8:12])]))
    idx.apply(1, EventBatch(0, [_stored([-9], None, toks[:4])]))
    assert idx.hits(mine) == {0: 3, 1: 1}
    # an orphan (unknown parent) is ignored, not mis-chained
    idx.apply(1, EventBatch(0, [_stored([-10], 12345, toks[4:8])]))
    assert idx.hits(mine)[1] == 1
    # removal of a middle block cuts the prefix there
    idx.apply(0, EventBatch(0, [BlockRemoved([-2], "GPU")]))
    assert idx.hits(mine) == {0: 1, 1: 1}
    # mediums are refcounted: GPU eviction while a CPU copy remains keeps the block
    idx.apply(1, EventBatch(0, [_stored([-9], None, toks[:4], "CPU"), BlockRemoved([-9], "GPU")]))
    assert idx.hits(mine)[1] == 1
    idx.apply(1, EventBatch(0, [AllBlocksCleared()]))
    assert 1 not in idx.hits(mine)
    idx.drop_worker(0)
    assert idx.hits(mine) == {}
    assert idx.masks == {}


def test_index_block_size_mismatch_ignored():
    idx = PrefixIndex(BS)
    idx.add_worker(0, events=True)
    idx.apply(0, EventBatch(0, [BlockStored([1], None, list(range(8)), 8)]))
    assert idx.blocks(0) == 0
    assert idx.workers[0].mismatched == 1


def test_approximate_index_ttl_and_capacity():
    now = [0.0]
    idx = PrefixIndex(BS, approx_ttl_s=10, approx_capacity_blocks=3, clock=lambda: now[0])
    idx.add_worker(0, events=False)
    a = block_hashes(list(range(8)), BS)  # 2 blocks
    b = block_hashes(list(range(100, 108)), BS)  # 2 blocks
    idx.record_routed(0, a)
    assert idx.hits(a) == {0: 2}
    idx.record_routed(0, b)  # capacity 3: a's first block goes
    assert idx.blocks(0) == 3
    assert idx.hits(a) == {}  # leading block evicted -> no prefix hit
    assert idx.hits(b) == {0: 2}
    now[0] = 11.0
    idx.expire()
    assert idx.hits(b) == {} and idx.blocks(0) == 0
    # events-mode workers ignore routing history
    idx.add_worker(1, events=True)
    idx.record_routed(1, a)
    assert idx.blocks(1) == 0


def test_hits_many_workers_partial_prefixes():
    idx = PrefixIndex(BS)
    toks = list(range(40))
    hs = block_hashes(toks, BS)
    for w in range(40):
        idx.add_worker(w, events=False)
        idx.record_routed(w, hs[: w % 11])
    got = idx.hits(hs)
    for w in range(40):
        assert got.get(w, 0) == w % 11
    idx.remove_worker(5)
    assert 5 not in idx.hits(hs)


def test_written_index_and_mooncake_backend():
    wi = WrittenIndex(capacity_blocks=3)
    hs = block_hashes(list(range(20)), BS)
    wi.record_written(hs[:3])
    assert asyncio.run(wi.hit_blocks(hs)) == 3
    wi.record_written(hs[3:4])  # evicts hs[0]
    assert asyncio.run(wi.hit_blocks(hs)) == 0

    class Checker:
        def __init__(self):
            self.calls = 0
            self.keys: set[str] = set()

        def batch_is_exist(self, keys):
            self.calls += 1
            return [k in self.keys for k in keys]

    ch = Checker()
    mc = MooncakeExistence(ch, timeout_s=2.0)
    ch.keys = {f"{h:016x}" for h in hs[:2]}
    assert asyncio.run(mc.hit_blocks(hs)) == 2
    assert asyncio.run(mc.hit_blocks(hs)) == 2 and ch.calls == 1  # cached

    class Broken:
        def batch_is_exist(self, keys):
            raise RuntimeError("store down")

    assert asyncio.run(MooncakeExistence(Broken()).hit_blocks(hs)) == 0


def test_vectorised_hits_equal_the_walk():
    """The numpy path of PrefixIndex.hits (worker ids below 64, prompts over 32 blocks) gives
    the walk's answer on random routing histories, holes and evictions included."""
    import random

    rng = random.Random(5)
    for _ in range(200):
        idx = PrefixIndex(64, approx_capacity_blocks=rng.choice([50, 500, 100_000]))
        nw = rng.randint(1, 40)
        for w in range(nw):
            idx.add_worker(w, False)
        chains = [[rng.getrandbits(64) for _ in range(rng.randint(1, 300))] for _ in range(5)]
        for _ in range(rng.randint(1, 30)):
            c = rng.choice(chains)
            idx.record_routed(rng.randrange(nw), c[: rng.randint(0, len(c))])
        for c in chains:
            q = c[: rng.randint(1, len(c))] + [rng.getrandbits(64) for _ in range(rng.randint(0, 5))]
            assert idx._hits_vector(q) == idx._hits_walk(q)
            assert idx.hits(q) == idx._hits_walk(q)
