"""Publishes SGLang-format KV events over ZMQ PUB.

Wire format (SGLang 0.5.23): multipart ``[topic, seq (8-byte big-endian), msgpack payload]``,
payload ``[ts, [event, ...], dp_rank]``, each event a tagged map (``{"type": "BlockStored",
...}``). ``seq`` counts messages from 0.
"""

from __future__ import annotations

import time

import msgpack


class KVEventPublisher:
    def __init__(self, endpoint: str | None, topic: str = "kv", dp_rank: int = 0):
        self.endpoint = endpoint
        self.topic = topic.encode()
        self.dp_rank = dp_rank
        self.seq = -1  # last published sequence number
        self.events_published = 0
        self._sock = None
        self._ctx = None
        if endpoint:
            import zmq

            self._ctx = zmq.Context.instance()
            self._sock = self._ctx.socket(zmq.PUB)
            self._sock.setsockopt(zmq.SNDHWM, 100_000)
            self._sock.setsockopt(zmq.LINGER, 0)
            self._sock.bind(endpoint.replace("tcp://*", "tcp://0.0.0.0"))

    def publish(self, events: list[dict]) -> None:
        if not events:
            return
        self.seq += 1
        self.events_published += len(events)
        if self._sock is None:
            return
        payload = msgpack.packb([time.time(), events, self.dp_rank], use_bin_type=True)
        self._sock.send_multipart([self.topic, self.seq.to_bytes(8, "big"), payload])

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close(0)
            self._sock = None
