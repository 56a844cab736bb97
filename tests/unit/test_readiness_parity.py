"""Readiness parity: the live router and the simulator, each building its dispatcher and its
instance states its own way (the router from ``router.dispatch`` and its worker registry,
the simulator from its config's dispatch label and its instances), make the same readiness
decisions on the same cluster states, with the adaptive rule (T from the traffic's SLOs,
the fetch as lead time) as with today's fixed threshold.

The live router measures no link backlog (its states carry ``fetch_backlog_s`` 0), so the
driver-level cases have none; the rule's handling of a backlog is one object in both drivers
(tests/unit/test_readiness_slo.py)."""

from __future__ import annotations

import asyncio
import random
from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry

from stack.config import parse_config
from stack.core.cost_model import load_hardware
from stack.core.types import SLO, InstanceState, Request
from stack.dispatch import DispatchSpec, Entry, estimate_size
from stack.pool import WorkerRegistry
from stack.prefill_router.queue import LiveQueue
from stack.prefill_router.routing import PrefillRouter
from stack.sim.config import SimConfig
from stack.sim.queues import RouterQueue

HW = load_hardware("h20")
COST = HW.cost
SPECS = (
    "slack:T=4",
    "slack:slo_k=1",
    "slack:lead_share=1:slo_k=0.75",
    "slack:lead_share=0",
    "deadline-defer:lead_queue=1:slo_k=0.5",
    "fifo:slo_k=0.5:slo_q=0.25",
)
#: the live router's bookings are wall-clock; this many wall seconds per pool second makes
#: the time the test itself takes vanish from its queued seconds
FROZEN = 1e12


class _Routing(PrefillRouter):
    """The real routing step's states (no index, global tier or policy)."""

    def __init__(self, reg: WorkerRegistry) -> None:
        super().__init__(reg, None, None, None, COST, 64, 0.0, time_factor=FROZEN)


def _router(label: str, jobs: list[list[float]]):
    """The router's dispatcher (from its config) and its states (PrefillRouter.load_states)."""
    spec = DispatchSpec.parse(label)
    disp = parse_config({"router": {"dispatch": spec.to_config()}}).router.dispatch.build()
    reg = WorkerRegistry(eject_cooldown_s=0)
    ws = [reg.add("prefill", f"http://127.0.0.1:{20000 + i}") for i in range(len(jobs))]
    for w, js in zip(ws, jobs, strict=True):
        for s in js:
            reg.book(w, max(1, int(s / COST.c_linear)), s)
    q = LiveQueue(disp, _Routing(reg), reg, COST, SLO(), CollectorRegistry(), time_factor=FROZEN)
    return disp, q.routing.load_states(0.0, ws)


def _sim(label: str, jobs: list[list[float]]):
    """The simulator's dispatcher (as its engine builds it from SimConfig) and its states
    (RouterQueue.load over its instances)."""
    spec = DispatchSpec.parse(label)
    cfg = SimConfig(dispatch=spec)
    disp = cfg.dispatch.build()  # as the engine builds it
    eng = SimpleNamespace(loads=[InstanceState(i) for i in range(len(jobs))])
    for i, js in enumerate(jobs):
        inst = SimpleNamespace(idx=i, q_seconds=sum(js), n_jobs=len(js), link=SimpleNamespace(free_at=0.0))
        RouterQueue.load(eng, inst, 0.0)
    return disp, cfg.slo, eng.loads


def _cases(n: int, seed: int = 3):
    rng = random.Random(seed)
    for _ in range(n):
        k = rng.randint(1, 6)
        # seconds off any round figure: no queue lands on a threshold, where the router's
        # wall-clock reconciliation (a few picoseconds here) could tip it
        jobs = [[round(rng.uniform(0.1, 6.0), 3) + 1e-4 for _ in range(rng.randint(0, 3))] for _ in range(k)]
        prompts = [rng.choice([200, 4_000, 20_000, 60_000, 120_000]) for _ in range(rng.randint(1, 8))]
        yield jobs, prompts


@pytest.mark.parametrize("label", SPECS)
def test_router_and_simulator_make_the_same_readiness_decisions(label):
    for jobs, prompts in _cases(40):
        rd, rstates = _router(label, jobs)
        sd, slo, sstates = _sim(label, jobs)
        assert type(rd.readiness) is type(sd.readiness)
        for a, b in zip(rstates, sstates, strict=True):
            assert (a.running, a.healthy, a.fetch_backlog_s) == (b.running, b.healthy, b.fetch_backlog_s)
            assert a.queued_seconds == pytest.approx(b.queued_seconds, abs=1e-6)
        released = ([], [])
        for t, L in enumerate(prompts):
            req = Request(L, 0, 0, None)
            for d in (rd, sd):
                # both drivers' deadlines: SLO().ttft(L), the simulator's default SLO alike
                d.admit(Entry(None, req, float(t), slo.ttft(L), estimate_size(COST, req)), float(t))
            assert rd.readiness.threshold == sd.readiness.threshold
            assert rd.readiness.mask(rstates) == sd.readiness.mask(sstates)
            for d, states, out in ((rd, rstates, released[0]), (sd, sstates, released[1])):
                e = d.pop(float(t), states)
                out.append(None if e is None else e.seq)
                if e is not None:
                    assert d.ready_mask(states) == d.readiness.mask(states)
        assert released[0] == released[1]


def test_the_adaptive_threshold_moves_in_both_drivers():
    """Not a vacuous parity: with slo_k the threshold follows the admitted SLOs."""
    rd, _ = _router("slack:slo_k=1", [[1.0]])
    sd, slo, _ = _sim("slack:slo_k=1", [[1.0]])
    for d in (rd, sd):
        for L in (100_000, 100_000, 100_000):
            req = Request(L, 0, 0, None)
            d.admit(Entry(None, req, 0.0, slo.ttft(L), estimate_size(COST, req)), 0.0)
    assert rd.readiness.threshold == sd.readiness.threshold == pytest.approx(slo.ttft(100_000))


def test_live_queue_holds_by_the_traffic_threshold():
    """The live router's queue on an event loop: with ``slo_k`` the first admission sets T
    from its own SLO (about 1 s for 100 tokens), so a worker with 5 s queued is not ready
    (with the fixed threshold it starts from, 100 s, it would be); work leaving releases it."""

    class Routing(_Routing):
        def __init__(self, reg: WorkerRegistry) -> None:
            super().__init__(reg)
            self.reg = reg
            self.routed: list[int] = []

        def request_of(self, f):
            return Request(f.prompt_tokens, 0, 0, None)

        async def route(self, f, exclude_p, exclude_d, with_decode, lk=None):
            w = next(w for w in self.reg.role("prefill", healthy_only=True) if w.wid not in exclude_p)
            self.routed.append(w.wid)
            return self.reg.book(w, f.prompt_tokens, 0.01)

    async def go():
        reg = WorkerRegistry(eject_cooldown_s=0)
        reg.add("prefill", "http://127.0.0.1:20100")
        cfg = {"order": "fifo", "readiness": {"slo_k": 1, "max_queued_s": 100}}
        disp = parse_config({"router": {"dispatch": cfg}}).router.dispatch.build()
        routing = Routing(reg)
        q = LiveQueue(disp, routing, reg, COST, SLO(), CollectorRegistry(), time_factor=FROZEN)
        busy = reg.book(reg.workers[0], 50_000, 5.0)
        f = SimpleNamespace(name="a", prompt_tokens=100, turn=0, est_hit=0, session_id=None, hashes=[])
        task = asyncio.create_task(q.route(f, set(), set(), False))
        for _ in range(200):
            if q.depth == 1:
                break
            await asyncio.sleep(0.005)
        assert q.depth == 1 and routing.routed == []
        assert disp.readiness.threshold == pytest.approx(SLO().ttft(100))
        busy.release()  # work left the worker: ready again
        b = await asyncio.wait_for(task, 5)
        b.release()
        assert routing.routed == [0] and q.depth == 0

    asyncio.run(go())
