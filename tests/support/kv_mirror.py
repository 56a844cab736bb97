"""A KV-event mirror for tests: a ZMQ subscriber decoding SGLang's wire format into the set of
blocks an engine holds, and the helpers that sync it with a live worker."""

from __future__ import annotations

import time

from stack.launch.loopback import client


class KVMirror:
    """Mirrors an engine's cache from its KV events: a set of block hashes.

    Decodes SGLang's multipart ``[topic, seq, msgpack([ts, events, dp_rank])]`` with events as
    tagged maps (0.5.23) or positional lists (older producers).
    """

    def __init__(self, endpoint: str, topic: str = "kv"):
        import zmq

        self.ctx = zmq.Context.instance()
        self.sock = self.ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, topic.encode())
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)
        self.blocks: dict[int, list[int]] = {}
        self.seq = -1
        self.gaps = 0
        self.messages = 0
        self.events: list[dict] = []

    def close(self) -> None:
        self.sock.close(0)

    def poll(self, timeout_ms: int = 50) -> int:
        import msgpack
        import zmq

        n = 0
        while self.sock.poll(timeout_ms, zmq.POLLIN):
            topic, seq_b, payload = self.sock.recv_multipart()
            seq = int.from_bytes(seq_b, "big")
            if self.seq >= 0 and seq != self.seq + 1:
                self.gaps += 1
            self.seq = seq
            ts, events, *rest = msgpack.unpackb(payload, raw=False)
            for ev in events:
                self.apply(ev)
            self.messages += 1
            n += 1
            timeout_ms = 0
        return n

    def apply(self, ev) -> None:
        if isinstance(ev, (list, tuple)):  # positional form
            kind = ev[0]
            ev = {
                "type": kind,
                **(
                    {
                        "block_hashes": ev[1],
                        "parent_block_hash": ev[2] if len(ev) > 2 else None,
                        "token_ids": ev[3] if len(ev) > 3 else [],
                        "block_size": ev[4] if len(ev) > 4 else 0,
                    }
                    if kind == "BlockStored"
                    else {"block_hashes": ev[1]}
                    if kind == "BlockRemoved"
                    else {}
                ),
            }
        self.events.append(ev)
        t = ev["type"]
        if t == "BlockStored":
            bs = ev["block_size"]
            toks = ev["token_ids"]
            for i, h in enumerate(ev["block_hashes"]):
                self.blocks[h] = toks[i * bs : (i + 1) * bs]
        elif t == "BlockRemoved":
            for h in ev["block_hashes"]:
                self.blocks.pop(h, None)
        elif t == "AllBlocksCleared":
            self.blocks.clear()

    def sync(self, seq: int, timeout: float = 10.0) -> None:
        """Consume events until ``seq`` (the worker's last published number) is seen."""
        deadline = time.monotonic() + timeout
        while self.seq < seq:
            if time.monotonic() > deadline:
                raise TimeoutError(f"KV events: at seq {self.seq}, waiting for {seq}")
            self.poll(50)

    def match_pages(self, hashes: list[int], limit: int) -> int:
        k = 0
        while k < min(limit, len(hashes)) and hashes[k] in self.blocks:
            k += 1
        return k


def server_seq(url: str) -> int:
    return int(client().get(url + "/server_info").json()["internal_states"][0]["kv_events_seq"])


def subscribe_synced(url: str, endpoint: str, timeout: float = 10.0) -> KVMirror:
    """A mirror connected to a fresh worker, past ZMQ's slow-joiner window: flush the cache
    (an ``AllBlocksCleared`` event) until the mirror receives one."""
    m = KVMirror(endpoint)
    deadline = time.monotonic() + timeout
    while True:
        client().post(url + "/flush_cache")
        time.sleep(0.05)
        if m.poll(100) and any(e["type"] == "AllBlocksCleared" for e in m.events):
            m.sync(server_seq(url))
            return m
        if time.monotonic() > deadline:
            raise TimeoutError("no KV events received from " + endpoint)
