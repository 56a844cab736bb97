"""The live router's dispatch queue (stack/prefill_router/queue.py) on a real event loop
with short timers, over a real worker registry and a stand-in routing step."""

from __future__ import annotations

import asyncio
import math
from types import SimpleNamespace

import orjson
import pytest
from prometheus_client import CollectorRegistry

from stack.config import parse_config
from stack.core.cost_model import load_hardware
from stack.core.types import SLO
from stack.core.types import Request as PRequest
from stack.pool import WorkerRegistry
from stack.prefill_router.api.endpoints import envelope
from stack.prefill_router.queue import LiveQueue, Overloaded
from stack.prefill_router.routing import NoWorker, PrefillRouter

pytestmark = pytest.mark.timeout(30)


class FakeRouting(PrefillRouter):
    """The real routing step's states (no index, global tier or policy; PD); books the first
    healthy prefill worker not excluded, and records who routed."""

    def __init__(self, reg: WorkerRegistry) -> None:
        super().__init__(reg, None, None, None, load_hardware("h20").cost, 16, 0.0)
        self.reg = reg
        self.order: list[str] = []
        self.excluded: list[set[int]] = []

    def request_of(self, f):
        return PRequest(f.prompt_tokens, f.turn, 0, None)

    def lookup(self, f):
        return None  # no prefix index here (the queue asks before it routes)

    async def route(self, f, exclude_p, exclude_d, with_decode, lk=None):
        await asyncio.sleep(0)
        ws = [w for w in self.reg.role("prefill", healthy_only=True) if w.wid not in exclude_p]
        if not ws:
            raise NoWorker("prefill")
        self.order.append(f.name)
        self.excluded.append(set(exclude_p))
        return self.reg.book(ws[0], f.prompt_tokens, 0.01)


def feats(name: str, L: int = 100, turn: int = 0, hashes: list | None = None):
    return SimpleNamespace(
        name=name, prompt_tokens=L, turn=turn, est_hit=0, session_id=None, hashes=hashes or []
    )


def make(dispatch: dict, n_workers: int = 1, slo: SLO | None = None):
    reg = WorkerRegistry(eject_cooldown_s=0)
    for i in range(n_workers):
        reg.add("prefill", f"http://127.0.0.1:{10000 + i}")
    d = parse_config({"router": {"dispatch": dispatch}}).router.dispatch.build()
    routing = FakeRouting(reg)
    mr = CollectorRegistry()
    q = LiveQueue(d, routing, reg, load_hardware("h20").cost, slo or SLO(), mr, retry_after_s=3)
    return q, reg, routing, mr


def occupy(reg: WorkerRegistry, wid: int = 0):
    """One request running on the worker (its prefill not done): with max_running 1 the
    worker is not ready."""
    return reg.book(reg.workers[wid], 10, 0.01)


async def until(cond, timeout: float = 5.0) -> None:
    t = 0.0
    while not cond():
        await asyncio.sleep(0.005)
        t += 0.005
        assert t < timeout, "condition not met"


def metric(mr: CollectorRegistry, name: str, labels: dict | None = None) -> float:
    return mr.get_sample_value(name, labels or {}) or 0.0


def test_immediate_is_the_routing_step_itself():
    async def go():
        q, reg, routing, mr = make({"order": "immediate"})
        assert q.immediate and not reg.on_work_left  # no callback on the hot path
        b = await q.route(feats("a"), set(), set(), False)
        assert routing.order == ["a"] and b.prefill.wid == 0 and q.depth == 0

    asyncio.run(go())


@pytest.mark.parametrize(("order", "expect"), [("fifo", ["big", "small"]), ("deadline", ["small", "big"])])
def test_order_is_honoured(order, expect):
    async def go():
        q, reg, routing, mr = make({"order": order, "readiness": {"max_running": 1}})
        busy = occupy(reg)
        big = asyncio.create_task(q.route(feats("big", 6000), set(), set(), False))
        await until(lambda: q.depth == 1)
        small = asyncio.create_task(q.route(feats("small", 50), set(), set(), False))
        await until(lambda: q.depth == 2)
        assert routing.order == []  # the worker is busy: both wait
        busy.release()  # work left the worker: the pump releases one
        first = await asyncio.wait_for(big if expect[0] == "big" else small, 2)
        assert routing.order == expect[:1] and q.depth == 1
        first.release()
        second = await asyncio.wait_for(small if expect[0] == "big" else big, 2)
        second.release()
        assert routing.order == expect and q.depth == 0
        assert metric(mr, "smetric_dispatch_queue_wait_seconds_count") == 2

    asyncio.run(go())


@pytest.mark.parametrize(("far_k", "expect"), [(0, ["lost", "saved"]), (5, ["saved", "lost"])])
def test_far_k_live(far_k, expect):
    """The router's queue runs the order's far deadline on its own clock: with an SLO of
    0.2 s, "lost" has waited past 5 x SLO (1 s) when the worker frees, "saved" only past
    the ageing bound (2 x SLO); both missed their SLO."""

    async def go():
        params = {"age_k": 2, "steal": 100, "aged_share": 1, "far_k": far_k}
        q, reg, routing, mr = make(
            # the default's wait bound off: "lost" waits past 5 x SLO here on purpose
            {"order": "slack", "params": params, "readiness": {"max_running": 1}, "max_wait_k": None},
            slo=SLO(b=0.2, a=0.0),
        )
        busy = occupy(reg)
        lost = asyncio.create_task(q.route(feats("lost"), set(), set(), False))
        await until(lambda: q.depth == 1)
        await asyncio.sleep(1.1)
        saved = asyncio.create_task(q.route(feats("saved"), set(), set(), False))
        await until(lambda: q.depth == 2)
        await asyncio.sleep(0.6)  # "saved" waited 0.6 s: aged (0.4), not lost (1.0)
        busy.release()
        tasks = {"lost": lost, "saved": saved}
        first = await asyncio.wait_for(tasks[expect[0]], 2)
        first.release()
        (await asyncio.wait_for(tasks[expect[1]], 2)).release()
        assert routing.order == expect

    asyncio.run(go())


def test_not_ready_workers_are_excluded():
    async def go():
        q, reg, routing, mr = make({"order": "fifo", "readiness": {"max_running": 1}}, n_workers=2)
        occupy(reg, 0)
        b = await asyncio.wait_for(q.route(feats("a"), set(), set(), False), 2)
        assert b.prefill.wid == 1 and routing.excluded == [{0}]

    asyncio.run(go())


def test_max_queue_answers_at_once_with_retry_after():
    async def go():
        q, reg, routing, mr = make({"order": "fifo", "max_queue": 1, "readiness": {"max_running": 1}})
        occupy(reg)
        waiting = asyncio.create_task(q.route(feats("a"), set(), set(), False))
        await until(lambda: q.depth == 1)
        with pytest.raises(Overloaded) as ei:
            await q.route(feats("b"), set(), set(), False)
        assert ei.value.reason == "queue_full" and ei.value.retry_after_s == 3
        assert metric(mr, "smetric_dispatch_rejected_total", {"reason": "queue_full"}) == 1
        waiting.cancel()
        return ei.value

    e = asyncio.run(go())
    r = envelope("chat").overloaded(str(e), e.retry_after_s)
    assert r.status_code == 503 and r.headers["retry-after"] == "3"
    assert orjson.loads(r.body)["error"]["code"] == "overloaded"
    r = envelope("messages").overloaded(str(e), e.retry_after_s)
    assert r.status_code == 529 and r.headers["retry-after"] == "3"
    assert orjson.loads(r.body)["error"]["type"] == "overloaded_error"


def test_a_full_queue_sheds_a_first_turn_for_a_follow_up():
    """At max_queue a follow-up takes the place of a waiting first turn: the first turn's
    client gets the overload answer at once, the follow-up is routed once the worker is ready."""

    async def go():
        q, reg, routing, mr = make({"order": "fifo", "max_queue": 1, "readiness": {"max_running": 1}})
        busy = occupy(reg)
        first = asyncio.create_task(q.route(feats("first", turn=1), set(), set(), False))
        await until(lambda: q.depth == 1)
        follow = asyncio.create_task(q.route(feats("follow", turn=3), set(), set(), False))
        with pytest.raises(Overloaded) as ei:
            await asyncio.wait_for(first, 2)
        assert ei.value.reason == "queue_full" and ei.value.retry_after_s >= 3 and q.depth == 1
        assert metric(mr, "smetric_dispatch_rejected_total", {"reason": "queue_full"}) == 1
        assert routing.order == []  # the follow-up still waits for the worker
        busy.release()
        (await asyncio.wait_for(follow, 2)).release()
        assert routing.order == ["follow"] and q.depth == 0

    asyncio.run(go())


def test_max_queue_wait_answers_after_waiting():
    async def go():
        q, reg, routing, mr = make(
            {"order": "deadline", "max_queue_wait_s": 0.1, "readiness": {"max_running": 1}}
        )
        occupy(reg)  # never released: only the wait bound ends it
        t0 = asyncio.get_running_loop().time()
        with pytest.raises(Overloaded) as ei:
            await asyncio.wait_for(q.route(feats("a"), set(), set(), False), 2)
        waited = asyncio.get_running_loop().time() - t0
        assert ei.value.reason == "max_queue_wait" and 0.1 <= waited < 1.0
        assert q.depth == 0 and routing.order == []
        assert metric(mr, "smetric_dispatch_rejected_total", {"reason": "max_queue_wait"}) == 1

    asyncio.run(go())


def test_the_retry_of_a_request_refused_for_its_wait_is_routed_at_its_bound():
    """The live queue runs the dispatcher's rule: refused once for its wait, the same prompt
    (its fingerprint: length and last block hash) is routed at its bound, over every worker,
    instead of a second overload answer; another prompt is refused as before."""

    async def go():
        q, reg, routing, mr = make(
            {"order": "deadline", "max_queue_wait_s": 0.1, "readiness": {"max_running": 1}}
        )
        occupy(reg)  # never released: only the bound ends a wait
        with pytest.raises(Overloaded):
            await asyncio.wait_for(q.route(feats("a", hashes=[7, 8]), set(), set(), False), 2)
        t0 = asyncio.get_running_loop().time()
        retry = asyncio.create_task(q.route(feats("a-retry", hashes=[7, 8]), set(), set(), False))
        with pytest.raises(Overloaded):  # a stranger, at the same time
            await asyncio.wait_for(q.route(feats("b", hashes=[9]), set(), set(), False), 2)
        await asyncio.wait_for(retry, 2)  # routed (the worker is busy: it queues there)
        assert 0.1 <= asyncio.get_running_loop().time() - t0 < 1.0
        assert routing.order == ["a-retry"] and routing.excluded == [set()]
        assert metric(mr, "smetric_dispatch_overdue_total") == 1
        assert metric(mr, "smetric_dispatch_rejected_total", {"reason": "max_queue_wait"}) == 2
        assert q.depth == 0 and q.gate == 0

    asyncio.run(go())


def test_the_wait_bound_follows_each_requests_slo_and_retry_after_the_drain():
    """max_wait_k x the request's own SLO bounds its wait (here 2 x 0.1 s); the overload
    answer's Retry-After is the queue's drain estimate (prefill seconds queued over the
    workers), not less than router.retry_after_s (3 here) nor more than 60 s."""

    async def go():
        q, reg, routing, mr = make(
            {"order": "deadline", "max_wait_k": 2, "max_queue_wait_s": None, "readiness": {"max_running": 1}},
            slo=SLO(b=0.1, a=0.0),
        )
        occupy(reg)
        t0 = asyncio.get_running_loop().time()
        with pytest.raises(Overloaded) as ei:
            await asyncio.wait_for(q.route(feats("a"), set(), set(), False), 2)
        waited = asyncio.get_running_loop().time() - t0
        assert ei.value.reason == "max_queue_wait" and 0.2 <= waited < 1.0
        assert ei.value.retry_after_s == 3  # nothing queued any more: the floor

        # (an SLO the big ones can meet: a hopeless one would be shed for the newcomer)
        q, reg, routing, mr = make(
            {"order": "fifo", "max_queue": 2, "readiness": {"max_running": 1}}, slo=SLO(b=100.0)
        )
        occupy(reg)
        big = [asyncio.create_task(q.route(feats(n, L=30_000), set(), set(), False)) for n in "ab"]
        await until(lambda: q.depth == 2)
        drain = q.disp.drain_s(1)
        with pytest.raises(Overloaded) as ei:
            await q.route(feats("c"), set(), set(), False)
        assert ei.value.reason == "queue_full" and drain > 3
        assert ei.value.retry_after_s == min(60, math.ceil(drain))
        for t in big:
            t.cancel()

    asyncio.run(go())


def test_cancelled_waiter_leaves_the_queue():
    async def go():
        q, reg, routing, mr = make({"order": "fifo", "readiness": {"max_running": 1}})
        busy = occupy(reg)
        t = asyncio.create_task(q.route(feats("gone"), set(), set(), False))
        await until(lambda: q.depth == 1)
        t.cancel()
        with pytest.raises(asyncio.CancelledError):
            await t
        assert q.depth == 0 and metric(mr, "smetric_dispatch_cancelled_total") == 1
        busy.release()
        b = await asyncio.wait_for(q.route(feats("next"), set(), set(), False), 2)
        assert routing.order == ["next"] and q.gate == 0
        b.release()

    asyncio.run(go())


def test_ejected_worker_waiters_go_to_survivors_or_get_no_worker():
    async def go():
        q, reg, routing, mr = make({"order": "fifo", "readiness": {"max_running": 1}}, n_workers=2)
        occupy(reg, 0)
        busy1 = occupy(reg, 1)
        a = asyncio.create_task(q.route(feats("a"), set(), set(), False))
        await until(lambda: q.depth == 1)
        reg.mark_failed(reg.workers[0], 1, immediate=True)  # no change for a: 1 is busy
        busy1.release()
        b = await asyncio.wait_for(a, 2)
        assert b.prefill.wid == 1
        # now the survivor is busy and fails too: the waiter is answered no_worker
        c = asyncio.create_task(q.route(feats("c"), set(), set(), False))
        await until(lambda: q.depth == 1)
        reg.mark_failed(reg.workers[1], 1, immediate=True)
        with pytest.raises(NoWorker):
            await asyncio.wait_for(c, 2)
        assert q.depth == 0 and q.gate == 0

    asyncio.run(go())


@pytest.mark.parametrize(
    "bad",
    [
        {"order": "nope"},
        {"order": "immediate", "max_queue": 3},  # bounds need a queue
        {"order": "fifo", "params": {"zz": 1}},
        {"order": "fifo", "readiness": {"max_queued_s": 0}},
        {"order": "fifo", "unknown": 1},
    ],
)
def test_config_rejects(bad):
    with pytest.raises(ValueError):
        parse_config({"router": {"dispatch": bad}})
