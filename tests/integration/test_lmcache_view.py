"""The router's LMCache view (stack/kv_tier/lmcache_view.py) on its own: reading the controller's
answer, what it asks, its time bound, cache and in-flight bound, and the fallback; and the
router choosing it from its config. The real controller: tests/e2e/test_lmcache_tier.py."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from stack.config import parse_config
from stack.kv_tier.global_index import WrittenIndex
from stack.kv_tier.lmcache_view import BadLookupAnswer, LMCacheLookup, aligned_tokens, prefix_hit_tokens
from stack.prefill_router.state import _global_tier


def test_prefix_is_the_largest_chunk_end_credited():
    # chunks 0-1 on A, chunk 2 on B: the walk stopped after chunk 2
    assert prefix_hit_tokens({"A": ["LocalCPUBackend", 512], "B": ["RemoteBackend", 768]}) == 768
    assert prefix_hit_tokens({}) == 0
    for bad in ({"A": "x"}, {"A": ["L", -1]}, {"A": ["L", "512"]}, {"A": ["L", True]}, {"A": ["L"]}):
        with pytest.raises(BadLookupAnswer):
            prefix_hit_tokens(bad)


def test_asks_whole_chunks_of_the_hashed_blocks():
    toks = list(range(1000))
    assert len(aligned_tokens(toks, n_blocks=15, block_size=64, chunk_size=256)) == 768
    assert aligned_tokens(toks, n_blocks=3, block_size=64, chunk_size=256) == []  # under a chunk
    arr = np.arange(600, dtype=np.int32)
    got = aligned_tokens(arr, n_blocks=9, block_size=64, chunk_size=256)
    assert got == list(range(512)) and all(type(t) is int for t in got)


class FakeController:
    def __init__(self, answer=None, delay: float = 0.0, fail: Exception | None = None):
        self.answer, self.delay, self.fail, self.calls = answer or {}, delay, fail, []

    async def __call__(self, tokens):
        self.calls.append(list(tokens))
        if self.delay:
            await asyncio.sleep(self.delay)
        if self.fail:
            raise self.fail
        return self.answer


def _view(ctl, **kw) -> LMCacheLookup:
    return LMCacheLookup(ctl, block_size=64, chunk_size=256, **kw)


def test_hit_in_blocks_capped_by_the_prompt_and_cached():
    ctl = FakeController({"w0": ["LocalCPUBackend", 512]})
    v = _view(ctl)
    toks = list(range(1100))
    hashes = list(range(1100 // 64))  # 17 blocks -> asks 1024 tokens
    assert asyncio.run(v.hit_blocks(hashes, toks)) == 8
    assert len(ctl.calls[0]) == 1024
    assert asyncio.run(v.hit_blocks(hashes, toks)) == 8 and len(ctl.calls) == 1  # cached
    # an answer past what was asked (a stale holder) is cut to the asked prefix
    ctl2 = FakeController({"w0": ["L", 4096]})
    assert asyncio.run(_view(ctl2).hit_blocks(hashes, toks)) == 16
    assert asyncio.run(_view(ctl2).hit_blocks([], toks)) == 0


def test_slow_down_or_nonsense_controller_falls_back_to_the_routers_index():
    idx = WrittenIndex()
    idx.record_written([1, 2, 3])
    toks = list(range(512))
    for ctl, counter in (
        (FakeController(delay=0.5), "timeouts"),
        (FakeController(fail=ConnectionError("refused")), "errors"),
        (FakeController({"w0": "garbage"}), "errors"),
    ):
        v = _view(ctl, timeout_s=0.05, fallback=idx)
        loop = asyncio.new_event_loop()
        t0 = loop.time()
        assert loop.run_until_complete(v.hit_blocks([1, 2, 3, 4, 5, 6, 7, 8], toks)) == 3
        assert loop.time() - t0 < 0.3
        assert getattr(v, counter) == 1 and v.answered == 0
        loop.run_until_complete(asyncio.sleep(0.6))  # let a slow call finish: nothing leaks
        assert v.inflight == 0
        loop.close()
    # record_written feeds the fallback; no tokens: the fallback answers
    v = _view(FakeController(), fallback=WrittenIndex())
    v.record_written([9, 10])
    assert asyncio.run(v.hit_blocks([9, 10, 11])) == 2


def test_inflight_bound_skips_to_the_fallback():
    ctl = FakeController({"w0": ["L", 256]}, delay=0.2)
    v = _view(ctl, timeout_s=1.0, max_inflight=2)

    async def many():
        return await asyncio.gather(
            *(v.hit_blocks([i, i + 1, i + 2, i + 3], list(range(256))) for i in range(5))
        )

    got = asyncio.run(many())
    assert sorted(got) == [0, 0, 0, 4, 4] and v.skipped == 3 and len(ctl.calls) == 2


def _cfg(router: dict):
    return parse_config({"model": {"page_size": 64}, "router": router})


def test_router_builds_the_lmcache_view_from_its_config():
    ctl = FakeController()
    g = _global_tier(_cfg({"global_tier": "lmcache", "lmcache_controller_url": "http://127.0.0.1:9"}), ctl)
    assert isinstance(g, LMCacheLookup) and g.lookup is ctl and g.block_size == 64 and g.chunk_size == 256
    assert g.timeout_s == 0.02
    real = _global_tier(_cfg({"global_tier": "lmcache", "lmcache_controller_url": "http://127.0.0.1:9"}))
    assert isinstance(real, LMCacheLookup)
    # nothing listening there: the router keeps routing on its own index
    assert (
        asyncio.run(real.hit_blocks([1, 2, 3, 4], list(range(256)))) == 0 and real.errors + real.timeouts == 1
    )
    assert isinstance(_global_tier(_cfg({"global_tier": "lmcache"})), WrittenIndex)
