"""Router replicas share, through a real Redis, the memory of the requests their dispatch
queues refused for their wait (stack/prefill_router/shared_refusals.py): refused by one
replica, a request's retry that reaches another is routed at its bound instead of a second
overload answer. While Redis is down each replica knows only its own refusals."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))
from test_live_queue import FakeRouting, feats, metric, occupy  # noqa: E402

from stack.config import parse_config  # noqa: E402
from stack.core.cost_model import load_hardware  # noqa: E402
from stack.core.types import SLO  # noqa: E402
from stack.pool import WorkerRegistry  # noqa: E402
from stack.prefill_router.queue import LiveQueue, Overloaded  # noqa: E402
from stack.prefill_router.shared_state import SharedState  # noqa: E402

pytestmark = pytest.mark.timeout(60)

DISPATCH = {"order": "deadline", "max_queue_wait_s": 0.1, "readiness": {"max_running": 1}}


async def replica(url: str, rid: str):
    """One router replica's dispatch queue over its own view of one busy worker, with the
    replicas' shared state in Redis."""
    reg = WorkerRegistry(eject_cooldown_s=0)
    reg.add("prefill", "http://127.0.0.1:10000")
    shared = SharedState(url, reg, namespace="t", replica_id=rid, heartbeat_s=0.1, ttl_s=1.0)
    await shared.start()
    assert shared.up
    d = parse_config({"router": {"dispatch": DISPATCH}}).router.dispatch.build()
    mr = CollectorRegistry()
    routing = FakeRouting(reg)
    q = LiveQueue(
        d,
        routing,
        reg,
        load_hardware("h20").cost,
        SLO(),
        mr,
        retry_after_s=1,
        replicas=shared.heads,
        refusals=shared.refusals,
    )
    occupy(reg)  # never released: only the bound ends a wait
    return q, routing, mr, shared


async def refused(q: LiveQueue, name: str, hashes: list[int]) -> None:
    with pytest.raises(Overloaded) as ei:
        await asyncio.wait_for(q.route(feats(name, hashes=hashes), set(), set(), False), 3)
    assert ei.value.reason == "max_queue_wait"


def test_a_retry_refused_by_one_replica_is_known_by_another(redis_server):
    async def go():
        qa, _, mra, sa = await replica(redis_server.url, "a")
        qb, routing_b, mrb, sb = await replica(redis_server.url, "b")
        try:
            await refused(qa, "x", [7, 8])
            await sa.refusals.settle()
            r = redis_server.client()
            assert r.get("t:refused:100:8") == b"1" and 0 < r.pttl("t:refused:100:8") <= 120_000
            # its retry reaches replica b: routed at its bound, over every worker
            await asyncio.wait_for(qb.route(feats("x-retry", hashes=[7, 8]), set(), set(), False), 3)
            assert routing_b.order == ["x-retry"] and routing_b.excluded == [set()]
            assert metric(mrb, "smetric_dispatch_overdue_total") == 1
            assert r.get("t:refused:100:8") is None  # used up
            # a stranger at b, and the same prompt once more: both refused as before
            await refused(qb, "y", [9])
            await refused(qb, "x-again", [7, 8])
            assert metric(mrb, "smetric_dispatch_rejected_total", {"reason": "max_queue_wait"}) == 2

            # Redis down: each replica knows only its own refusals
            await sa.refusals.settle()
            await sb.refusals.settle()
            redis_server.stop()
            await refused(qa, "z", [5, 6])
            assert sa.refusals.conn.up is False
            await refused(qb, "z-retry-at-b", [5, 6])  # b never heard of it
            await asyncio.wait_for(qa.route(feats("z-retry-at-a", hashes=[5, 6]), set(), set(), False), 3)
            assert metric(mra, "smetric_dispatch_overdue_total") == 1
        finally:
            for q, s in ((qa, sa), (qb, sb)):
                q.close()
                await s.stop()

    asyncio.run(go())


def test_the_router_wires_it_with_replicas(tmp_path):
    """With ``router.redis_url`` the router's dispatch queue takes the replicas' shared memory
    (its window in wall seconds: the pool's 120 s times ``router.time_factor``); without a
    queue, or without Redis, there is none."""
    from stack.models.tiny import build_tiny_model
    from stack.prefill_router.state import RouterState

    model = build_tiny_model(tmp_path / "tiny")

    def state(**router) -> RouterState:
        cfg = {
            "model": {"name": "tiny", "path": str(model), "page_size": 16},
            "router": {"redis_token_cache": False, **router},
            "prefill": [{"url": "http://127.0.0.1:9", "bootstrap_port": 1}],
            "decode": [{"url": "http://127.0.0.1:10"}],
        }
        return RouterState(parse_config(cfg))

    st = state(redis_url="redis://127.0.0.1:1/0", time_factor=0.5)
    assert st.queue.refusals is st.shared.refusals and st.queue.disp.bounds_waits
    assert st.shared.refusals.ttl_ms == 60_000
    assert state(redis_url="redis://127.0.0.1:1/0", dispatch={"order": "immediate"}).queue.refusals is None
    assert state().queue.refusals is None  # one router: its dispatcher's own memory
