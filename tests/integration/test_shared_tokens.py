"""Router replicas share the token ids of prompt segments through a real Redis: a replica
that missed a session's earlier turns fetches them instead of tokenizing them again, with
the same features; Redis down degrades to local tokenization, never to an error."""

from __future__ import annotations

import random

import numpy as np
import pytest

from stack.config import parse_config
from stack.models.tiny import build_tiny_model
from stack.prefill_router.features import FeatureExtractor
from stack.prefill_router.shared_tokens import SharedTokens

pytestmark = pytest.mark.timeout(60)

WORDS = "the quick brown fox jumps over lazy dog def main return import json print value".split()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny"))


def _session(turns: int, seed: int = 1) -> list[dict]:
    """An agent session's bodies: each turn adds a long user message and a short answer."""
    rng = random.Random(seed)

    def text(n: int) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(n))

    msgs = [{"role": "system", "content": "You are a coding agent. " * 60}]
    bodies = []
    for _ in range(turns):
        msgs = msgs + [{"role": "user", "content": text(400)}]
        bodies.append({"messages": list(msgs)})
        msgs = msgs + [{"role": "assistant", "content": text(30)}]
    return bodies


class _Counting:
    """The HF tokenizer, counting the characters it is asked to encode."""

    def __init__(self, hf) -> None:
        self.hf = hf
        self.chars = 0

    def encode_batch_fast(self, texts, **kw):
        self.chars += sum(len(t) for t in texts)
        return self.hf.encode_batch_fast(texts, **kw)

    def __getattr__(self, name):
        return getattr(self.hf, name)


def _replica(model_dir, url: str | None, **kw) -> tuple[FeatureExtractor, _Counting]:
    fx = FeatureExtractor(model_dir, 16)
    if url is not None:
        fx.tok.shared = SharedTokens(url, model_dir / "tokenizer.json", namespace="t", **kw)
    counting = _Counting(fx.tok.hf)
    fx.tok.hf = counting
    return fx, counting


def test_a_replica_fetches_what_another_tokenized(model_dir, redis_server):
    bodies = _session(6)
    alone, _ = _replica(model_dir, None)
    a, a_enc = _replica(model_dir, redis_server.url)
    b, b_enc = _replica(model_dir, redis_server.url)
    try:
        # a round-robin balancer over two replicas: turns alternate
        for t, body in enumerate(bodies):
            x = (a, b)[t % 2]
            f = x.chat(body)
            ref = alone.chat(body)
            assert np.array_equal(f.tokens, ref.tokens) and f.hashes == ref.hashes, t
            x.tok.shared.flush()
        # b saw turns 1, 3, 5: each time the other replica's latest turn came from Redis
        assert b.tok.shared.counts["hit"] >= 3 and a.tok.shared.counts["hit"] >= 2
        assert a.tok.shared.counts["stored"] > 0 and b.tok.shared.counts["error"] == 0
        # a value that is not whole ids (another writer's key) is tokenized instead
        seg = "q" * 3000
        redis_server.client().set(a.tok.shared.key(seg), b"abc")
        assert a.tok.shared.get([seg]) == [None]
        # what a replica tokenized is about its own share of the session, not all of it
        total = sum(len(m["content"]) for m in bodies[-1]["messages"])
        assert b_enc.chars < 0.6 * total and a_enc.chars < 0.6 * total
        # a replica that saw nothing of the session (a restart, a scale-out) tokenizes
        # only what is too short to share
        c, c_enc = _replica(model_dir, redis_server.url)
        f = c.chat(bodies[-1])
        assert np.array_equal(f.tokens, alone.chat(bodies[-1]).tokens)
        shared_chars = sum(len(m["content"]) for m in bodies[-1]["messages"] if len(m["content"]) >= 1024)
        assert c_enc.chars < total - shared_chars + 2048, (c_enc.chars, total, shared_chars)
        c.tok.shared.close()
    finally:
        a.tok.shared.close()
        b.tok.shared.close()


def test_redis_down_means_local_tokenization(model_dir, redis_server):
    bodies = _session(3, seed=2)
    alone, _ = _replica(model_dir, None)
    a, a_enc = _replica(model_dir, redis_server.url, cooldown_s=30.0)
    try:
        a.chat(bodies[0])
        redis_server.stop()
        f = a.chat(bodies[1])  # the lookup fails: tokenized here, same features
        assert np.array_equal(f.tokens, alone.chat(bodies[1]).tokens)
        assert a.tok.shared.counts["error"] >= 1
        errors = a.tok.shared.counts["error"]
        before = a_enc.chars
        f = a.chat(bodies[2])  # within the cooldown: Redis is not tried again
        assert np.array_equal(f.tokens, alone.chat(bodies[2]).tokens) and a_enc.chars > before
        assert a.tok.shared.counts["error"] == errors
    finally:
        a.tok.shared.close()


def test_keys_are_per_tokenizer(model_dir, tmp_path):
    other = build_tiny_model(tmp_path / "other", vocab_size=300)
    a = SharedTokens("redis://127.0.0.1:1", model_dir / "tokenizer.json")
    b = SharedTokens("redis://127.0.0.1:1", other / "tokenizer.json")
    try:
        assert a.key("x" * 2000) == a.key("x" * 2000) != a.key("y" * 2000)
        assert b.prefix != a.prefix  # two tokenizers never share ids
        assert a.shares("x" * 1024) and not a.shares("x" * 1023)
    finally:
        a.close()
        b.close()


def test_the_router_wires_it_with_replicas(model_dir):
    def cfg(**router):
        return parse_config(
            {
                "model": {"name": "tiny", "path": str(model_dir), "page_size": 16},
                "router": {"redis_url": "redis://127.0.0.1:1/0", **router},
                "prefill": [{"url": "http://127.0.0.1:9", "bootstrap_port": 1}],
                "decode": [{"url": "http://127.0.0.1:10"}],
            }
        )

    from stack.prefill_router.state import RouterState

    on = RouterState(cfg(redis_token_min_chars=4096))
    assert on.features.tok.shared is not None and on.features.tok.shared.min_chars == 4096
    on.features.tok.shared.close()
    off = RouterState(cfg(redis_token_cache=False))
    assert off.features.tok.shared is None


def test_a_redis_that_never_answers_is_no_error(model_dir):
    """A listener that accepts and never answers (a hung Redis): the lookup answers nothing
    shared after its timeout, the tier rests, and writes are not queued meanwhile."""
    import socket

    hung = socket.socket()
    hung.bind(("127.0.0.1", 0))
    hung.listen(8)
    port = hung.getsockname()[1]
    st = SharedTokens(f"redis://127.0.0.1:{port}/0", model_dir / "tokenizer.json", timeout_s=0.2)
    try:
        assert st.get(["x" * 2000, "y" * 2000]) == [None, None]
        assert st.counts["error"] == 1 and st.counts["hit"] == 0
        st.put([("x" * 2000, np.arange(5, dtype="<u4"))])  # resting: not even queued
        assert st._writes.qsize() == 0 and st.get(["x" * 2000]) == [None]
        assert st.counts["error"] == 1
    finally:
        st.close()
        hung.close()


def test_never_asked_from_the_event_loop(model_dir, redis_server):
    """Feature work done on the event loop (small and warm bodies) never waits on Redis: it
    tokenizes what it misses and only queues the write; the feature pool's threads ask."""
    import asyncio

    body = _session(1, seed=4)[0]
    a, _ = _replica(model_dir, redis_server.url)
    b, b_enc = _replica(model_dir, redis_server.url)
    try:
        a.chat(body)  # off the loop: looked up (a miss), then shared
        a.tok.shared.flush()
        assert a.tok.shared.counts["miss"] >= 1 and a.tok.shared.counts["stored"] >= 1

        async def on_loop():
            return b.chat(body)

        f = asyncio.run(on_loop())
        assert b.tok.shared.counts["hit"] == b.tok.shared.counts["miss"] == 0 and b_enc.chars > 0
        assert np.array_equal(f.tokens, a.chat(body).tokens)
    finally:
        a.tok.shared.close()
        b.tok.shared.close()
