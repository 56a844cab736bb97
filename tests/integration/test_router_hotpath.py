"""The router's hot path: no head-of-line blocking behind a huge prompt, early refusal of a
prompt over the context, exact chunked tokenization, cancellation, and policies that need
no prompt features skip tokenization."""

from __future__ import annotations

import asyncio
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from stack.models.tiny import build_tiny_model
from stack.prefill_router.errors import Cancelled, ClientError, Overloaded
from stack.prefill_router.features import FeatureExtractor
from stack.prefill_router.offload import FeaturePool
from stack.prefill_router.tokenizer import Tokenizer, check_cancel
from support.router_harness import Cluster

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny"))


def _text(chars: int, seed: int = 0) -> str:
    rng = random.Random(seed)
    words = "the quick brown fox jumps 123 , . ! def main() return\n \n\n  x \t é über 中文".split(" ")
    out, n = [], 0
    while n < chars:
        w = rng.choice(words)
        out.append(w)
        n += len(w) + 1
    return " ".join(out)


def test_chunked_encoding_is_exact(model_dir):
    tok = Tokenizer(model_dir)
    assert tok.chunk_safe and tok.bytes_per_token > 0
    text = _text(600_000)
    assert len(tok.chunks(text)) > 3
    assert tok.encode(text).tokens.tolist() == tok.hf.encode(text, add_special_tokens=False).ids


def test_over_context_refused_from_length_before_tokenizing(model_dir):
    fx = FeatureExtractor(model_dir, 16)
    fx.context_length = 8192
    body = {"messages": [{"role": "user", "content": "x" * (8192 * fx.tok.bytes_per_token)}]}
    with pytest.raises(ClientError) as e:
        fx.chat(body)
    assert e.value.code == "context_length_exceeded" and e.value.status == 400
    assert "at least" in e.value.message
    assert fx.tok.cache.misses == 0  # never looked up, never encoded


def test_over_context_refused_part_way(model_dir):
    fx = FeatureExtractor(model_dir, 16)
    text = _text(800_000)
    total = len(fx.tok.hf.encode(text, add_special_tokens=False).ids)
    fx.context_length = total // 3
    assert fx.tok.min_tokens(text) < fx.context_length  # the length bound cannot tell
    with pytest.raises(ClientError) as e:
        fx.prompt(text)
    assert e.value.code == "context_length_exceeded"
    n = int(e.value.message.split("at least ")[1].split()[0])
    assert fx.context_length <= n < total  # stopped before the end
    fx.context_length = total + 10
    assert fx.prompt(text).prompt_tokens == total  # one that fits is counted exactly


def test_min_tokens_never_exceeds_the_count(model_dir):
    tok = Tokenizer(model_dir)
    for text in (_text(5000, 1), "x" * 5000, "中文" * 900, "\n" * 3000, " " * 4000):
        assert tok.min_tokens(text) <= len(tok.hf.encode(text, add_special_tokens=False).ids)


def test_pool_cancels_when_the_client_leaves():
    pool = FeaturePool(workers=1, queue=1)
    started, release, seen = threading.Event(), threading.Event(), []

    def work():
        started.set()
        release.wait(5)
        try:
            check_cancel()
            seen.append("ran on")
        except Cancelled:
            seen.append("cancelled")

    async def main():
        gone = asyncio.Event()

        async def disconnected():
            await gone.wait()

        t = asyncio.ensure_future(pool.run(work, disconnected=disconnected))
        while not started.is_set():
            await asyncio.sleep(0.01)
        waiting = asyncio.ensure_future(
            pool.run(lambda: seen.append("queued job ran"), disconnected=disconnected)
        )
        await asyncio.sleep(0.05)
        gone.set()
        for fut in (t, waiting):
            with pytest.raises(Cancelled):
                await fut
        release.set()
        # a slot is free again: a later job runs
        assert await pool.run(lambda: 7) == 7

    asyncio.run(main())
    pool.close()
    assert seen == ["cancelled"] and pool.cancelled == 2


def test_pool_wait_is_bounded_and_started_work_runs_on():
    """A job that has not started ``max_wait_s`` after it was handed in (waiting for a slot, or
    for the thread) never starts and its caller gets Overloaded (feature_wait); the running job
    is not cut."""
    pool = FeaturePool(workers=1, queue=1, max_wait_s=0.3, retry_after_s=2)
    started, release, seen = threading.Event(), threading.Event(), []

    def long_job():
        started.set()
        release.wait(5)
        seen.append("long job done")
        return "long"

    async def main():
        running = asyncio.ensure_future(pool.run(long_job))
        while not started.is_set():
            await asyncio.sleep(0.01)
        t0 = time.monotonic()
        # one waits for the thread (it holds the queue's slot), one for a slot
        for_thread = asyncio.ensure_future(pool.run(lambda: seen.append("queued ran")))
        await asyncio.sleep(0.05)
        for_slot = asyncio.ensure_future(pool.run(lambda: seen.append("waiting ran")))
        for fut in (for_thread, for_slot):
            with pytest.raises(Overloaded) as e:
                await fut
            assert e.value.reason == "feature_wait" and e.value.retry_after_s == 2
            assert 0.25 <= e.value.waited_s < 2.0
        waited = time.monotonic() - t0
        release.set()
        assert await running == "long"  # started work runs to its end
        assert await pool.run(lambda: 7) == 7  # the slots are free again
        return waited

    waited = asyncio.run(main())
    pool.close()
    assert waited < 2.0 and seen == ["long job done"] and pool.timed_out == 2


def test_a_cancelled_wait_keeps_no_slot():
    """A request's task cancelled while it waits for a slot (no disconnect watch) leaves none
    taken: once the running job ends, the next one runs."""
    pool = FeaturePool(workers=1, queue=0)
    release = threading.Event()

    async def main():
        running = asyncio.ensure_future(pool.run(release.wait, 5))
        await asyncio.sleep(0.05)
        waiting = asyncio.ensure_future(pool.run(lambda: "never"))
        await asyncio.sleep(0.05)
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        release.set()
        await running
        return await asyncio.wait_for(pool.run(lambda: 7), 5)

    assert asyncio.run(main()) == 7
    pool.close()


def test_a_request_held_in_the_feature_pool_gets_the_overload_answer(model_dir, monkeypatch):
    """Through the router: the feature pool's one thread is busy, so a request handed to the
    pool waits; past ``router.feature_wait_s`` it gets the overload answer (503 with
    Retry-After, OpenAI's shape; 529 on Anthropic's paths), and once the thread is free a
    request is served."""
    monkeypatch.setenv("SMETRIC_TEST_ADMIN_TOKEN", "x")
    router = {
        "feature_threads": 1,
        "feature_inline_bytes": 0,  # every body to the pool
        "feature_attempt_bytes": 0,
        "feature_wait_s": 0.5,
        "retry_after_s": 3,
    }
    c = Cluster(model_dir, n_prefill=1, n_decode=1, router=router)
    release = threading.Event()
    try:
        busy = c.state.feature_pool.executor.submit(release.wait, 30)  # the pool's one thread
        t0 = time.monotonic()
        r = c.client.post("/v1/chat/completions", json=_chat("held in the feature pool " * 20))
        waited = time.monotonic() - t0
        assert r.status_code == 503 and r.headers["retry-after"] == "3", r.text
        assert (
            r.json()["error"]["code"] == "overloaded" and "tokenizer thread" in r.json()["error"]["message"]
        )
        assert 0.5 <= waited < 5.0
        body = {"model": "tiny", "max_tokens": 1, "messages": [{"role": "user", "content": "held too"}]}
        r = c.client.post("/v1/messages", json=body)
        assert r.status_code == 529 and r.json()["error"]["type"] == "overloaded_error", r.text
        release.set()
        busy.result(5)
        r = c.client.post("/v1/chat/completions", json=_chat("served once the thread is free " * 20))
        assert r.status_code == 200, r.text
    finally:
        release.set()
        c.close()


def test_the_wait_bound_counts_from_admission_the_feature_pool_included(model_dir, monkeypatch):
    """The dispatch queue's wait bound counts from the request's admission, not from its entry
    into the queue: a request that spent 1.5 s waiting for a feature-pool thread (under
    ``feature_wait_s``) and then meets a 1 s queue bound is past it on arrival and gets the
    overload answer at once (reason ``max_queue_wait``), after 1.5 s, not 2.5 s."""
    monkeypatch.setenv("SMETRIC_TEST_ADMIN_TOKEN", "x")
    router = {
        "feature_threads": 1,
        "feature_inline_bytes": 0,  # every body to the pool
        "feature_attempt_bytes": 0,
        "feature_wait_s": 10,
        "dispatch": {"order": "fifo", "max_queue_wait_s": 1, "readiness": {"max_running": 1}},
    }
    c = Cluster(model_dir, n_prefill=1, n_decode=1, router=router)
    release = threading.Event()
    try:
        busy = c.state.feature_pool.executor.submit(release.wait, 30)  # the pool's one thread
        threading.Timer(1.5, release.set).start()
        t0 = time.monotonic()
        r = c.client.post("/v1/chat/completions", json=_chat("held in the feature pool, then queued " * 20))
        waited = time.monotonic() - t0
        busy.result(5)
        assert r.status_code == 503 and r.json()["error"]["code"] == "overloaded", r.text
        assert "max_queue_wait" in c.client.get("/metrics").text
        rejected = c.state.queue.disp.counters.rejected_max_wait
        assert rejected == 1, rejected
        assert 1.5 <= waited < 2.4, waited
        r = c.client.post("/v1/chat/completions", json=_chat("served with the pool free " * 20))
        assert r.status_code == 200, r.text
    finally:
        release.set()
        c.close()


def _chat(content: str) -> dict:
    return {"model": "tiny", "messages": [{"role": "user", "content": content}], "max_tokens": 1}


def test_small_requests_served_while_a_huge_prompt_tokenizes(model_dir, monkeypatch):
    """A ~4 MB prompt (~1M tokens) takes seconds of CPU to tokenize; small requests sent
    while it does must all finish before it (a blocked event loop would serve them after)."""
    monkeypatch.setenv("SMETRIC_TEST_ADMIN_TOKEN", "x")
    c = Cluster(model_dir, n_prefill=2, n_decode=1, model={"context_length": 8_000_000})
    try:
        pool = c.state.feature_pool
        huge = _chat(_text(4_000_000, 7))
        done: dict[str, float] = {}

        def send_huge():
            with httpx.Client(base_url=c.url, timeout=120) as h:
                r = h.post("/v1/chat/completions", json=huge)
            done["huge"] = time.monotonic()
            done["huge_status"] = r.status_code

        with ThreadPoolExecutor(1) as ex:
            fut = ex.submit(send_huge)
            t0 = time.monotonic()
            while pool.running == 0 and "huge" not in done and time.monotonic() - t0 < 60:
                time.sleep(0.005)
            assert "huge" not in done, "the huge prompt finished before it could be overtaken"
            small_done = []
            for i in range(5):
                r = c.client.post("/v1/chat/completions", json=_chat(f"small request {i} " * 20))
                assert r.status_code == 200, r.text
                small_done.append(time.monotonic())
            fut.result(timeout=120)
        assert done["huge_status"] == 200
        assert max(small_done) < done["huge"], "small requests waited for the huge one"
    finally:
        c.close()


def test_policy_without_features_skips_tokenization(model_dir, monkeypatch):
    monkeypatch.setenv("SMETRIC_TEST_ADMIN_TOKEN", "x")
    c = Cluster(model_dir, n_prefill=2, n_decode=1, policy="round-robin")
    try:
        tok = c.state.features.tok
        for i in range(4):
            r = c.client.post("/v1/chat/completions", json=_chat(f"hello {i} " * 50))
            assert r.status_code == 200, r.text
        assert tok.cache.misses == tok.cache.hits == 0  # never tokenized
        # validation still applies, and a prompt that might not fit is counted exactly
        assert c.client.post("/v1/chat/completions", json={"messages": []}).status_code == 400
        r = c.client.post("/v1/chat/completions", json=_chat("word " * 9000))
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    finally:
        c.close()


def test_router_process_freezes_its_startup_heap(monkeypatch):
    """``smetric router`` (create_app(freeze_gc=True)) moves the startup heap out of the
    collector's reach once started, so a full collection does not stall the loop walking
    it; an embedded app (tests, other hosts) leaves the collector alone."""
    import gc

    from fastapi.testclient import TestClient

    from stack.config import parse_config
    from stack.prefill_router.api import app as app_mod

    calls = []
    real = app_mod._freeze_gc
    monkeypatch.setattr(app_mod, "_freeze_gc", lambda: calls.append(True))
    cfg = parse_config({"prefill": [{"url": "http://127.0.0.1:9"}], "router": {"health_interval_s": 60}})
    with TestClient(app_mod.create_app(cfg)):
        assert calls == []
    with TestClient(app_mod.create_app(cfg, freeze_gc=True)):
        assert calls == [True]
    try:
        real()  # what the router process runs: everything alive is frozen
        assert gc.get_freeze_count() > 10_000
    finally:
        gc.unfreeze()


def test_hash_memo_keeps_untracked_tuples(model_dir):
    """The hash memo keeps each prompt's hashes as a tuple of ints, which the collector stops
    tracking: the memo's millions of hashes are not walked by every full collection."""
    import gc

    fx = FeatureExtractor(model_dir, 16)
    fx.chat({"messages": [{"role": "user", "content": _text(20_000)}]})
    gc.collect()
    kept = {id(v[0]): v[0] for v in fx.memo.d.values()}
    assert kept and all(isinstance(t, tuple) and not gc.is_tracked(t) for t in kept.values())


def _session(turns: int, seed: int = 0) -> list[dict]:
    """Chat bodies of one append-only session (~6 KB a turn)."""
    msgs = [{"role": "system", "content": "You are a coding agent."}]
    out = []
    for t in range(turns):
        msgs = msgs + [{"role": "user", "content": _text(6000, seed * 1000 + t)}]
        out.append({"messages": msgs})
        msgs = msgs + [{"role": "assistant", "content": _text(300, seed * 1000 + t + 500)}]
    return out


def test_warm_follow_up_is_derived_inline_and_a_cold_one_offloaded(model_dir):
    """A follow-up whose history is in the token cache is derived on the calling thread (the
    loop) within the budget; a cold body of the same size is refused by the budget before
    anything is tokenized and derived in the pool instead; both give the features of a plain
    derivation."""
    fx = FeatureExtractor(model_dir, 16)
    pool = FeaturePool(workers=1, queue=1, inline_bytes=1024, attempt_bytes=1 << 20, budget_chars=8192)
    bodies = _session(12)
    for b in bodies[:-1]:
        fx.chat(b)  # the session so far: its history is cached
    warm = pool.try_inline(70_000, fx.chat, bodies[-1])
    assert warm is not None and (pool.attempted, pool.offloaded) == (1, 0)

    cold_fx = FeatureExtractor(model_dir, 16)
    puts = len(cold_fx.tok.cache)
    assert pool.try_inline(70_000, cold_fx.chat, bodies[-1]) is None
    assert (pool.attempted, pool.offloaded) == (2, 1) and len(cold_fx.tok.cache) == puts  # nothing tokenized
    cold = asyncio.run(pool.run(cold_fx.chat, bodies[-1]))
    plain = FeatureExtractor(model_dir, 16).chat(bodies[-1])
    for f in (warm, cold):
        assert f.tokens.tolist() == plain.tokens.tolist() and f.hashes == plain.hashes
        assert (f.turn, f.est_hit, f.prompt_tokens) == (plain.turn, plain.est_hit, plain.prompt_tokens)
    assert pool.try_inline(2 << 20, fx.chat, bodies[-1]) is None  # over attempt_bytes: the pool
    pool.close()
