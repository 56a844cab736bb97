"""Publishes SGLang-format KV events over ZMQ PUB, and serves their replay.

Wire format (SGLang 0.5.23): multipart ``[topic, seq (8-byte big-endian), msgpack payload]``,
payload ``[ts, [event, ...], dp_rank]``, each event a tagged map (``{"type": "BlockStored",
...}``). ``seq`` counts messages from 0.

Replay, as SGLang's ``ZmqEventPublisher`` serves it when ``--kv-events-config`` names a
``replay_endpoint``: the last ``buffer_steps`` (10,000) published batches are kept; a ROUTER
socket takes a request ``["", start_seq (8 bytes)]`` from a DEALER and answers each buffered
batch with ``seq >= start_seq`` as ``["", topic, seq, payload]``, then the end marker
``["", "", -1 (8 bytes, signed), ""]``. A subscriber that sees a sequence gap, or starts after
the worker did, asks for what it missed (:mod:`stack.kv_tier.events`).

For tests, :meth:`KVEventPublisher.drop_next` leaves the next batches out of the live stream
(kept for replay), as a PUB socket does to a subscriber that fell behind its high-water mark.
"""

from __future__ import annotations

import collections
import logging
import threading
import time

import msgpack

log = logging.getLogger("stack.worker")

#: SGLang's end-of-replay marker: sequence -1 as 8 signed big-endian bytes
END_SEQ = (-1).to_bytes(8, "big", signed=True)
#: batches SGLang keeps for replay (``ZmqEventPublisher``'s ``buffer_steps``)
BUFFER_STEPS = 10_000


class KVEventPublisher:
    def __init__(
        self,
        endpoint: str | None,
        topic: str = "kv",
        dp_rank: int = 0,
        replay_endpoint: str | None = None,
        buffer_steps: int = BUFFER_STEPS,
    ):
        self.endpoint = endpoint
        self.topic = topic.encode()
        self.dp_rank = dp_rank
        self.seq = -1  # last published sequence number
        self.events_published = 0
        self.replays_served = 0
        self._buffer: collections.deque[tuple[int, bytes]] = collections.deque(maxlen=buffer_steps)
        self._lock = threading.Lock()  # the buffer, between the engine and the replay thread
        self._drop = 0
        self._sock = None
        self._ctx = None
        self._replay_thread: threading.Thread | None = None
        self._stop = threading.Event()
        if endpoint:
            import zmq

            self._ctx = zmq.Context.instance()
            self._sock = self._ctx.socket(zmq.PUB)
            self._sock.setsockopt(zmq.SNDHWM, 100_000)
            self._sock.setsockopt(zmq.LINGER, 0)
            self._sock.bind(_bindable(endpoint))
            if replay_endpoint:
                router = self._ctx.socket(zmq.ROUTER)
                router.setsockopt(zmq.LINGER, 0)
                router.bind(_bindable(replay_endpoint))
                self._replay_thread = threading.Thread(
                    target=self._serve_replay, args=(router,), name="kv-replay", daemon=True
                )
                self._replay_thread.start()

    def publish(self, events: list[dict]) -> None:
        if not events:
            return
        self.seq += 1
        self.events_published += len(events)
        if self._sock is None:
            return
        payload = msgpack.packb([time.time(), events, self.dp_rank], use_bin_type=True)
        seq = self.seq.to_bytes(8, "big")
        with self._lock:
            self._buffer.append((self.seq, payload))
            dropped = self._drop > 0
            self._drop -= dropped
        if not dropped:
            self._sock.send_multipart([self.topic, seq, payload])

    def drop_next(self, n: int) -> None:
        """Leave the next ``n`` batches out of the live stream (still replayable): a forced gap."""
        with self._lock:
            self._drop = max(0, int(n))

    def _serve_replay(self, router) -> None:
        import zmq

        poller = zmq.Poller()
        poller.register(router, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                if not poller.poll(100):
                    continue
                frame = router.recv_multipart()
                if len(frame) != 3 or len(frame[2]) != 8:
                    log.warning("kv-event replay: invalid request of %d frames", len(frame))
                    continue
                client, _, start = frame
                first = int.from_bytes(start, "big")
                with self._lock:
                    batches = [(s, p) for s, p in self._buffer if s >= first]
                for s, p in batches:
                    router.send_multipart([client, b"", self.topic, s.to_bytes(8, "big"), p])
                router.send_multipart([client, b"", b"", END_SEQ, b""])
                self.replays_served += 1
        finally:
            router.close(0)

    def close(self) -> None:
        self._stop.set()
        if self._replay_thread is not None:
            self._replay_thread.join(1.0)
            self._replay_thread = None
        if self._sock is not None:
            self._sock.close(0)
            self._sock = None


def _bindable(endpoint: str) -> str:
    return endpoint.replace("tcp://*", "tcp://0.0.0.0")
