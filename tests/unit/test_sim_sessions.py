"""Session slowdown (stack/sim/sessions.py): a session's completion time against its own alone."""

from __future__ import annotations

import pytest

from stack.core.cost_model import CostModel
from stack.dispatch import ROUTER_DISPATCH
from stack.paths import default_trace
from stack.sim.engine import SimConfig, Simulator
from stack.sim.load import LoadSpec
from stack.sim.sessions import SessionClock, common_blocks, ttft_alone
from stack.traces.load import load_trace
from stack.traces.model import Trace, TraceRequest


def test_common_blocks_of_two_paths():
    assert common_blocks(((0, 0, 4),), ((0, 0, 6),)) == 4  # one extends the other
    assert common_blocks(((0, 0, 4), (1, 4, 9)), ((0, 0, 4), (1, 4, 7))) == 7
    assert common_blocks(((0, 0, 4), (1, 4, 9)), ((0, 0, 4), (2, 4, 9))) == 4  # diverged at 4
    assert common_blocks(((0, 0, 4),), ((3, 0, 4),)) == 0
    assert common_blocks((), ((0, 0, 4),)) == 0


def _trace() -> Trace:
    """One session of two streams: stream 0 has two turns (the second extends the first),
    stream 1 one turn."""
    reqs = [
        TraceRequest(0, 0, 0, 1, 0.0, 0.0, 0.0, 1000, 10, -1, ((0, 0, 10),), 10),
        TraceRequest(1, 0, 0, 2, 0.0, 0.0, 5.0, 1600, 10, 0, ((0, 0, 16),), 16),
        TraceRequest(2, 0, 1, 1, 0.0, 2.0, 0.0, 500, 10, -1, ((1, 0, 5),), 5),
    ]
    return Trace("t", "agentic", 100, reqs, [[0, 1, 2]], [0.0], False, 2)


def test_ttft_alone_reuses_only_the_predecessor():
    t, cost = _trace(), CostModel()
    assert ttft_alone(t, t.requests[0], cost) == pytest.approx(cost.cost(1000, 1000))
    # the second turn's first 10 blocks (1,000 tokens) are its predecessor's
    assert ttft_alone(t, t.requests[1], cost) == pytest.approx(cost.cost(600, 1600))


def test_slowdown_is_completion_over_completion_alone():
    t, cost = _trace(), CostModel()
    a = [ttft_alone(t, r, cost) for r in t.requests]
    c = SessionClock(t, cost, 0.0, 100.0)
    # stream 0: turn 1 delayed 3 s, turn 2 on time; stream 1 delayed 1 s; the session started at 10
    c.first_token(7, 10.0, t.requests[0], a[0] + 3.0)
    c.answered(7, t.requests[0], 20.0)
    c.first_token(7, 10.0, t.requests[2], a[2] + 1.0)
    c.answered(7, t.requests[2], 15.0)
    assert c.slowdowns == []  # a turn is still to come
    c.first_token(7, 10.0, t.requests[1], a[1])
    c.answered(7, t.requests[1], 40.0)
    # took 30 s; alone, stream 0 takes 30 - 3 = 27 s and stream 1 5 - 1 = 4 s
    assert c.slowdowns == [pytest.approx(30.0 / 27.0)]
    # a session that failed a turn is counted apart; one outside the window not at all
    c.first_token(8, 50.0, t.requests[0], 1.0)
    c.failed_turn(8, 50.0, 0)
    c.failed_turn(9, 500.0, 0)
    m = c.metrics()
    assert (m["sessions_complete"], m["sessions_failed"]) == (1, 1)
    assert m["session_slowdown_p90"] == pytest.approx(30.0 / 27.0)


def test_slowdown_grows_with_load_and_is_one_when_alone():
    """On the shipped trace, a lightly loaded cluster runs sessions about as fast as alone
    (never faster by more than what other sessions' shared prefixes save), and a loaded one
    slows them down."""
    trace = load_trace(default_trace())
    out = {}
    for rate in (0.005, 0.05):
        spec = LoadSpec(mode="sessions", session_rate=rate, duration=7200.0, seed=0)
        m = (
            Simulator(trace, "smetric-global", SimConfig(instances=8, dispatch=ROUTER_DISPATCH), spec)
            .run()
            .metrics
        )
        assert m["sessions_complete"] > 0
        out[rate] = m
    light, heavy = out[0.005], out[0.05]
    assert 0.9 <= light["session_slowdown_p50"] <= 1.1
    assert heavy["session_slowdown_p90"] > light["session_slowdown_p90"]
