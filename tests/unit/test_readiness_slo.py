"""The adaptive readiness rule (stack/dispatch/readiness.py): T from the SLOs of recent
traffic (``slo_k``), the fetch as lead time (``lead_share``), their parsing, validation,
labels and router config."""

from __future__ import annotations

import math

import pytest

from stack.config import parse_config
from stack.core.types import InstanceState, Request
from stack.dispatch import DispatchSpec, Entry, Readiness, make_dispatcher
from stack.dispatch.readiness import AdaptiveReadiness
from stack.dispatch.spec import ROUTER_DISPATCH


def st(i: int, q: float = 0.0, fb: float = 0.0, running: int = 0, healthy: bool = True) -> InstanceState:
    return InstanceState(i, queued_seconds=q, fetch_backlog_s=fb, running=running, healthy=healthy)


def entry(slo: float, size: float = 0.1, arrival: float = 0.0) -> Entry:
    return Entry(None, Request(100, 0, 0, None), arrival, slo, size)


# ---------------------------------------------------------------------- T from the SLOs
def test_plain_rule_stays_fixed_and_stateless():
    r = Readiness(max_queued_s=4.0)
    assert r.build() is r  # no state: shared as before
    r.observe(100.0)
    assert r.threshold == 4.0


def test_threshold_is_alpha_times_the_window_quantile():
    r = Readiness(max_queued_s=3.0, slo_k=0.5, slo_q=0.5, slo_window=5).build()
    assert isinstance(r, AdaptiveReadiness)
    assert r.threshold == 3.0  # before the first admission: max_queued_s
    for s in (2.0, 10.0, 4.0):
        r.observe(s)
    assert r.threshold == pytest.approx(0.5 * 4.0)  # median of 2, 4, 10
    for s in (20.0, 30.0, 40.0):  # the window keeps the last 5: 4, 10, 20, 30, 40
        r.observe(s)
    assert r.threshold == pytest.approx(0.5 * 20.0)


def test_quantile_ends_and_bad_slos_ignored():
    lo = Readiness(max_queued_s=1.0, slo_k=1.0, slo_q=0.0).build()
    hi = Readiness(max_queued_s=1.0, slo_k=1.0, slo_q=1.0).build()
    for s in (3.0, 1.0, 2.0, math.nan, -1.0, math.inf, 0.0):
        lo.observe(s)
        hi.observe(s)
    assert (lo.threshold, hi.threshold) == (1.0, 3.0)


def test_chat_and_agent_traffic_get_their_own_threshold():
    """One alpha: short chat SLOs give a small T, long agentic SLOs a large one."""
    chat = Readiness(max_queued_s=4.0, slo_k=1.0).build()
    agent = Readiness(max_queued_s=4.0, slo_k=1.0).build()
    for i in range(300):
        chat.observe(1.0 + 0.5 * (i % 3))  # 1.0 .. 2.0 s
        agent.observe(4.0 + 3.0 * (i % 3))  # 4 .. 10 s
    assert chat.threshold == pytest.approx(1.5)
    assert agent.threshold == pytest.approx(7.0)
    states = [st(0, q=1.0), st(1, q=3.0), st(2, q=8.0)]
    assert chat.mask(states) == [True, False, False]
    assert agent.mask(states) == [True, True, False]


def test_each_dispatcher_keeps_its_own_window():
    spec = DispatchSpec.parse("slack:slo_k=1")
    a, b = spec.build(), spec.build()
    assert a.readiness is not b.readiness
    a.admit(entry(9.0), 0.0)
    assert a.readiness.threshold == 9.0
    assert b.readiness.threshold == spec.readiness.max_queued_s


def test_dispatcher_admission_updates_threshold_and_release():
    d = make_dispatcher("fifo", T=1, slo_k=1)
    states = [st(0, q=3.0)]
    d.admit(entry(2.0), 0.0)
    assert d.pop(0.0, states) is None  # T = 2: 3 s queued is not ready
    d.admit(entry(5.0, arrival=0.1), 0.1)
    d.admit(entry(5.0, arrival=0.2), 0.2)  # median 5: T = 5
    assert d.pop(0.2, states) is not None


# ---------------------------------------------------------------------- the fetch as lead time
def test_fetch_counts_as_lead_only_beyond_the_share():
    old = Readiness(max_queued_s=2.0)
    lead = Readiness(max_queued_s=2.0, lead_share=0).build()  # always
    # link-bound: 5 s of fetch backlog covers 4 s of compute -> today's rule holds, lead releases
    s = st(0, q=4.0, fb=5.0)
    assert not old.is_ready(s)
    assert lead.is_ready(s)
    assert lead.load(s) == 0.0
    # compute-bound: 5 s queued, 1 s of fetch -> 4 s beyond the fetch: held by both
    s = st(0, q=5.0, fb=1.0)
    assert not old.is_ready(s) and not lead.is_ready(s)
    assert lead.load(s) == pytest.approx(4.0)
    # no backlog: the same rule as today's
    for q in (0.5, 1.9, 2.0, 3.0):
        assert lead.is_ready(st(0, q=q)) == old.is_ready(st(0, q=q))
    # the start the orders see stays the instance's estimated start
    best, mask = lead.scan([st(0, q=4.0, fb=5.0), st(1, q=9.0)])
    assert (best, mask) == (5.0, [True, False])


def test_lead_share_of_the_slo_scale():
    """With slo_k, the fetch is lead time from lead_share x the window's SLO quantile on;
    below it the link backlog holds requests as today."""
    r = Readiness(max_queued_s=2.0, slo_k=0.5, lead_share=1.0).build()
    for _ in range(5):
        r.observe(8.0)  # SLO scale 8 s: T = 4 s, lead from 8 s of backlog
    assert (r.threshold, r.lead_at) == (4.0, 8.0)
    assert not r.is_ready(st(0, q=6.0, fb=7.0))  # below the share: max(6, 7) >= 4
    assert r.is_ready(st(0, q=6.0, fb=9.0))  # past it: 6 - 9 < 4
    assert r.mask([st(0, q=6.0, fb=7.0), st(1, q=6.0, fb=9.0), st(2, q=3.0)]) == [False, True, True]
    # without slo_k the scale is T itself
    fixed = Readiness(max_queued_s=3.0, lead_share=2.0).build()
    assert (fixed.threshold, fixed.lead_at) == (3.0, 6.0)
    fixed.observe(100.0)
    assert (fixed.threshold, fixed.lead_at) == (3.0, 6.0)


def test_lead_queue_counts_the_fetch_where_the_link_backlog_reaches_the_queue():
    """lead_queue: the fetch is lead time on an instance whose link backlog is at least its
    own queued compute, whatever the SLO scale; elsewhere the estimated start holds it."""
    r = Readiness(max_queued_s=2.0, slo_k=0.5, lead_queue=True).build()
    for _ in range(5):
        r.observe(8.0)  # T = 4 s
    assert r.threshold == 4.0 and r.lead_at == math.inf
    link_bound = st(0, q=6.0, fb=7.0)  # the link is what work sent here waits for
    gpu_bound = st(1, q=7.0, fb=6.0)  # the compute is: start after 7 s, held
    idle_link = st(2, q=3.0)
    assert r.load(link_bound) == 0.0 and r.is_ready(link_bound)
    assert r.load(gpu_bound) == 7.0 and not r.is_ready(gpu_bound)
    assert r.mask([link_bound, gpu_bound, idle_link]) == [True, False, True]
    # lead_share 1 (the SLO scale, 8 s) would hold the link-bound one: 7 s < 8 s of backlog
    share = Readiness(max_queued_s=2.0, slo_k=0.5, lead_share=1.0).build()
    for _ in range(5):
        share.observe(8.0)
    assert not share.is_ready(link_bound)
    # the start the orders see is still the instance's estimated start
    assert r.scan([link_bound, gpu_bound])[0] == 7.0


def test_lead_queue_replaces_lead_share_and_round_trips():
    with pytest.raises(ValueError, match="lead_queue replaces lead_share"):
        Readiness(slo_k=0.5, lead_share=1.0, lead_queue=True)
    assert Readiness(lead_queue=True).adaptive
    spec = DispatchSpec.parse("deadline-defer:lead_queue=1:lead_share=inf", base=ROUTER_DISPATCH)
    assert spec.readiness.lead_queue and spec.readiness.lead_share == math.inf
    assert "lead_queue=1" in spec.label()
    assert DispatchSpec.parse(spec.label()) == spec
    cfg = parse_config({"router": {"dispatch": spec.to_config()}}).router.dispatch
    assert cfg.readiness.lead_queue and cfg.readiness.lead_share == math.inf
    yaml_form = {"router": {"dispatch": {"readiness": {"lead_queue": True, "lead_share": None}}}}
    assert parse_config(yaml_form).router.dispatch.readiness.lead_queue
    # the router's default is the candidate the protocol chose (C1r), named without lead_share
    assert spec.readiness == ROUTER_DISPATCH.readiness and spec.build().order.params() == (
        ROUTER_DISPATCH.build().order.params()
    )
    # over that default, a lead share set alone is an error that names the switch, not a
    # silent change of rule; with lead_queue off it is the lead share's rule
    with pytest.raises(ValueError, match="lead_queue: false"):
        parse_config({"router": {"dispatch": {"readiness": {"lead_share": 1}}}})
    share = parse_config({"router": {"dispatch": {"readiness": {"lead_share": 1, "lead_queue": False}}}})
    assert share.router.dispatch.readiness.lead_share == 1 and not share.router.dispatch.readiness.lead_queue


def test_release_share_stops_holding_behind_a_congested_link():
    r = Readiness(max_queued_s=2.0, slo_k=0.5, release_share=1.0, max_running=3).build()
    for _ in range(3):
        r.observe(6.0)  # SLO scale 6 s: T = 3 s, no holding from 6 s of link backlog on
    assert r.threshold == 3.0
    states = [st(0, q=9.0, fb=6.5), st(1, q=9.0, fb=5.0), st(2, q=1.0), st(3, fb=7.0, running=3)]
    assert r.mask(states) == [True, False, True, False]
    assert r.load(states[0]) == 0.0


def test_adaptive_rule_matches_plain_rule_when_off_parts_agree():
    """With slo_k and lead_share at their 'off' values, AdaptiveReadiness is today's rule."""
    plain = Readiness(max_queued_s=2.0, max_running=3, fetch_weight=0.5)
    adapt = AdaptiveReadiness(plain)
    states = [
        st(0, q=1.0),
        st(1, q=2.5),
        st(2, q=0.5, fb=5.0),
        st(3, q=0.5, fb=3.9),
        st(4, running=3),
        st(5, healthy=False),
    ]
    assert adapt.scan(states) == plain.scan(states)
    assert adapt.next_change(1.0, states) == plain.next_change(1.0, states)
    for s in states:
        assert adapt.is_ready(s) == plain.is_ready(s)
        assert adapt.load(s) == plain.load(s)


def test_unhealthy_and_full_instances_never_ready():
    r = Readiness(max_queued_s=2.0, max_running=2, lead_share=0, slo_k=1).build()
    r.observe(50.0)
    assert r.mask([st(0, healthy=False), st(1, running=2), st(2)]) == [False, False, True]


# ---------------------------------------------------------------------- spec, config, errors
def test_spec_keys_labels_and_round_trip():
    spec = DispatchSpec.parse("slack:slo_k=0.75:lead_share=1")
    assert spec.label() == "slack:lead_share=1:slo_k=0.75"
    assert spec.readiness.slo_k == 0.75 and spec.readiness.lead_share == 1
    cfg = spec.to_config()
    assert cfg["readiness"]["slo_k"] == 0.75 and cfg["readiness"]["lead_share"] == 1
    live = parse_config({"router": {"dispatch": cfg}}).router.dispatch
    assert live.readiness == spec.readiness
    # the router's default: T from the traffic (alpha 0.5) and the fetch as lead time behind a
    # link backlog of at least the instance's own queue; each dispatcher built from it gets a
    # window of its own
    r = ROUTER_DISPATCH.readiness
    assert r.slo_k == 0.5 and r.lead_queue and r.lead_share == math.inf
    a, b = ROUTER_DISPATCH.build().readiness, ROUTER_DISPATCH.build().readiness
    assert a is not b and a.rule == b.rule == ROUTER_DISPATCH.readiness
    # a fixed threshold is the plain rule itself
    fixed = DispatchSpec.parse("slack:T=4")
    assert fixed.readiness.slo_k == 0 and fixed.readiness.lead_share == math.inf
    assert fixed.build().readiness is fixed.readiness


@pytest.mark.parametrize(
    "text",
    [
        "slack:slo_k=-1",
        "slack:slo_k=inf",
        "slack:slo_q=1.5",
        "slack:slo_window=0",
        "slack:slo_window=2.5",
        "slack:lead_share=-1",
        "slack:release_share=-1",
        "immediate:slo_k=1",
    ],
)
def test_bad_values_are_clear_errors(text):
    with pytest.raises(ValueError, match="dispatch"):
        DispatchSpec.parse(text)


def test_router_config_rejects_bad_values():
    with pytest.raises(Exception, match="slo_q"):
        parse_config({"router": {"dispatch": {"readiness": {"slo_q": 2}}}})
    with pytest.raises(Exception, match="lead_share"):
        parse_config({"router": {"dispatch": {"readiness": {"lead_share": -1}}}})
