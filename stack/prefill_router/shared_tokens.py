"""Segment token ids shared by router replicas through Redis (``router.redis_token_cache``).

Each replica keeps its own token cache (:class:`~stack.prefill_router.tokenizer.SegmentCache`,
keyed by a segment's text). Behind a round-robin load balancer a replica sees one turn in N
of a session, so it would tokenize again the messages the other replicas saw; with this
tier, a segment one replica tokenized is fetched by the others in one ``MGET`` instead.

- Keys: ``<ns>:tok:<tokenizer>:<digest>``, the tokenizer a digest of its ``tokenizer.json``
  (two models never share ids) and the segment a 128-bit BLAKE2b of its UTF-8 text; values
  the ids as little-endian uint32. Every key expires ``ttl_s`` after its last write (the
  bound: what is not re-written within the TTL leaves).
- Only segments of at least ``min_chars`` characters are shared (a short one is cheaper to
  tokenize than to look up).
- Lookups are synchronous, one round trip within ``timeout_s``, and made only from the
  feature pool's threads (:meth:`~stack.prefill_router.tokenizer.Tokenizer.encode` skips
  them on the event loop, where small and warm bodies are derived). Writes go to one
  background thread through a bounded queue, so a request never waits on them; when the
  queue is full, writes are dropped.
- Redis failing never fails a request: the lookup answers "nothing shared", and the tier
  stays off for ``cooldown_s`` before it is tried again.
"""

from __future__ import annotations

import hashlib
import logging
import queue
import threading
import time
from pathlib import Path

import numpy as np

log = logging.getLogger("stack.router")

OUTCOMES = ("hit", "miss", "stored", "error", "dropped")


class SharedTokens:
    def __init__(
        self,
        url: str,
        tokenizer_file: str | Path,
        namespace: str = "smetric",
        ttl_s: float = 600.0,
        timeout_s: float = 0.1,
        min_chars: int = 1024,
        cooldown_s: float = 5.0,
        max_pending: int = 256,
        metrics_registry=None,
    ) -> None:
        from stack.prefill_router.shared_connection import one_try_client

        # one try per call: a lookup that fails is answered "nothing shared" within timeout_s
        self.redis = one_try_client(url, timeout_s, asyncio=False)
        tok = hashlib.blake2b(Path(tokenizer_file).read_bytes(), digest_size=8).hexdigest()
        self.prefix = f"{namespace}:tok:{tok}:".encode()
        self.ttl_ms = max(1, int(ttl_s * 1000))
        self.min_chars = min_chars
        self.cooldown_s = cooldown_s
        self.down_until = 0.0
        self.counts = dict.fromkeys(OUTCOMES, 0)
        self._counter = None
        if metrics_registry is not None:
            from prometheus_client import Counter

            self._counter = Counter(
                "smetric_shared_token_segments",
                "Segments looked up in or written to the replicas' shared token cache, by outcome",
                ["outcome"],
                registry=metrics_registry,
            )
        self._writes: queue.Queue = queue.Queue(max_pending)
        self._writer = threading.Thread(target=self._write_loop, name="shared-tokens", daemon=True)
        self._writer.start()

    # -- lookups ------------------------------------------------------------------------
    def key(self, seg: str) -> bytes:
        return self.prefix + hashlib.blake2b(seg.encode("utf-8", "surrogatepass"), digest_size=16).digest()

    def shares(self, seg: str) -> bool:
        return len(seg) >= self.min_chars

    def get(self, segs: list[str]) -> list[np.ndarray | None]:
        """The shared ids of each segment (None: not shared, or the tier is down)."""
        if not segs or time.monotonic() < self.down_until:
            return [None] * len(segs)
        try:
            vals = self.redis.mget([self.key(s) for s in segs])
        except Exception as e:  # noqa: BLE001 - any client failure: tokenize locally
            self._down(e)
            return [None] * len(segs)
        # a value that is not whole uint32s is not ours: tokenized here instead
        out = [None if v is None or len(v) % 4 else np.frombuffer(v, dtype="<u4") for v in vals]
        hits = sum(v is not None for v in out)
        self._count("hit", hits)
        self._count("miss", len(out) - hits)
        return out

    # -- writes -------------------------------------------------------------------------
    def put(self, items: list[tuple[str, np.ndarray]]) -> None:
        """Share these segments' ids (in the background; dropped when the queue is full)."""
        if not items or time.monotonic() < self.down_until:
            return
        try:
            self._writes.put_nowait(
                [(self.key(s), np.ascontiguousarray(a, dtype="<u4").tobytes()) for s, a in items]
            )
        except queue.Full:
            self._count("dropped", len(items))

    def _write_loop(self) -> None:
        while True:
            batch = self._writes.get()
            try:
                if batch is None:
                    return
                pipe = self.redis.pipeline(transaction=False)
                for k, v in batch:
                    pipe.set(k, v, px=self.ttl_ms)
                pipe.execute()
                self._count("stored", len(batch))
            except Exception as e:  # noqa: BLE001
                self._down(e)
            finally:
                self._writes.task_done()

    def flush(self, timeout: float = 5.0) -> None:
        """Wait until the writes queued so far are done (tests, benchmarks)."""
        t0 = time.monotonic()
        while self._writes.unfinished_tasks and time.monotonic() - t0 < timeout:
            time.sleep(0.005)

    def close(self) -> None:
        try:
            self._writes.put(None, timeout=1.0)
        except queue.Full:
            pass
        self._writer.join(timeout=2.0)
        self.redis.close()

    # -- bookkeeping --------------------------------------------------------------------
    def _down(self, e: BaseException) -> None:
        if time.monotonic() >= self.down_until:
            log.warning(
                "shared token cache unavailable (%s); tokenizing locally for %.0f s", e, self.cooldown_s
            )
        self.down_until = time.monotonic() + self.cooldown_s
        self._count("error", 1)

    def _count(self, outcome: str, n: int) -> None:
        if n:
            self.counts[outcome] += n
            if self._counter is not None:
                self._counter.labels(outcome).inc(n)
