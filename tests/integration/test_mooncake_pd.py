"""Real Mooncake under the emulated workers: the global tier (store) and the PD hand-off
(TransferEngine), with a real mooncake_master on free loopback ports."""

from __future__ import annotations

import random
import threading
import time

import pytest

from stack.kv_tier.hashing import block_hashes
from stack.launch.loopback import Procs, client, mooncake_skip_reason
from stack.worker import kvbytes
from stack.worker.cache import matchable_pages, page_hashes
from support.kv_mirror import server_seq, subscribe_synced

_skip = mooncake_skip_reason()
pytestmark = [
    pytest.mark.mooncake,
    pytest.mark.timeout(120),
    pytest.mark.skipif(_skip is not None, reason=_skip or ""),
]

PS = 16
BPT = 32  # emulated KV bytes per token


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    with Procs(tmp_path_factory.mktemp("mooncake-logs")) as p:
        m = p.master()
        common = dict(
            mooncake=m, page_size=PS, kv_bytes_per_token=BPT, time_factor=0.001, bootstrap_timeout_s=20
        )
        a = p.worker("prefill", kv_events=True, name="prefill-a", **common)
        b = p.worker("prefill", kv_events=True, name="prefill-b", **common)
        d = p.worker("decode", name="decode-0", **common)
        yield {"master": m, "a": a, "b": b, "d": d}


@pytest.fixture(scope="module")
def store(stack):
    from stack.kv_tier.mooncake_store import MooncakeStore, StoreConfig

    m = stack["master"]
    s = MooncakeStore(
        StoreConfig(master=m.address, metadata=m.metadata_url, global_segment_bytes=16 << 20)
    ).connect()
    yield s
    s.close()


def _tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 150_000) for _ in range(n)]


def _gen(url: str, tokens: list[int], **extra) -> dict:
    r = client().post(
        url + "/generate",
        json={"input_ids": tokens, "sampling_params": {"max_new_tokens": 4, "ignore_eos": True}, **extra},
    )
    r.raise_for_status()
    return r.json()


def _metric(url: str, name: str) -> float:
    for line in client().get(url + "/metrics").text.splitlines():
        if line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)


def test_store_wrapper_semantics(store):
    key = f"test-{random.randrange(1 << 30)}"
    assert store.get(key) is None and store.batch_is_exist([key]) == [False]
    store.put(key, b"first")
    store.put(key, b"second")  # Mooncake keeps the old value on put
    assert store.get(key) == b"first"
    store.upsert(key, b"third")
    assert store.get(key) == b"third"
    assert store.batch_is_exist([key, key + "-missing"]) == [True, False]
    assert store.put_many([key, key + "-b"], [b"x", b"y"]) == 1
    assert store.get_many([key + "-b", key + "-none"]) == [b"y", None]


def test_prefill_writes_its_blocks_to_the_store(stack, store):
    toks = _tokens(40 * PS + 5, 1)
    r = _gen(stack["a"].url, toks)
    meta = r["meta_info"]
    assert meta["emulator"]["store_written_pages"] == 40
    keys = [kvbytes.store_key("", h) for h in block_hashes(toks, PS)]
    assert store.batch_is_exist(keys) == [True] * 40
    # the bytes are the engine's pages (verifiable by anyone holding the tokens)
    eh = page_hashes(toks, PS)
    assert store.get(keys[7]) == kvbytes.page_bytes(eh[7], PS * BPT)


def test_migrated_follow_up_reads_the_global_tier(stack):
    a, b = stack["a"], stack["b"]
    turn1 = _tokens(64 * PS + 3, 2)
    r1 = _gen(a.url, turn1)
    assert r1["meta_info"]["cached_tokens"] == 0
    g0 = _metric(b.url, "smetric_worker_cached_tokens_global_total")
    mirror = subscribe_synced(b.url, b.kv_events)
    try:
        turn2 = turn1 + _tokens(100, 3)
        r2 = _gen(b.url, turn2)  # migrated: a different prefill worker
        m2 = r2["meta_info"]
        full = len(page_hashes(turn1, PS))
        assert m2["cached_tokens_global"] == full * PS and m2["cached_tokens_local"] == 0
        assert m2["cached_tokens"] == full * PS
        assert m2["emulator"]["fetch_s"] > 0 and m2["ttft"] >= m2["emulator"]["fetch_s"]
        assert _metric(b.url, "smetric_worker_cached_tokens_global_total") == g0 + full * PS
        # the fetched pages now live on b, and its KV events say so
        mirror.sync(server_seq(b.url))
        hs = page_hashes(turn2, PS)
        assert mirror.match_pages(hs, matchable_pages(len(turn2), PS)) == len(hs)
        r3 = _gen(b.url, turn2 + _tokens(50, 4))
        assert r3["meta_info"]["cached_tokens_local"] == len(hs) * PS
        assert r3["meta_info"]["cached_tokens_global"] == 0
    finally:
        mirror.close()


@pytest.mark.parametrize("decode_first", [True, False])
def test_pd_hand_off_moves_the_prefill_bytes(stack, decode_first):
    a, d = stack["a"], stack["d"]
    toks = _tokens(30 * PS + 7, 10 + decode_first)
    room = random.randrange(1 << 62)
    boot = {"bootstrap_host": "127.0.0.1", "bootstrap_port": a.bootstrap_port, "bootstrap_room": room}
    out: dict = {}

    def call(key, url):
        out[key] = _gen(url, toks, **boot)

    first, second = (("d", d.url), ("p", a.url)) if decode_first else (("p", a.url), ("d", d.url))
    t1 = threading.Thread(target=call, args=first)
    t1.start()
    time.sleep(0.3)
    call(*second)
    t1.join(30)
    p_meta, d_meta = out["p"]["meta_info"], out["d"]["meta_info"]
    assert p_meta["completion_tokens"] == 1  # the prefill half answers with its first token
    assert d_meta["completion_tokens"] == 4
    ep, ed = p_meta["emulator"], d_meta["emulator"]
    assert ep["kv_bytes"] == ed["kv_bytes"] == len(toks) * BPT
    assert ed["kv_verified"] is True
    assert ed["kv_received_digest"] == ep["kv_digest"]
    expected = kvbytes.request_kv(toks, page_hashes(toks, PS), PS, BPT)
    assert ep["kv_digest"] == kvbytes.digest(expected)
    assert out["d"]["output_ids"][0] == out["p"]["output_ids"][0]
    assert _metric(d.url, "smetric_worker_kv_transfer_mismatch_total") == 0


def test_decode_waiting_for_a_missing_twin_can_be_aborted(stack):
    d, a = stack["d"], stack["a"]
    out: dict = {}
    boot = {
        "bootstrap_host": "127.0.0.1",
        "bootstrap_port": a.bootstrap_port,
        "bootstrap_room": random.randrange(1 << 62),
        "rid": "orphan",
    }
    t = threading.Thread(target=lambda: out.update(r=_gen(d.url, _tokens(100, 20), **boot)))
    t.start()
    time.sleep(0.5)
    assert client().post(d.url + "/abort_request", json={"rid": "orphan"}).json()["aborted"] == 1
    t.join(10)
    assert out["r"]["meta_info"]["finish_reason"]["type"] == "abort"


def test_aborting_the_prefill_half_fails_the_decode_twin_fast(stack):
    a, d = stack["a"], stack["d"]
    room = random.randrange(1 << 62)
    boot = {"bootstrap_host": "127.0.0.1", "bootstrap_port": a.bootstrap_port, "bootstrap_room": room}
    out: dict = {}
    # the prefill half is aborted while it waits for its twin (the router gave up on the pair)
    tp = threading.Thread(target=lambda: out.update(p=_gen(a.url, _tokens(100, 30), rid="p-half", **boot)))
    tp.start()
    time.sleep(0.2)
    assert client().post(a.url + "/abort_request", json={"rid": "p-half"}).json()["aborted"] == 1
    tp.join(10)
    assert out["p"]["meta_info"]["finish_reason"]["type"] == "abort"
    t0 = time.monotonic()
    body = {
        "input_ids": _tokens(100, 30),
        "sampling_params": {"max_new_tokens": 4, "ignore_eos": True},
        **boot,
    }
    r = client().post(d.url + "/generate", json=body)
    # the failed hand-off answered as SGLang answers it (an abort with status 500), not an
    # empty success
    assert r.status_code == 500 and r.json()["message"], r.text
    assert time.monotonic() - t0 < 5  # not the 20 s bootstrap timeout
