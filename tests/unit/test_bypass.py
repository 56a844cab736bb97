"""The dispatch queue's link rules (stack/dispatch/bypass.py): the admission bypass and the
affinity rule at release. Each: the rule itself, its dispatch key, parity between the
simulator's and the live router's decisions on the same cluster figures, and the live queue
and the simulator acting on it."""

from __future__ import annotations

import asyncio
import math
import random
from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry

from stack.config import parse_config
from stack.core.cost_model import CostModel, load_hardware
from stack.core.types import SLO, ClusterView, InstanceState, Request
from stack.dispatch import DispatchSpec
from stack.dispatch.bypass import Bypass, link_bound, unbind_at_release
from stack.pool import WorkerRegistry
from stack.prefill_router.queue import LiveQueue
from stack.prefill_router.routing import PrefillRouter
from stack.sim.config import SimConfig
from stack.sim.engine import Simulator
from stack.sim.queues import RouterQueue

pytestmark = pytest.mark.timeout(30)

HW = load_hardware("h20")
COST = HW.cost
BW = HW.link_tokens_per_s(True)
BS = 64
#: wall seconds per pool second: the test's own time vanishes from the queued seconds
FROZEN = 1e12


# ---------------------------------------------------------------------------- the rule
def test_fetch_longer_than_compute_dispatches_now():
    # 100k tokens to fetch at 100k tok/s (1 s) against 1k new tokens at a 2k context
    c = CostModel()
    compute = c.cost(1_000, 2_000)
    assert compute < 1.0
    assert link_bound(100_000, 1_000, 2_000, 100_000.0, 0.0, c)
    # the share scales the compute side
    assert not link_bound(100_000, 1_000, 2_000, 100_000.0, 0.0, c, share=1.0 / compute + 1)
    assert link_bound(100_000, 1_000, 2_000, 100_000.0, 0.0, c, share=0.9 / compute)


def test_compute_longer_than_fetch_is_queued():
    c = CostModel()
    # 1k tokens to fetch (5 ms at 200k tok/s) against 50k new tokens
    assert not link_bound(1_000, 50_000, 60_000, 200_000.0, 0.0, c)


def test_the_link_backlog_counts_as_fetch_time():
    c = CostModel()
    compute = c.cost(50_000, 60_000)
    assert not link_bound(1_000, 50_000, 60_000, 200_000.0, 0.0, c)
    assert link_bound(1_000, 50_000, 60_000, 200_000.0, compute + 0.1, c)


@pytest.mark.parametrize(
    "fetch,bw,share",
    [(0, 1e5, 1.0), (-5, 1e5, 1.0), (10**6, 0.0, 1.0), (10**6, 1e5, math.inf)],
)
def test_nothing_to_fetch_no_link_or_off_never_dispatches(fetch, bw, share):
    assert not link_bound(fetch, 10, 10**6, bw, 100.0, CostModel(), share)


def test_share_zero_dispatches_any_fetch():
    assert link_bound(1, 10**6, 10**6, 1e9, 0.0, CostModel(), share=0.0)


@pytest.mark.parametrize("share", [-1.0, math.nan])
def test_a_bad_share_is_refused(share):
    with pytest.raises(ValueError, match="bypass"):
        Bypass(share).validate()


def _view(local: list[int], backlog: list[float], g: int, healthy=None, bw: float = 1e5) -> ClusterView:
    insts = [InstanceState(i, local_hit=h, fetch_backlog_s=b) for i, (h, b) in enumerate(zip(local, backlog))]
    for s, ok in zip(insts, healthy or [True] * len(insts)):
        s.healthy = ok
    return ClusterView(0.0, insts, g, bw, BS)


def test_on_view_takes_the_best_local_hit_and_the_least_backlog():
    c = CostModel()
    L = 100_001
    rule = Bypass(1.0)
    # global 100k, best local 90k: 10k to fetch (0.1 s) against 1 new token: dispatched
    assert rule.on_view(_view([0, 90_000], [5.0, 0.0], 100_000), L, c)
    # best local covers the global hit: nothing to fetch
    assert not rule.on_view(_view([100_000, 0], [0.0, 0.0], 100_000), L, c)
    # the instance holding the prefix is down: the best healthy local hit is 0
    v = _view([100_000, 0], [0.0, 0.0], 100_000, healthy=[False, True])
    assert rule.on_view(v, L, c)
    # no healthy instance: nothing to decide
    assert not rule.on_view(_view([0], [0.0], 100_000, healthy=[False]), L, c)
    # the least backlog of any instance counts: one token to fetch, 20k to compute
    g = 80_000
    compute = c.cost(L - g, L)
    assert not rule.on_view(_view([g - 1, g - 1], [0.0, 0.0], g), L, c)
    assert rule.on_view(_view([g - 1, g - 1], [compute + 1.0, compute + 2.0], g), L, c)
    assert not rule.on_view(_view([g - 1, g - 1], [compute + 1.0, 0.0], g), L, c)


# ---------------------------------------------------------------------------- the key
def test_the_key_parses_labels_and_round_trips_through_the_router_config():
    s = DispatchSpec.parse("slack:T=4:bypass=1:lead_share=1:slo_k=0.5")
    assert s.bypass == 1.0
    assert s.label() == "slack:T=4:bypass=1:lead_share=1:slo_k=0.5"
    assert s.build().bypass == Bypass(1.0)
    cfg = s.to_config()
    assert cfg["bypass"] == 1.0
    back = parse_config({"router": {"dispatch": cfg}}).router.dispatch
    assert back.bypass == 1.0 and back.build().bypass == Bypass(1.0)
    assert DispatchSpec.parse(back.label()).bypass == 1.0


def test_the_key_is_off_in_a_spec_by_default_and_on_in_the_routers_default():
    assert DispatchSpec.parse("slack").build().bypass is None
    assert DispatchSpec.parse("slack:bypass=inf").build().bypass is None
    assert DispatchSpec.parse("slack:bypass=inf").to_config()["bypass"] is None  # null: off
    # the router's default runs both link rules at share 1; a config turns either off
    d = parse_config({}).router.dispatch.build()
    assert d.bypass == Bypass(1.0) and d.affinity == Bypass(1.0)
    off = {"router": {"dispatch": {"bypass": math.inf, "affinity": math.inf}}}
    d = parse_config(off).router.dispatch.build()
    assert d.bypass is None and d.affinity is None
    # another order starts from nothing: immediate holds no queue to bypass
    assert (
        parse_config({"router": {"dispatch": {"order": "immediate"}}}).router.dispatch.build().bypass is None
    )


@pytest.mark.parametrize("text", ["immediate:bypass=1", "slack:bypass=-1"])
def test_a_bad_bypass_is_a_clear_error(text):
    with pytest.raises(ValueError, match="bypass"):
        DispatchSpec.parse(text)


def test_the_router_config_refuses_a_negative_share():
    with pytest.raises(ValueError):
        parse_config({"router": {"dispatch": {"bypass": -1}}})


# ---------------------------------------------------------------------------- parity
@dataclass
class _Cache:
    blocks: int

    def hit(self, path) -> int:
        return min(self.blocks, len(path))


@dataclass
class _Link:
    free_at: float = 0.0


@dataclass
class _SimInstance:
    cache: _Cache
    link: _Link = field(default_factory=_Link)
    q_tokens: int = 0
    q_seconds: float = 0.0
    n_jobs: int = 0
    a_tokens: int = 0
    decode_running: int = 0
    decode_tokens: int = 0
    decode_step_s: float = 0.0


class _Index:
    def __init__(self, hits: dict[int, int]) -> None:
        self._hits = hits

    def hits(self, hashes: list[int]) -> dict[int, int]:
        return {w: min(b, len(hashes)) for w, b in self._hits.items() if b}


class _Global:
    def __init__(self, blocks: int) -> None:
        self.blocks = blocks
        self.asked = 0

    async def hit_blocks(self, hashes, tokens=None) -> int:
        self.asked += 1
        return min(self.blocks, len(hashes))


class _Routing(PrefillRouter):
    """The real routing step's view and link rules; books the first healthy worker not excluded."""

    def __init__(self, reg: WorkerRegistry, index, glob, fetch_tps: float) -> None:
        super().__init__(reg, index, glob, None, COST, BS, fetch_tps, time_factor=FROZEN)
        self.routed: list[str] = []
        self.reg = reg

    def request_of(self, f):
        return Request(f.prompt_tokens, 0, 0, None)

    async def route(self, f, exclude_p, exclude_d, with_decode, lk=None):
        w = next(w for w in self.reg.role("prefill", healthy_only=True) if w.wid not in exclude_p)
        self.routed.append(f.name)
        return self.reg.book(w, f.prompt_tokens, 0.01)


def _sim_decides(rule: Bypass, local: list[int], g: int, L: int, bw: float) -> bool:
    """The simulator's decision (RouterQueue.bypass_now) over instances holding ``local``
    blocks of the request's path and a global tier holding ``g``."""
    eng = SimpleNamespace(
        insts=[_SimInstance(_Cache(b)) for b in local],
        bs=BS,
        glob=_Cache(g),
        fetch_tokens_per_s=bw,
        view=None,
        bypass=rule,
        cost=COST,
    )
    path = tuple(range(L // BS))
    return RouterQueue.bypass_now(eng, 0.0, path, L)


def _live_queue(label: str, local: list[int], g: int, bw: float):
    disp = parse_config(
        {"router": {"dispatch": DispatchSpec.parse(label).to_config()}}
    ).router.dispatch.build()
    reg = WorkerRegistry(eject_cooldown_s=0)
    ws = [reg.add("prefill", f"http://127.0.0.1:{21000 + i}") for i in range(len(local))]
    routing = _Routing(reg, _Index({w.wid: b for w, b in zip(ws, local)}), _Global(g), bw)
    q = LiveQueue(disp, routing, reg, COST, SLO(), CollectorRegistry(), time_factor=FROZEN)
    return q, reg, routing


async def _bypasses(q: LiveQueue, f) -> bool:
    """The live bypass decision at ``f``'s admission (the routing step's, on its lookup)."""
    return await q.routing.bypasses(f, q.routing.lookup(f), q.bypass, set())


async def _unbinds(q: LiveQueue, f, not_ready: frozenset[int]) -> bool:
    """The live affinity decision at ``f``'s release with ``not_ready`` left out."""
    return await q.routing.unbinds(f, q.routing.lookup(f), q.affinity, set(), not_ready)


def _feats(name: str, L: int):
    return SimpleNamespace(
        name=name,
        prompt_tokens=L,
        turn=0,
        est_hit=0,
        session_id=None,
        hashes=list(range(L // BS)),
        tokens=None,
    )


def _cases(n: int, seed: int = 11):
    rng = random.Random(seed)
    for _ in range(n):
        L = rng.choice([500, 4_000, 30_000, 90_000, 150_000])
        nb = L // BS
        k = rng.randint(1, 5)
        local = [rng.randint(0, nb) if rng.random() < 0.6 else 0 for _ in range(k)]
        g = rng.randint(0, nb) if rng.random() < 0.8 else nb
        yield local, g, L


@pytest.mark.parametrize("share", [0.5, 1.0, 2.0])
def test_router_and_simulator_make_the_same_bypass_decisions(share):
    label = f"slack:T=4:bypass={share:g}:lead_share=1:slo_k=0.5"
    sim_rule = DispatchSpec.parse(label).build().bypass
    seen = set()

    async def go():
        for local, g, L in _cases(80):
            q, _, routing = _live_queue(label, local, g, BW)
            assert q.bypass == sim_rule
            live = await _bypasses(q, _feats("x", L))
            sim = _sim_decides(sim_rule, local, g, L, BW)
            assert live == sim, (local, g, L)
            seen.add(live)

    asyncio.run(go())
    assert seen == {True, False}  # not a vacuous parity


def test_the_live_router_skips_the_global_lookup_when_it_cannot_matter():
    async def go():
        # a short prompt whose whole prefix one worker holds: nothing can be fetched
        q, _, routing = _live_queue("slack:bypass=1", [60], 60, BW)
        assert not await _bypasses(q, _feats("x", 60 * BS))
        assert routing.global_tier.asked == 0
        # a long prefix no worker holds: asked
        q, _, routing = _live_queue("slack:bypass=1", [0], 2_000, BW)
        assert await _bypasses(q, _feats("y", 2_000 * BS + 1))
        assert routing.global_tier.asked == 1

    asyncio.run(go())


# ---------------------------------------------------------------------------- live queue
def test_live_queue_routes_a_link_bound_request_at_once_and_holds_the_others():
    """One worker with 20 s queued (not ready under T=4): a request whose prefix is all in the
    global tier is routed at once; one with nothing to fetch waits for the worker."""

    async def go():
        q, reg, routing = _live_queue("slack:T=4:bypass=1", [0], 2_000, BW)
        busy = reg.book(reg.workers[0], 400_000, 20.0)
        L = 2_000 * BS + 1
        b = await asyncio.wait_for(q.route(_feats("link-bound", L), set(), set(), False), 5)
        assert routing.routed == ["link-bound"] and q.depth == 0
        assert q.disp.counters.bypassed == 1 and q.disp.counters.admitted == 0
        assert q.metrics.bypassed._value.get() == 1
        b.release()
        # a prompt beyond the global tier's hit: mostly computed, so queued behind the worker
        held = _feats("compute-bound", 2_000 * BS + 200_000)
        task = asyncio.create_task(q.route(held, set(), set(), False))
        for _ in range(200):
            if q.depth == 1:
                break
            await asyncio.sleep(0.005)
        assert q.depth == 1 and routing.routed == ["link-bound"]
        busy.release()
        b = await asyncio.wait_for(task, 5)
        b.release()
        assert routing.routed == ["link-bound", "compute-bound"]

    asyncio.run(go())


def test_live_queue_without_the_key_holds_the_link_bound_request():
    async def go():
        q, reg, routing = _live_queue("slack:T=4", [0], 2_000, BW)
        assert q.bypass is None
        busy = reg.book(reg.workers[0], 400_000, 20.0)
        task = asyncio.create_task(q.route(_feats("link-bound", 2_000 * BS + 1), set(), set(), False))
        for _ in range(200):
            if q.depth == 1:
                break
            await asyncio.sleep(0.005)
        assert q.depth == 1 and routing.routed == []
        busy.release()
        (await asyncio.wait_for(task, 5)).release()
        assert routing.routed == ["link-bound"]

    asyncio.run(go())


# ---------------------------------------------------------------------------- simulator
def _sim_run(label: str):
    """A small shared-NIC run (8 instances, 200k local room, a global tier) past its knee."""
    from stack.sim.load import LoadSpec
    from stack.traces import shipped
    from stack.traces.load import load_trace

    spec = DispatchSpec.parse(label)
    cfg = SimConfig(dispatch=spec, instances=8, link="shared", hbm_tokens=200_000)
    load = LoadSpec(mode="sessions", rate_scale=4.0, duration=600.0)
    sim = Simulator(load_trace(shipped("agentic_slice")), "smetric-global", cfg, load)
    return sim, sim.run().metrics["requests_total"]


def test_the_simulator_acts_on_each_link_rule_and_counts_it():
    """With ``bypass`` some requests skip the queue, with ``affinity`` some releases are routed
    over every instance (each counted); without the keys neither; every request is served."""
    plain, total = _sim_run("slack:T=4")
    assert (plain.tally.bypassed, plain.queue.disp.counters.bypassed, plain.tally.unbound) == (
        0,
        0,
        0,
    ) and total > 0
    byp, total = _sim_run("slack:T=4:bypass=1")
    assert byp.tally.bypassed > 0 and byp.queue.disp.counters.bypassed == byp.tally.bypassed and total > 0
    aff, total = _sim_run("slack:T=4:affinity=1")
    assert aff.tally.unbound > 0 and aff.tally.bypassed == 0 and total > 0


# ---------------------------------------------------------------------------- affinity
def _aview(local: list[int], g: int, L: int, bw: float = BW) -> ClusterView:
    insts = [InstanceState(i, local_hit=min(b * BS, L - 1)) for i, b in enumerate(local)]
    return ClusterView(0.0, insts, min(g * BS, L - 1), bw, BS)


def test_affinity_unbinds_a_release_the_ready_instances_would_fetch():
    L = 2_000 * BS + 1
    rule = Bypass(1.0)
    # the prefix is local on instance 0 (not ready) and in the global tier; 1 is ready
    assert unbind_at_release(rule, _aview([2_000, 0], 2_000, L), [False, True], L, COST)
    # the ready instance holds it as well: nothing to gain
    assert not unbind_at_release(rule, _aview([2_000, 2_000], 2_000, L), [False, True], L, COST)
    # every instance ready: nothing is held to a subset
    assert not unbind_at_release(rule, _aview([2_000, 0], 2_000, L), [True, True], L, COST)
    # the fetch is short next to the compute of the rest (a long new part): held as before
    L2 = 20 * BS + 200_000
    assert not unbind_at_release(rule, _aview([20, 0], 20, L2), [False, True], L2, COST)
    # no global tier hit or no link: the rule cannot hold
    assert not unbind_at_release(rule, _aview([2_000, 0], 0, L), [False, True], L, COST)
    assert not unbind_at_release(rule, _aview([2_000, 0], 2_000, L, 0.0), [False, True], L, COST)
    # an unhealthy instance's prefix does not count
    v = _aview([2_000, 0], 2_000, L)
    v.instances[0].healthy = False
    assert not unbind_at_release(rule, v, [False, True], L, COST)


def test_the_affinity_key_parses_round_trips_and_refuses_bad_values():
    spec = DispatchSpec.parse("slack:T=4:affinity=1:bypass=1")
    assert spec.label() == "slack:T=4:affinity=1:bypass=1"
    assert spec.build().affinity == Bypass(1.0)
    cfg = parse_config({"router": {"dispatch": spec.to_config()}})
    back = cfg.router.dispatch
    assert cfg.router.dispatch.affinity == 1.0 and back.affinity == 1.0
    assert back.build().affinity == Bypass(1.0) and "affinity=1" in back.label()
    assert DispatchSpec.parse("slack:T=4").build().affinity is None
    assert DispatchSpec.parse("slack:T=4:affinity=inf").build().affinity is None
    with pytest.raises(ValueError, match="affinity needs a queue"):
        DispatchSpec.parse("immediate:affinity=1").build()
    with pytest.raises(ValueError, match="affinity"):
        parse_config({"router": {"dispatch": {"order": "slack", "affinity": -1}}})


def _sim_unbinds(rule: Bypass, local: list[int], g: int, L: int, ready: list[bool]) -> bool:
    """The simulator's decision (RouterQueue.unbind_now on the view Simulator.route builds)."""
    from stack.sim.view import build_view as sim_view

    insts = [_SimInstance(_Cache(b)) for b in local]
    path = tuple(range(L // BS))
    view = sim_view(0.0, insts, path, L, BS, _Cache(g), BW, None)
    eng = SimpleNamespace(affinity=rule, cost=COST)
    return RouterQueue.unbind_now(eng, view, ready, L)


@pytest.mark.parametrize("share", [0.5, 1.0])
def test_router_and_simulator_make_the_same_affinity_decisions(share):
    label = f"slack:T=4:affinity={share:g}"
    sim_rule = DispatchSpec.parse(label).build().affinity
    rng = random.Random(5)
    seen = set()

    async def go():
        for local, g, L in _cases(80, seed=17):
            ready = [rng.random() < 0.5 for _ in local]
            if not any(ready):
                ready[rng.randrange(len(ready))] = True
            q, reg, _ = _live_queue(label, local, g, BW)
            assert q.affinity == sim_rule
            not_ready = frozenset(w.wid for w, ok in zip(reg.workers.values(), ready) if not ok)
            live = await _unbinds(q, _feats("x", L), not_ready)
            sim = _sim_unbinds(sim_rule, local, g, L, ready)
            assert live == sim, (local, g, L, ready)
            seen.add(live)

    asyncio.run(go())
    assert seen == {True, False}  # not a vacuous parity


@pytest.mark.parametrize("label, expect_all", [("slack:T=4:affinity=1", True), ("slack:T=4", False)])
def test_live_queue_unbinds_a_release_from_the_ready_workers(label, expect_all):
    """Worker 0 holds the prompt's prefix and has 20 s queued (not ready under T=4); worker 1
    is idle and holds nothing; the global tier holds the prefix. Released at admission to
    worker 1 alone, the request would fetch its whole prefix: with the key it is routed over
    both workers (the routing step sees worker 0), without it over worker 1 only."""

    async def go():
        q, reg, routing = _live_queue(label, [2_000, 0], 2_000, BW)
        seen: list[set[int]] = []
        inner = routing.route

        async def spy(f, exclude_p, exclude_d, with_decode, lk=None):
            seen.append({w.wid for w in reg.workers.values()} - set(exclude_p))
            return await inner(f, exclude_p, exclude_d, with_decode, lk)

        routing.route = spy
        busy = reg.book(reg.workers[0], 400_000, 20.0)
        b = await asyncio.wait_for(q.route(_feats("r", 2_000 * BS + 1), set(), set(), False), 5)
        b.release()
        busy.release()
        assert seen == ([{0, 1}] if expect_all else [{1}])
        assert q.metrics.unbound._value.get() == (1 if expect_all else 0)

    asyncio.run(go())


def test_the_live_affinity_check_asks_the_global_tier_only_when_it_can_matter():
    async def go():
        L = 2_000 * BS + 1
        # the worker left out holds no more of the prefix than the ready one: not asked
        q, reg, routing = _live_queue("slack:affinity=1", [0, 0], 2_000, BW)
        assert not await _unbinds(q, _feats("x", L), frozenset({reg.workers[0].wid}))
        assert routing.global_tier.asked == 0
        # it holds the prefix: asked, and unbound
        q, reg, routing = _live_queue("slack:affinity=1", [2_000, 0], 2_000, BW)
        assert await _unbinds(q, _feats("y", L), frozenset({reg.workers[0].wid}))
        assert routing.global_tier.asked == 1

    asyncio.run(go())
