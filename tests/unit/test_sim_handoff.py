"""The PD hand-off in the cost model and the simulator (stack/core/cost_model.py HandoffCost):
its terms, the calibration file's section, and the time it adds to a simulated first token."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from stack.core.cost_model import CostModel, DecodeCost, HandoffCost, dump_hardware, load_hardware
from stack.dispatch import ROUTER_DISPATCH
from stack.paths import default_trace
from stack.sim.engine import SimConfig, Simulator
from stack.sim.load import LoadSpec
from stack.sim.sessions import ttft_alone
from stack.traces.load import load_trace
from stack.traces.model import Trace, TraceRequest


def test_terms_add_up():
    dec = DecodeCost(d_fwd=0.01, d_experts=0.0, expert_share=0.0625, d_ctx=1e-6)
    h = HandoffCost(bootstrap_s=0.1, transfer_gbps=8.0, first_step=True, hop_s=0.02)
    # 1,000 tokens of 1,000 bytes = 8e6 bits at 8 Gbit/s: 1 ms; the first step: 10 ms + 1 ms
    assert h.engine_seconds(1000, 1000, dec) == pytest.approx(0.1 + 0.001 + 0.011)
    assert h.seconds(1000, 1000, dec) == pytest.approx(0.1 + 0.001 + 0.011 + 0.02)
    assert HandoffCost().off and HandoffCost().seconds(5000, 1000, dec) == 0.0
    assert not HandoffCost(hop_s=0.01).off


def test_shipped_calibrations_leave_it_out_and_files_round_trip(tmp_path):
    for name in ("h20", "h200"):
        assert load_hardware(name).handoff.off  # not measured on a GPU yet
    hw = replace(load_hardware("h20"), handoff=HandoffCost(0.15, 25.0, True, 0.01))
    path = tmp_path / "cal.yaml"
    path.write_text(dump_hardware(hw))
    assert load_hardware(str(path)).handoff == hw.handoff
    # a file without the section (an older calibration) reads as no hand-off
    text = path.read_text().split("handoff:")[0]
    path.write_text(text)
    assert load_hardware(str(path)).handoff.off


def _run(hardware, mode: str = "pd") -> dict:
    trace = load_trace(default_trace())
    spec = LoadSpec(mode="sessions", session_rate=0.002, duration=3600.0, seed=0)
    cfg = SimConfig(instances=8, dispatch=ROUTER_DISPATCH, hardware=hardware, mode=mode)
    return Simulator(trace, "smetric", cfg, spec).run().metrics


def test_a_quiet_pool_gets_each_first_token_the_hand_off_later():
    """At a load where requests rarely meet, every first token comes the hand-off's seconds
    later (a fixed 0.3 s here): the quantiles move by exactly that (the next turns come later
    too, so a request or two meets another at other times: the mean moves by about it)."""
    base = load_hardware("h20")
    with_ho = replace(base, handoff=HandoffCost(bootstrap_s=0.3))
    a, b = _run(base), _run(with_ho)
    assert a["requests"] == b["requests"] > 20
    for q in ("ttft_p50", "ttft_p90", "ttft_p99"):
        assert b[q] == pytest.approx(a[q] + 0.3, abs=1e-6)
    assert b["ttft_mean"] == pytest.approx(a["ttft_mean"] + 0.3, abs=0.05)
    assert b["prefill_tps"] == pytest.approx(a["prefill_tps"])
    # a colocated pool has no hand-off
    c, d = _run(base, "colocated"), _run(with_ho, "colocated")
    assert d["ttft_p50"] == pytest.approx(c["ttft_p50"])


def test_a_session_alone_is_charged_the_hand_off_too():
    """Slowdown compares a session with itself alone: alone, each turn waits the hand-off as
    well, so the hand-off alone never reads as a slowdown."""
    trace = load_trace(default_trace())
    tr = trace.requests[0]
    cost = load_hardware("h20").cost
    assert ttft_alone(trace, tr, cost, lambda L: 0.25) == pytest.approx(ttft_alone(trace, tr, cost) + 0.25)


def test_a_spread_moves_each_hand_off_by_its_drawn_quantile(tmp_path):
    dec = DecodeCost()
    h = HandoffCost(bootstrap_s=0.1, spread_s=(-0.05, 0.0, 0.2))
    assert not HandoffCost(spread_s=(0.0, 0.1)).off
    assert h.drawn(100, 1000, dec, 0.0) == pytest.approx(0.05)
    assert h.drawn(100, 1000, dec, 0.5) == pytest.approx(0.1)
    assert h.drawn(100, 1000, dec, 0.75) == pytest.approx(0.2)  # halfway between 0 and 0.2
    assert HandoffCost(bootstrap_s=0.01, spread_s=(-1.0, 0.0)).drawn(1, 1, dec, 0.0) == 0.0  # never < 0
    hw = replace(load_hardware("h20"), handoff=h)
    path = tmp_path / "cal.yaml"
    path.write_text(dump_hardware(hw))
    assert load_hardware(str(path)).handoff == h


def test_the_simulator_draws_each_requests_hand_off_from_the_spread():
    """Each first token waits its own draw (seeded: the same run twice is the same run), so the
    first tokens come on average the spread's mean later than with the typical hand-off."""
    base = load_hardware("h20")
    fixed = replace(base, handoff=HandoffCost(bootstrap_s=0.3))
    spread = replace(base, handoff=HandoffCost(bootstrap_s=0.3, spread_s=(-0.2, -0.1, 0.0, 0.4, 1.6)))
    a, b, b2 = _run(fixed), _run(spread), _run(spread)
    assert [b[k] for k in ("ttft_p50", "ttft_p90", "ttft_mean")] == [
        b2[k] for k in ("ttft_p50", "ttft_p90", "ttft_mean")
    ]
    assert a["requests"] == b["requests"] > 20
    assert b["ttft_p50"] != a["ttft_p50"]
    # the draws' mean lies 0.25 s above the line (the quantile function's mean)
    assert b["ttft_mean"] - a["ttft_mean"] == pytest.approx(0.25, abs=0.1)


def _two_requests_ttfts(handoff: HandoffCost) -> list[float]:
    """Two one-turn sessions on one instance (1 ms a token, 10 ms a forward): A of 1,000
    tokens at 0 s, B of 500 tokens at 0.1 s, which waits for A's forward. Their TTFTs."""
    reqs = [
        TraceRequest(0, 0, 0, 1, 0.0, 0.0, 0.0, 1000, 1, -1, ((0, 0, 10),), 10),
        TraceRequest(1, 1, 0, 1, 0.1, 0.0, 0.0, 500, 1, -1, ((1, 0, 5),), 5),
    ]
    trace = Trace("two", "agentic", 100, reqs, [[0], [1]], [0.0, 0.1], True, 2)
    hw = replace(load_hardware("h20"), cost=CostModel(1e-3, 0.0, 0.01), handoff=handoff)
    spec = LoadSpec(mode="compress", rate_scale=1.0, warmup=0.0, measure_until=math.inf, seed=0)
    sim = Simulator(trace, "smetric", SimConfig(instances=1, hardware=hw), spec)
    sim.hr = []
    sim.run()
    return [ttft for _, _, _, _, _, _, _, ttft, _ in sorted(sim.hr)]


def test_a_prefill_is_handed_over_between_forwards():
    """SGLang's PD prefill loop checks its KV transfers after each forward: A's prefill ends at
    1.01 s as the instance starts B's forward (B waited), so A is handed over when that forward
    ends (1.52 s). B's own forward is the last: it goes out as it ends."""
    a, b = _two_requests_ttfts(HandoffCost())
    assert (a, b) == (pytest.approx(1.01), pytest.approx(1.52 - 0.1))
    a, b = _two_requests_ttfts(HandoffCost(between_forwards=True))
    assert (a, b) == (pytest.approx(1.52), pytest.approx(1.52 - 0.1))
    # with a hand-off, each first token waits it after the hand-over
    a, b = _two_requests_ttfts(HandoffCost(bootstrap_s=0.05, between_forwards=True))
    assert (a, b) == (pytest.approx(1.57), pytest.approx(1.47))
    assert not HandoffCost(between_forwards=True).off


def test_between_forwards_round_trips_and_is_written_only_when_set(tmp_path):
    h = HandoffCost(bootstrap_s=0.05, between_forwards=True)
    path = tmp_path / "cal.yaml"
    path.write_text(dump_hardware(replace(load_hardware("h20"), handoff=h)))
    assert load_hardware(str(path)).handoff == h
    assert "between_forwards" not in dump_hardware(load_hardware("h20"))
