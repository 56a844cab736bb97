"""The router's prefix index (stack.kv_tier.index), fed only by the emulators' KV events
(decoded by stack.kv_tier.events), predicts every emulator's local hits exactly — although
the engine hashes pages with its own scheme (mapped through the events' token ids)."""

from __future__ import annotations

import random

import pytest

from stack.kv_tier.events import decode_payload, decode_seq
from stack.kv_tier.hashing import block_hashes
from stack.kv_tier.index import PrefixIndex
from stack.launch.loopback import Procs, client
from stack.worker.cache import matchable_pages
from support.kv_mirror import server_seq, subscribe_synced

pytestmark = pytest.mark.timeout(120)
PS = 16


class _Feed:
    """A ZMQ subscriber applying one worker's events to the router's index."""

    def __init__(self, index: PrefixIndex, wid: int, url: str, endpoint: str):
        self.index, self.wid, self.url = index, wid, url
        index.add_worker(wid, events=True)
        # reuse the fixture's socket, already past ZMQ's slow-joiner window
        self.m = subscribe_synced(url, endpoint)
        self.seq = self.m.seq

    def sync(self) -> None:
        import zmq

        want = server_seq(self.url)
        while self.seq < want:
            if not self.m.sock.poll(5000, zmq.POLLIN):
                raise TimeoutError(f"worker {self.wid}: seq {self.seq} < {want}")
            _, seq_b, payload = self.m.sock.recv_multipart()
            seq = decode_seq(seq_b)
            assert seq == self.seq + 1, "gap in KV events"
            self.seq = seq
            self.index.apply(self.wid, decode_payload(payload))


def test_router_index_predicts_local_hits(tmp_path):
    with Procs(tmp_path) as procs:
        workers = [
            procs.worker(
                "prefill",
                kv_events=True,
                page_size=PS,
                capacity_tokens=2048,
                time_factor=0.001,
                name=f"prefill-{i}",
            )
            for i in range(2)
        ]
        index = PrefixIndex(PS)
        feeds = [_Feed(index, i, w.url, w.kv_events) for i, w in enumerate(workers)]
        try:
            rng = random.Random(3)
            sessions = [[rng.randrange(1, 5000) for _ in range(rng.randrange(20, 200))] for _ in range(8)]
            checked = hits = 0
            for step in range(60):
                i = rng.randrange(len(sessions))
                s = sessions[i]
                s.extend(rng.randrange(1, 5000) for _ in range(rng.randrange(1, 120)))
                if len(s) > 1500:
                    sessions[i] = s = s[:40]
                wid = rng.randrange(2)  # sessions wander between workers
                for f in feeds:
                    f.sync()
                rh = block_hashes(s, PS)
                predicted = min(index.hits(rh).get(wid, 0), matchable_pages(len(s), PS)) * PS
                r = (
                    client()
                    .post(
                        workers[wid].url + "/generate",
                        json={"input_ids": s, "sampling_params": {"max_new_tokens": 1}},
                    )
                    .json()
                )
                assert r["meta_info"]["cached_tokens_local"] == predicted, (step, wid)
                checked += 1
                hits += predicted > 0
            assert checked == 60 and hits >= 15
            evicted = [
                client()
                .get(w.url + "/server_info")
                .json()["internal_states"][0]["cache_stats"]["removed_pages"]
                for w in workers
            ]
            assert sum(evicted) > 0
        finally:
            for f in feeds:
                f.m.close()
