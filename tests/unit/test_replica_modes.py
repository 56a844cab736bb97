"""Router replicas sharing the dispatch queue (``replica_mode``, docs/research/dispatch.md "Router
replicas"): the spec key, the dispatcher's rank of its next release, and the simulator's
four modes (own, claims, leader, hash)."""

from __future__ import annotations

import math

import pytest
from test_dispatch import HW, SLO, crafted_overload

from stack.config import parse_config
from stack.core.types import InstanceState, Request
from stack.dispatch import SIM_DISPATCH, DispatchSpec, Entry, make_dispatcher
from stack.dispatch.spec import REPLICA_MODES
from stack.paths import default_trace
from stack.sim.engine import GlobalTierSpec, SimConfig, Simulator
from stack.sim.load import LoadSpec, SessionStart
from stack.traces.load import load_trace


def entry(name: str, arrival: float, slo: float, size: float = 0.1) -> Entry:
    return Entry(name, Request(prompt_tokens=1000), arrival, slo, size)


def idle(n: int = 1) -> list[InstanceState]:
    return [InstanceState(i) for i in range(n)]


def test_replica_mode_is_a_named_spec_key():
    for m in REPLICA_MODES:
        spec = DispatchSpec.parse(f"slack:T=4:replicas=4:replica_mode={m}")
        assert spec.replica_mode == m and spec.replicas == 4
        assert spec.label() == f"slack:T=4:replica_mode={m}:replicas=4"
        assert DispatchSpec.parse(spec.label()) == spec
        assert spec.build().replica_mode == m
    # not named: the driver's default (the simulator: own; the router: claims with Redis)
    assert DispatchSpec.parse("slack:replicas=2").build().replica_mode is None
    spec = DispatchSpec.parse("slack:replicas=4:age_k=2")
    assert (spec.replicas, spec.replica_mode, spec.params) == (4, None, {"age_k": 2.0})
    cfg = SimConfig(dispatch=DispatchSpec.parse("slack:replica_mode=claims"))
    assert cfg.dispatch.label() == "slack:replica_mode=claims"
    with pytest.raises(ValueError, match="replica_mode must be one of own, claims, leader, hash"):
        DispatchSpec.parse("slack:replica_mode=gossip")
    with pytest.raises(ValueError, match="replica_mode must be one of"):
        SimConfig(dispatch=SIM_DISPATCH.updated("slack", {"replica_mode": "x"})).validate()


def test_router_config_takes_own_or_claims_only():
    d = parse_config({"router": {"dispatch": {"replica_mode": "own"}}}).router.dispatch
    assert d.replica_mode == "own" and d.build().replica_mode == "own"
    assert d.to_config()["replica_mode"] == "own"
    assert parse_config({}).router.dispatch.build().replica_mode is None  # claims with Redis
    for m in ("leader", "hash"):
        with pytest.raises(ValueError, match="simulated only"):
            parse_config({"router": {"dispatch": {"replica_mode": m}}})


def test_head_key_ranks_feasible_then_aged_then_deferred():
    d = make_dispatcher("slack", age_k=3)
    assert d.head_key(0.0, idle()) is None  # empty
    d.admit(entry("late", 0.0, 1.0, size=2.0), 0.0)  # hopeless from the start
    d.admit(entry("b", 0.0, 5.0), 0.0)
    d.admit(entry("a", 0.1, 3.0), 0.1)
    assert d.head_key(0.1, idle()) == (0, 3.1, 0.1)
    busy = [InstanceState(0, queued_seconds=10.0)]
    assert d.head_key(0.1, busy) is None  # nothing ready: nothing would be released
    assert d.rank(0.1, 10.0) is not None  # the live router ranks it anyway
    only = make_dispatcher("slack", age_k=3)
    only.admit(entry("late", 0.0, 1.0, size=2.0), 0.0)
    assert only.head_key(0.5, idle()) == (2, 1.0, 0.0)  # deferred
    assert only.head_key(3.5, idle()) == (1, 1.0, 0.0)  # aged
    f = make_dispatcher("fifo")
    f.admit(entry("x", 2.0, 9.0), 2.0)
    assert f.head_key(2.0, idle()) == (0, 2.0, 2.0)
    lax = make_dispatcher("laxity")
    lax.admit(entry("y", 1.0, 4.0, size=0.5), 1.0)
    assert lax.head_key(1.0, idle()) == (0, 4.5, 1.0)


def test_head_key_ranks_a_queue_that_holds_only_lost_requests():
    # far_k: a request past far_k x its SLO moves to the lost queue; a replica holding only
    # such requests must still rank (claims mode gives instances to ranked replicas only),
    # else they would wait forever (found by the 4-replica matrix cell: "dispatch lost
    # requests ... still queued 9")
    d = make_dispatcher("deadline-defer", age_k=10, far_k=5)  # nothing ages
    d.admit(entry("late", 0.0, 1.0, size=2.0), 0.0)  # hopeless from the start
    assert d.head_key(0.5, idle()) == (2, 1.0, 0.0)  # deferred
    d.admit(entry("fresh", 6.0, 5.0), 6.0)
    # releasing the feasible one moves "late", past 5 x its SLO, to the lost queue
    assert d.pop(6.0, idle()).handle == "fresh"
    assert [k[2].handle for k in d.order.lost] == ["late"] and not d.order.deferred
    assert d.head_key(6.0, idle()) == (3, 1.0, 0.0)
    assert d.pop(6.0, idle()).handle == "late"
    assert d.head_key(6.0, idle()) is None


def test_asking_the_rank_changes_no_release():
    def fill(d):
        for i, (a, slo, size) in enumerate(
            [(0.0, 1.0, 3.0), (0.0, 4.0, 0.2), (0.1, 2.0, 0.3), (0.2, 9.0, 1.0)]
        ):
            d.admit(entry(f"e{i}", a, slo, size), a)

    plain, asked = make_dispatcher("slack"), make_dispatcher("slack")
    fill(plain)
    fill(asked)
    out_plain, out_asked = [], []
    for t in (0.3, 0.4, 0.5, 0.6):
        out_plain.append(plain.pop(t, idle()).handle)
        asked.head_key(t, idle())
        out_asked.append(asked.pop(t, idle()).handle)
    assert out_plain == out_asked
    assert plain.counters.deferrals == asked.counters.deferrals


def _sim(trace, instances=1, **params):
    cfg = SimConfig(
        instances=instances,
        hardware=HW,
        global_tier=GlobalTierSpec.parse("full"),
        slo=SLO(b=1.0, a=2e-4),
        dispatch=SIM_DISPATCH.updated("deadline", params),
    )
    spec = LoadSpec(mode="compress", rate_scale=1.0, warmup=0.0, measure_until=math.inf)
    return Simulator(trace, "least-load", cfg, spec).run().metrics


def test_claims_and_leader_release_in_one_order_where_own_queues_do_not(tmp_path):
    # one instance, a long request with a loose SLO and three short urgent ones spread over
    # two replicas' queues: taking turns, a replica releases its long request while the
    # other still holds an urgent one; ranked (claims) or one queue (leader), the urgent
    # ones go first, as with a single replica
    t = crafted_overload(tmp_path)
    one = _sim(t, max_queued_s=0.5)
    met = {m: _sim(t, max_queued_s=0.5, replicas=2, replica_mode=m)["slo_attainment"] for m in REPLICA_MODES}
    assert one["slo_attainment"] == 1.0
    assert met["claims"] == met["leader"] == 1.0
    assert met["own"] < 1.0


def test_modes_conserve_requests_and_leader_is_one_queue():
    trace = load_trace(default_trace())
    spec = LoadSpec(mode="sessions", session_rate=0.05, duration=1800.0, seed=3)

    def run(**p):
        s = Simulator(
            trace, "least-load", SimConfig(instances=2, dispatch=SIM_DISPATCH.updated("slack", p)), spec
        )
        m = s.run().metrics
        assert s.tally.issued == s.tally.served and m["rejected"] == 0
        return m

    one = run()
    assert one["queue_depth_max"] > 0
    keys = ("prefill_tps_within_slo", "ttft_p99", "over_5x_slo", "requests")
    for mode in REPLICA_MODES:
        m = run(replicas=3, replica_mode=mode)
        assert m["dispatch_replicas"] == 3 and m["dispatch"] == f"slack:replica_mode={mode}:replicas=3"
        if mode == "leader":  # every request in the leader's queue: one queue exactly
            assert [m[k] for k in keys] == [one[k] for k in keys]


def test_hash_keeps_a_session_on_one_replica():
    trace = load_trace(default_trace())
    cfg = SimConfig(
        instances=2, dispatch=SIM_DISPATCH.updated("slack", {"replicas": 4, "replica_mode": "hash"})
    )
    s = Simulator(trace, "least-load", cfg)
    picks = {c: s.queue.replica_of(SessionStart(copy=c, session=0, start=0.0)) for c in range(64)}
    assert all(s.queue.replica_of(SessionStart(copy=c, session=1, start=5.0)) is picks[c] for c in range(64))
    assert len({id(d) for d in picks.values()}) == 4  # every replica gets sessions
