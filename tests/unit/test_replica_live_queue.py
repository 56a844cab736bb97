"""The live queue of one router replica under ``replica_mode: claims``: it publishes the rank
of its next release and releases only while the shared state lets it (a stand-in for
:class:`~stack.prefill_router.shared_heads.SharedHeads`, so no Redis here; the real one is
tests/integration/test_replica_claims.py)."""

from __future__ import annotations

import asyncio
import time

import pytest
from prometheus_client import CollectorRegistry
from test_live_queue import FakeRouting, feats, occupy, until

from stack.config import parse_config
from stack.core.cost_model import load_hardware
from stack.core.types import SLO
from stack.pool import WorkerRegistry
from stack.prefill_router.queue import LiveQueue

pytestmark = pytest.mark.timeout(30)


class FakeClaims:
    """The shared state's side of the rule (stack.prefill_router.queue_replicas.Replicas):
    ``ahead`` replicas rank before every head here."""

    def __init__(self) -> None:
        self.heads_on = False
        self.view_wanted = False
        self.on_heads: list = []
        self.heads: list = []
        self.ahead = 0
        self.asked: list = []

    def subscribe(self, poke, claims: bool) -> None:
        self.on_heads.append(poke)
        self.heads_on = self.heads_on or claims

    def want_view(self, on: bool) -> None:
        self.view_wanted = on

    def fresh(self) -> bool:
        return True

    def set_head(self, key) -> None:
        self.heads.append(key)

    def may_release(self, key, n_ready: int) -> bool:
        self.asked.append((key, n_ready))
        return self.ahead < n_ready

    def exchange(self) -> None:  # what an exchange of heads with Redis ends with
        for cb in self.on_heads:
            cb()


def make(dispatch: dict, shared: FakeClaims | None, slo: SLO | None = None):
    reg = WorkerRegistry(eject_cooldown_s=0)
    reg.add("prefill", "http://127.0.0.1:10000")
    d = parse_config({"router": {"dispatch": dispatch}}).router.dispatch.build()
    routing = FakeRouting(reg)
    q = LiveQueue(
        d, routing, reg, load_hardware("h20").cost, slo or SLO(), CollectorRegistry(), replicas=shared
    )
    return q, reg, routing


def test_claims_is_the_default_with_shared_state_and_own_opts_out():
    s = FakeClaims()
    q, _, _ = make({"order": "slack"}, s)
    assert q.claims.replicas is s and s.heads_on and s.on_heads == [q.poke]
    s = FakeClaims()
    q, _, _ = make({"order": "slack", "replica_mode": "own"}, s)
    assert q.claims is None and not s.heads_on
    assert s.on_heads == [q.poke]  # the others' figures, read while requests wait, still pump
    q, _, _ = make({"order": "slack"}, None)  # one router, no Redis
    assert q.claims is None
    q, _, _ = make({"order": "immediate"}, FakeClaims())  # nothing held, nothing to rank
    assert q.claims is None


def test_a_replica_waits_while_better_ranked_heads_take_the_ready_workers():
    async def go():
        s = FakeClaims()
        q, reg, routing = make({"order": "slack", "readiness": {"max_running": 1}}, s)
        busy = occupy(reg)
        t0 = time.time()
        task = asyncio.create_task(q.route(feats("a"), set(), set(), False))
        await until(lambda: q.depth == 1)
        # the rank it publishes: a feasible request (tier 0) keyed by its deadline, on the
        # replicas' shared clock (wall seconds), about its SLO after now
        key = s.heads[-1]
        assert key[0] == 0 and t0 < key[2] <= time.time() and 0.5 < key[1] - key[2] < 5.0
        s.ahead = 1  # another replica ranks before it
        busy.release()  # the worker is ready, but the other replica's head takes it
        await asyncio.sleep(0.05)
        assert routing.order == [] and q.depth == 1 and s.asked[-1][1] == 1
        s.ahead = 0  # the next exchange of heads: nobody ahead any more
        s.exchange()
        b = await asyncio.wait_for(task, 2)
        assert routing.order == ["a"] and q.depth == 0
        assert s.heads[-1] is None  # nothing left to release: its rank leaves the shared state
        b.release()

    asyncio.run(go())


def test_a_cancelled_last_request_withdraws_the_rank():
    async def go():
        s = FakeClaims()
        q, reg, _ = make({"order": "slack", "readiness": {"max_running": 1}}, s)
        occupy(reg)
        task = asyncio.create_task(q.route(feats("a"), set(), set(), False))
        await until(lambda: q.depth == 1)
        assert s.heads[-1] is not None
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert q.depth == 0 and s.heads[-1] is None

    asyncio.run(go())


def test_a_replica_holding_only_lost_requests_still_releases_them():
    """The router's default far_k (5): a request past 5 x its SLO waits in the order's lost
    queue. A replica whose queue holds only such requests must still rank, or claims mode
    never lets it release them (the simulator's 4-replica matrix run found this)."""

    async def go():
        s = FakeClaims()
        # the default order and keys (far_k 5), nothing ages; SLO 0.2 s: far deadline 1 s
        q, reg, routing = make(
            # (the default's wait bound off: the request waits past 5 x SLO here on purpose)
            {"params": {"age_k": 10}, "readiness": {"max_running": 1}, "max_wait_k": None},
            s,
            slo=SLO(b=0.2, a=0.0),
        )
        assert q.disp.order.far_k == 5.0
        busy = occupy(reg)
        late = asyncio.create_task(q.route(feats("late"), set(), set(), False))
        await until(lambda: q.depth == 1)
        await asyncio.sleep(1.1)  # past 5 x SLO
        fresh = asyncio.create_task(q.route(feats("fresh"), set(), set(), False))
        await until(lambda: q.depth == 2)
        busy.release()
        b = await asyncio.wait_for(fresh, 2)  # the feasible one first; "late" goes to lost
        assert routing.order == ["fresh"] and q.depth == 1
        assert any(h is not None and h[0] == 3 for h in s.heads)  # ranked, last tier
        b.release()
        (await asyncio.wait_for(late, 2)).release()
        assert routing.order == ["fresh", "late"] and q.depth == 0

    asyncio.run(go())


def test_the_shared_clock_is_read_where_no_pause_splits_the_reads(monkeypatch):
    """The rank goes out on the wall clock: the offset of the queue's clock is read between
    two of its readings, and a pause between them (another thread holding the interpreter:
    3 ms once in the unit suite, which put a rank before the request's own arrival) is not
    taken as the offset."""
    from stack.prefill_router import queue_replicas

    walls = iter([1000.0, 1000.010, 1000.020])
    # the first try's second reading comes 5 ms late; the next two read with no gap
    monos = iter([10.0, 10.005, 10.010, 10.010, 10.020, 10.020])
    monkeypatch.setattr(queue_replicas.time, "time", lambda: next(walls))
    assert queue_replicas.wall_offset(lambda: next(monos), 1.0) == pytest.approx(990.0)
    walls = iter([2000.0, 2000.0, 2000.0])
    monos = iter([5.0, 5.0] * 3)
    assert queue_replicas.wall_offset(lambda: next(monos), 0.01) == pytest.approx(2000.0 / 0.01 - 5.0)
