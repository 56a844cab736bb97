"""Routing owns the view: a queued request asks the prefix index and the global tier once,
though three steps read its hits (the bypass rule at admission, the affinity rule at its
release, the policy's choice). Its :class:`~stack.prefill_router.routing.Lookup` travels from
admission to the routing step."""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client import CollectorRegistry

from stack.config import parse_config
from stack.core.types import SLO
from stack.dispatch import DispatchSpec
from stack.policies import PolicyContext, make_policy
from stack.pool import WorkerRegistry
from stack.prefill_router.queue import LiveQueue
from stack.prefill_router.routing import PrefillRouter
from tests.unit.test_bypass import BS, BW, COST, FROZEN, _feats, _Global, _Index

pytestmark = pytest.mark.timeout(30)


class _CountingIndex(_Index):
    def __init__(self, hits: dict[int, int]) -> None:
        super().__init__(hits)
        self.asked = 0

    def hits(self, hashes):
        self.asked += 1
        return super().hits(hashes)


def _stack(label: str, local: dict[int, int], g: int):
    disp = parse_config(
        {"router": {"dispatch": DispatchSpec.parse(label).to_config()}}
    ).router.dispatch.build()
    reg = WorkerRegistry(eject_cooldown_s=0)
    for i in range(2):
        reg.add("prefill", f"http://127.0.0.1:{22000 + i}")
    index, glob = _CountingIndex(local), _Global(g)
    policy = make_policy("smetric-global", PolicyContext(COST, SLO(), BS))
    routing = PrefillRouter(reg, index, glob, policy, COST, BS, BW, time_factor=FROZEN)
    q = LiveQueue(disp, routing, reg, COST, SLO(), CollectorRegistry(), time_factor=FROZEN)
    return q, reg, index, glob


def test_a_queued_request_asks_the_index_and_the_global_tier_once():
    """Worker 0 holds the whole prefix but is busy; worker 1 is busy too, then frees. The
    request is held (nothing to fetch where the prefix is: not bypassed), released to worker 1
    with worker 0 not ready, where the affinity rule weighs the fetch (the global tier asked
    then, once) and routes it over both: three readers, one look-up each."""

    async def go():
        n = 2_000
        q, reg, index, glob = _stack("slack:T=4:bypass=1:affinity=1", {0: n}, n)
        busy0 = reg.book(reg.workers[0], 400_000, 20.0)
        busy1 = reg.book(reg.workers[1], 400_000, 20.0)
        task = asyncio.create_task(q.route(_feats("r", n * BS + 1), set(), set(), False))
        for _ in range(200):
            if q.depth == 1:
                break
            await asyncio.sleep(0.005)
        assert q.depth == 1 and index.asked == 1 and glob.asked == 0  # admission: local hits only
        busy1.release()
        routed = await asyncio.wait_for(task, 5)
        assert q.metrics.unbound._value.get() == 1  # the affinity rule read the hits too
        assert routed.local_hit in (0, n * BS)  # the policy chose on them (the holder, or not)
        assert index.asked == 1 and glob.asked == 1
        routed.release()
        busy0.release()

    asyncio.run(go())


@pytest.mark.parametrize("label", ["immediate", "slack:T=4:bypass=1:affinity=1"])
def test_a_request_routed_at_once_asks_each_once(label):
    async def go():
        q, reg, index, glob = _stack(label, {}, 2_000)
        routed = await asyncio.wait_for(q.route(_feats("r", 2_000 * BS + 1), set(), set(), False), 5)
        assert index.asked == 1 and glob.asked == 1
        routed.release()

    asyncio.run(go())
