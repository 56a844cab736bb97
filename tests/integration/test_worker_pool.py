"""Many emulated workers in one process (``smetric worker --pool``): concurrent PD traffic across
a pool of prefill workers and a pool of decode workers, each worker with its own endpoint,
KV-event stream, Mooncake store client and TransferEngine; every KV event and every byte lands
on the worker (and twin) it belongs to."""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor

import pytest

from stack.kv_tier.hashing import block_hashes
from stack.launch.loopback import Procs, client, mooncake_skip_reason
from stack.worker import kvbytes
from stack.worker.cache import page_hashes
from support.kv_mirror import server_seq, subscribe_synced

_skip = mooncake_skip_reason()
pytestmark = [
    pytest.mark.mooncake,
    pytest.mark.timeout(180),
    pytest.mark.skipif(_skip is not None, reason=_skip or ""),
]

PS = 16
BPT = 32
N_PREFILL, N_DECODE, PAIRS = 4, 2, 16


@pytest.fixture(scope="module")
def pools(tmp_path_factory):
    with Procs(tmp_path_factory.mktemp("pool-logs")) as p:
        m = p.master()
        common = dict(page_size=PS, kv_bytes_per_token=BPT, time_factor=0.002, bootstrap_timeout_s=20)
        pre = p.pool(
            [dict(mode="prefill", kv_events=True, name=f"prefill-{i}", **common) for i in range(N_PREFILL)],
            mooncake=m,
            name="prefill-pool",
        )
        dec = p.pool(
            [dict(mode="decode", name=f"decode-{i}", **common) for i in range(N_DECODE)],
            mooncake=m,
            name="decode-pool",
        )
        yield m, pre, dec


def _info(url: str) -> dict:
    return client().get(url + "/server_info").json()


def _tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 150_000) for _ in range(n)]


def _gen(url: str, tokens: list[int], boot: dict) -> dict:
    r = client().post(
        url + "/generate",
        json={"input_ids": tokens, "sampling_params": {"max_new_tokens": 3, "ignore_eos": True}, **boot},
    )
    r.raise_for_status()
    return r.json()


def test_pool_members_are_distinct_workers(pools):
    _, pre, dec = pools
    assert len({w.proc.pid for w in pre}) == 1 and len({w.proc.pid for w in dec}) == 1
    infos = [_info(w.url) for w in pre + dec]
    assert [i["emulator"]["name"] for i in infos] == [w.name for w in pre + dec]
    peers = [i["emulator"]["transfer_peer"] for i in infos]
    assert None not in peers and len(set(peers)) == len(peers)  # one TransferEngine each
    clients = [i["emulator"]["store_client"] for i in infos[:N_PREFILL]]
    assert None not in clients and len(set(clients)) == N_PREFILL  # one store client each


def test_concurrent_pd_traffic_lands_on_each_worker(pools):
    m, pre, dec = pools
    mirrors = [subscribe_synced(w.url, w.kv_events) for w in pre]
    before = [_info(w.url)["internal_states"][0] for w in pre + dec]
    jobs = []
    for k in range(PAIRS):
        toks = _tokens(20 * PS + 5 + k, 100 + k)
        boot = {
            "bootstrap_host": "127.0.0.1",
            "bootstrap_port": pre[k % N_PREFILL].bootstrap_port,
            "bootstrap_room": random.randrange(1 << 62),
        }
        jobs.append((k % N_PREFILL, k % N_DECODE, toks, boot))
    with ThreadPoolExecutor(2 * PAIRS) as ex:
        futs = [
            (ex.submit(_gen, pre[p].url, toks, boot), ex.submit(_gen, dec[d].url, toks, boot))
            for p, d, toks, boot in jobs
        ]
        outs = [(fp.result(60), fd.result(60)) for fp, fd in futs]
    try:
        for (p, d, toks, _), (rp, rd) in zip(jobs, outs, strict=True):
            ep, ed = rp["meta_info"]["emulator"], rd["meta_info"]["emulator"]
            assert ep["worker"] == pre[p].name and ed["worker"] == dec[d].name
            assert ep["transport"] == "mooncake"
            assert ep["kv_bytes"] == ed["kv_bytes"] == len(toks) * BPT
            assert ed["kv_verified"] is True and ed["kv_received_digest"] == ep["kv_digest"]
            assert rd["output_ids"][0] == rp["output_ids"][0]
        # KV events: each prefill worker's stream holds its own requests' pages, no one else's
        for i, (w, mirror) in enumerate(zip(pre, mirrors, strict=True)):
            mirror.sync(server_seq(w.url))
            for p, _, toks, _ in jobs:
                hs = page_hashes(toks, PS)
                held = mirror.match_pages(hs, len(hs))
                assert held == (len(hs) if p == i else 0), (w.name, p, held)
        # Mooncake: the global tier holds every request's pages with the engine's bytes, and each
        # worker's counters add up to its own requests
        from stack.kv_tier.mooncake_store import MooncakeStore, StoreConfig

        store = MooncakeStore(
            StoreConfig(master=m.address, metadata=m.metadata_url, global_segment_bytes=16 << 20)
        ).connect()
        try:
            for _, _, toks, _ in jobs:
                keys = [kvbytes.store_key("", h) for h in block_hashes(toks, PS)]
                assert store.batch_is_exist(keys) == [True] * len(keys)
                eh = page_hashes(toks, PS)
                assert store.get(keys[-1]) == kvbytes.page_bytes(eh[-1], PS * BPT)
        finally:
            store.close()
        after = [_info(w.url)["internal_states"][0] for w in pre + dec]
        for i in range(N_PREFILL):
            mine = [toks for p, _, toks, _ in jobs if p == i]
            sent = after[i]["kv_transfer_bytes_sent"] - before[i]["kv_transfer_bytes_sent"]
            assert sent == sum(len(t) * BPT for t in mine)
            wrote = after[i]["store_write_bytes"] - before[i]["store_write_bytes"]
            assert wrote == sum(len(page_hashes(t, PS)) * PS * BPT for t in mine)  # distinct prompts
        for j in range(N_DECODE):
            mine = [toks for _, d, toks, _ in jobs if d == j]
            got = (
                after[N_PREFILL + j]["kv_transfer_bytes_received"]
                - before[N_PREFILL + j]["kv_transfer_bytes_received"]
            )
            assert got == sum(len(t) * BPT for t in mine)
            assert after[N_PREFILL + j]["kv_transfer_mismatch"] == 0
    finally:
        for mirror in mirrors:
            mirror.close()
