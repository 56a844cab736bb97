"""One DispatchSpec (stack/dispatch/spec.py): its text and config parsers, its label, its
builder, the two drivers' defaults, replicas as a field, and clear errors."""

from __future__ import annotations

import argparse
import math

import pytest

from stack.commands.simopts import add_dispatch_arguments
from stack.config import parse_config
from stack.dispatch import (
    ROUTER_DISPATCH,
    SIM_DISPATCH,
    DeadlineDefer,
    DispatchSpec,
    Readiness,
    make_dispatcher,
)
from stack.sim.options import SimOptions

LABELS = [
    "immediate",
    "fifo",
    "slack:T=4",
    "slack:aged_share=1",
    "slack:aged_share=1:replicas=4",
    "deadline-defer:T=1:age_k=2",
    "deadline-defer:age_k=2:max_queue=9",
    "deadline-defer:age_k=inf",
    "laxity:relax_k=5",
    "fifo:fetch_weight=0:max_queue_wait_s=30:max_running=2",
]


@pytest.mark.parametrize("label", LABELS)
def test_parse_and_label_round_trip(label):
    spec = DispatchSpec.parse(label)
    assert spec.label() == str(spec) == label
    assert DispatchSpec.parse(spec.label()) == spec


def test_aliases_land_on_their_field_and_render_canonically():
    a = DispatchSpec.parse("slack:t=3:k=2")
    b = DispatchSpec.parse("slack:max_queued_s=3:age-k=2")
    assert a == b == DispatchSpec.parse("slack:T=3:age_k=2")
    assert a.readiness.max_queued_s == 3.0 and dict(a.params) == {"age_k": 2.0}
    assert a.label() == "slack:T=3:age_k=2"
    assert DispatchSpec.parse("laxity:k=3").build().order.relax_k == 3.0


def test_one_default_per_driver():
    # the router: deadline-defer (age_k 1.5, aged_share 0.125, far_k 5), T from the traffic's
    # SLOs (4 s before the first request) and the fetch as lead time where an instance's link
    # backlog is at least its own queue (lead_queue), what an empty section gives
    assert ROUTER_DISPATCH.label() == (
        "deadline-defer:T=4:affinity=1:age_k=1.5:aged_share=0.125:bypass=1:far_k=5:lead_queue=1"
        ":max_queue_wait_s=30:max_wait_k=5:slo_k=0.5"
    )
    assert ROUTER_DISPATCH.order_params == {"age_k": 1.5, "aged_share": 0.125, "far_k": 5.0}
    assert parse_config({}).router.dispatch == ROUTER_DISPATCH
    d = parse_config({}).router.dispatch.build()
    assert type(d.order) is DeadlineDefer  # no slack stealing (docs/research/dispatch.md, "The default")
    assert d.readiness.rule == Readiness(max_queued_s=4.0, slo_k=0.5, lead_queue=True)
    # the simulator: immediate, and T = 2 for an order named without one
    assert SIM_DISPATCH.label() == "immediate" and SIM_DISPATCH.readiness.max_queued_s == 2.0
    assert SimOptions().dispatch == SIM_DISPATCH
    assert DispatchSpec.parse("slack").readiness.max_queued_s == 2.0
    assert make_dispatcher("fifo").readiness.max_queued_s == 2.0
    # the router's default, named in the simulator's text form, is the router's default
    assert DispatchSpec.parse(ROUTER_DISPATCH.label()) == ROUTER_DISPATCH


def test_demo_live_default_label_comes_from_the_router_default():
    from stack.commands.demo_live import DEFAULT_POLICIES, dispatch_of

    assert DEFAULT_POLICIES[0] == (
        "smetric-global+deadline-defer:T=4:affinity=1:age_k=1.5:aged_share=0.125:bypass=1:far_k=5:lead_queue=1"
        ":max_queue_wait_s=30:max_wait_k=5:slo_k=0.5"
    )
    assert dispatch_of(DEFAULT_POLICIES[0]) == ("smetric-global", ROUTER_DISPATCH)
    assert dispatch_of("lmetric") == ("lmetric", SIM_DISPATCH)


def test_config_keys_are_still_accepted():
    section = {
        "order": "deadline-defer",
        "params": {"age_k": 5},
        "max_queue": 9,
        "max_queue_wait_s": 30,
        "readiness": {"max_queued_s": 3, "max_running": 2, "fetch_weight": 0.5},
        "sglang_priority": True,
    }
    spec = cfg = parse_config({"router": {"dispatch": section}}).router.dispatch
    # the default's order: the parameters the section leaves out keep the default's values
    assert spec.order == "deadline-defer"
    assert dict(spec.params) == {"age_k": 5.0, "aged_share": 0.125, "far_k": 5.0}
    # another order: its own defaults, and the link rules off (the order as studied)
    other = parse_config({"router": {"dispatch": {"order": "slack", "params": {"age_k": 5}}}}).router.dispatch
    assert dict(other.params) == {"age_k": 5.0} and other.build().order.far_k == 0.0
    assert math.isinf(other.bypass) and math.isinf(other.affinity)
    # no key turns another off: a threshold set by hand is where the default's adaptive T
    # starts; mode fixed is the switch to a fixed T, false turns the fetch as lead time off
    assert spec.readiness == Readiness(
        max_queued_s=3.0, max_running=2.0, fetch_weight=0.5, slo_k=0.5, lead_queue=True
    )
    start = parse_config({"router": {"dispatch": {"readiness": {"max_queued_s": 2}}}}).router.dispatch
    assert start.readiness.mode == "adaptive" and start.readiness.slo_k == 0.5
    fixed = parse_config(
        {"router": {"dispatch": {"readiness": {"mode": "fixed", "max_queued_s": 2, "lead_queue": False}}}}
    ).router.dispatch
    assert fixed.readiness == Readiness(max_queued_s=2.0)
    assert fixed.build().readiness == Readiness(max_queued_s=2.0)  # no adaptive state
    kept = parse_config({"router": {"dispatch": {"readiness": {"max_queued_s": 2, "slo_k": 0.7}}}})
    assert kept.router.dispatch.readiness.slo_k == 0.7
    with pytest.raises(ValueError, match="slo_k is for readiness mode adaptive"):
        parse_config({"router": {"dispatch": {"readiness": {"mode": "fixed", "slo_k": 0.7}}}})
    assert (spec.max_queue, spec.max_queue_wait_s) == (9, 30.0) and cfg.sglang_priority
    # immediate ignores a readiness section (it holds no queue), as before
    assert parse_config({"router": {"dispatch": {"order": "immediate", "readiness": {"max_queued_s": 3}}}})
    # the simulator's spec as the router's section builds the same queue
    s = DispatchSpec.parse("deadline-defer:age_k=2:max_queue=9:max_running=3")
    live = parse_config({"router": {"dispatch": s.to_config()}}).router.dispatch.build()
    sim = s.build()
    assert live.order.params() == sim.order.params() and live.readiness == sim.readiness
    assert live.max_queue == sim.max_queue == 9
    # unbounded waits stay unbounded over the router's bounded default
    assert live.max_wait_k is sim.max_wait_k is None and live.max_queue_wait_s is sim.max_queue_wait_s is None
    # an order parameter the spec leaves at the order's default is written, so the router
    # does not run its own default's value instead (slack without far_k: off, not 5)
    for label, far_k in (
        ("slack:T=4:affinity=1:bypass=1:lead_share=1:slo_k=0.5", 0.0),
        (ROUTER_DISPATCH.label(), 5.0),
    ):
        s = DispatchSpec.parse(label)
        live = parse_config({"router": {"dispatch": s.to_config()}}).router.dispatch.build()
        assert live.order.params() == s.build().order.params() and live.order.far_k == far_k


def test_replicas_are_a_field():
    spec = DispatchSpec.parse("deadline-defer:replicas=3")
    assert spec.replicas == 3 and spec.params == {} and spec.build().order.age_k == 5.0
    assert spec.settings() == {"replicas": 3}
    cfg = SimOptions(dispatch=spec).sim_config()
    assert cfg.dispatch == spec and cfg.dispatch.label() == "deadline-defer:replicas=3"
    with pytest.raises(ValueError, match="whole number"):
        DispatchSpec.parse("fifo:replicas=1.5")
    with pytest.raises(ValueError, match="replicas need a queue"):
        DispatchSpec.parse("immediate:replicas=2")
    with pytest.raises(ValueError, match="replicas"):
        spec.to_config()  # live replicas are router processes


def test_command_line_options_make_one_spec():
    p = argparse.ArgumentParser()
    add_dispatch_arguments(p)
    args = p.parse_args(["--dispatch", "slack", "--dispatch-param", "T=4", "--dispatch-param", "replicas=2"])
    opts = SimOptions.from_args(args)
    assert opts.dispatch == DispatchSpec.parse("slack:T=4:replicas=2")
    assert opts.sim_config().dispatch.label() == "slack:T=4:replicas=2"
    with pytest.raises(ValueError, match="--dispatch-param 'T' must be a number"):
        SimOptions.from_args(p.parse_args(["--dispatch", "slack", "--dispatch-param", "T=x"]))
    bad = SimOptions.from_args(p.parse_args(["--dispatch-param", "T=3"]))  # immediate: no threshold
    with pytest.raises(ValueError, match="no readiness threshold"):
        bad.sim_config()


def test_bench_axis_items_over_the_command_line_values():
    from stack.bench.runner import dispatch_options

    base = SimOptions(dispatch=SIM_DISPATCH.updated(None, {"T": 4}))
    assert dispatch_options(base, "slack:age_k=2").dispatch == DispatchSpec.parse("slack:T=4:age_k=2")
    assert dispatch_options(base, "slack:T=6").dispatch.readiness.max_queued_s == 6.0
    assert dispatch_options(base, "immediate").dispatch == SIM_DISPATCH
    with pytest.raises(ValueError):
        dispatch_options(base, "immediate:T=3")


@pytest.mark.parametrize(
    "text,match",
    [
        ("", "empty dispatch order"),
        ("edf", "unknown dispatch order 'edf'"),
        ("laxity:relax_k", "expects key=value"),
        ("slack:T=fast", "'T' must be a number"),
        ("fifo:age_k=2", "takes no parameter"),
        ("fifo:T=0", "max_queued_s must be > 0"),
        ("immediate:T=1", "no readiness threshold"),
        ("immediate:max_queue=3", "holds no queue"),
        ("slack:steal=-1", "steal must be >= 0"),
    ],
)
def test_bad_specs_give_clear_errors(text, match):
    with pytest.raises(ValueError, match=match):
        DispatchSpec.parse(text)


def test_unbounded_and_infinite_values():
    spec = DispatchSpec.parse("fifo:max_queue=inf:max_queue_wait_s=inf")
    assert spec.max_queue is None and spec.max_queue_wait_s is None
    assert spec.label() == "fifo:max_queue=inf:max_queue_wait_s=inf"
    assert DispatchSpec.parse("deadline-defer:age_k=inf").build().order.age_k == math.inf


@pytest.mark.parametrize(
    "section",
    [
        {},
        {"order": "immediate", "sglang_priority": True},
        {"order": "slack", "readiness": {"mode": "fixed", "max_queued_s": 2}, "max_queue": 50},
        {"readiness": {"max_running": 8, "lead_queue": False}, "bypass": None, "replica_mode": "own"},
    ],
)
def test_a_dumped_deployment_config_parses_back_to_the_same_queue(section):
    """`smetric router` dumps the config it read and parses it again (flags over a file):
    the dispatch section it writes is the one it reads, with the same behaviour."""
    from stack.config import parse_config

    cfg = parse_config({"router": {"dispatch": section}})
    again = parse_config(cfg.model_dump()).router.dispatch
    a = cfg.router.dispatch
    assert (again.order, again.order_params, dict(again.readiness)) == (
        a.order,
        a.order_params,
        dict(a.readiness),
    )
    for k in ("max_queue", "max_queue_wait_s", "replica_mode", "sglang_priority", "bypass", "affinity"):
        assert getattr(again, k) == getattr(a, k), k
