"""KV-event replay over real ZMQ sockets: the emulated worker's publisher (stack/worker/events.py,
SGLang's replay protocol) and the router's subscriber (stack/kv_tier/events.py).

A gap the publisher's buffer still covers is recovered, in order, without dropping the worker's
index; a subscriber that starts late replays what the buffer holds; a gap the buffer no longer
covers, no replay endpoint, or one that does not answer drops the index as before."""

from __future__ import annotations

import asyncio

import pytest

from stack.kv_tier.events import KVEventSubscriber
from stack.ports import free_port
from stack.worker.events import KVEventPublisher

pytestmark = pytest.mark.timeout(60)


def _batch(i: int) -> list[dict]:
    return [
        {
            "type": "BlockStored",
            "block_hashes": [1000 + i],
            "parent_block_hash": None,
            "token_ids": [i] * 4,
            "block_size": 4,
        }
    ]


class Feed:
    """A publisher and a subscriber on free loopback ports; what the subscriber applied, in order."""

    def __init__(
        self, replay: bool = True, buffer_steps: int = 10_000, subscribe_replay: str | None = None
    ) -> None:
        self.pub_ep = f"tcp://127.0.0.1:{free_port()}"
        self.rep_ep = f"tcp://127.0.0.1:{free_port()}" if replay else None
        self.pub = KVEventPublisher(self.pub_ep, "kv", 0, self.rep_ep, buffer_steps)
        self.applied: list[int] = []
        self.gaps = 0
        self.sub = KVEventSubscriber(
            self.pub_ep,
            "kv",
            lambda b: self.applied.extend(e.block_hashes[0] - 1000 for e in b.events),
            self._gap,
            replay=subscribe_replay if subscribe_replay is not None else self.rep_ep,
            replay_timeout_s=0.5,
        )
        self.n = 0

    def _gap(self) -> None:
        self.gaps += 1

    def publish(self, k: int) -> None:
        for _ in range(k):
            self.pub.publish(_batch(self.n))
            self.n += 1

    async def until(self, cond, timeout: float = 5.0) -> None:
        deadline = asyncio.get_running_loop().time() + timeout
        while not cond():
            assert asyncio.get_running_loop().time() < deadline, (self.applied, self.gaps)
            await asyncio.sleep(0.02)

    async def connected(self) -> None:
        """Past ZMQ's slow-joiner window: a live batch reached the subscriber."""
        self.sub.start()
        await asyncio.sleep(0.2)
        while True:
            before = len(self.applied)
            self.publish(1)
            await asyncio.sleep(0.1)
            if len(self.applied) > before:
                return

    async def close(self) -> None:
        await self.sub.stop()
        self.pub.close()


def test_a_gap_the_buffer_covers_is_recovered_in_order():
    async def go():
        f = Feed()
        await f.connected()
        f.publish(3)
        f.pub.drop_next(4)  # the live stream loses 4 batches; the buffer keeps them
        f.publish(6)
        await f.until(lambda: len(f.applied) == f.n)
        assert f.applied == list(range(f.n)) and f.gaps == 0
        assert f.sub.recovered_gaps == 1 and f.sub.dropped_gaps == 0 and f.sub.replayed >= 4
        assert f.pub.replays_served >= 1
        await f.close()

    asyncio.run(go())


def test_a_late_subscriber_replays_what_the_buffer_holds():
    async def go():
        f = Feed()
        f.publish(5)  # before the subscriber exists: a restarted router's situation
        await f.connected()
        f.publish(2)
        await f.until(lambda: len(f.applied) >= f.n)
        assert f.applied == list(range(f.n)) and f.gaps == 0 and f.sub.replayed >= 5
        await f.close()

    asyncio.run(go())


def test_a_gap_past_the_buffer_drops_the_index():
    async def go():
        f = Feed(buffer_steps=2)
        await f.connected()
        f.pub.drop_next(5)
        f.publish(6)
        await f.until(lambda: f.gaps == 1 and f.applied[-1] == f.n - 1)
        assert f.sub.dropped_gaps == 1 and f.sub.recovered_gaps == 0
        await f.close()

    asyncio.run(go())


@pytest.mark.parametrize("replay", ["none", "silent"])
def test_without_a_replay_the_gap_drops_the_index(replay):
    async def go():
        silent = f"tcp://127.0.0.1:{free_port()}"  # nothing listens there
        f = Feed(replay=replay != "none", subscribe_replay="" if replay == "none" else silent)
        await f.connected()
        f.pub.drop_next(2)
        f.publish(3)
        await f.until(lambda: f.gaps == 1 and f.applied[-1] == f.n - 1)
        assert f.sub.dropped_gaps == 1
        await f.close()

    asyncio.run(go())
