"""The memory of requests refused for their wait (stack/dispatch/refusals.py), shared by the
router replicas: a client's retry is known whichever replica it reaches. The live router's
side, through a real Redis, is tests/integration/test_replica_refusals.py."""

from __future__ import annotations

import collections

import pytest
from test_dispatch import entry

from stack.dispatch import MAX_QUEUE_WAIT, ROUTER_DISPATCH, make_dispatcher
from stack.dispatch.refusals import READMIT_WINDOW_S, Refusals
from stack.paths import default_trace
from stack.sim.clients import ClientModel
from stack.sim.engine import SimConfig, Simulator
from stack.sim.load import LoadSpec
from stack.traces.load import load_trace


def test_each_refusal_readmits_one_request_within_the_window():
    m = Refusals()
    m.remember(("p", 1), 0.0)
    m.remember(("p", 1), 1.0)
    assert len(m) == 2
    assert m.readmits(("p", 1), 2.0) and m.readmits(("p", 1), 3.0)
    assert not m.readmits(("p", 1), 4.0)  # both used up
    assert not m.readmits(("q", 2), 4.0)  # never refused
    m.remember(("p", 1), 10.0)
    assert not m.readmits(("p", 1), 10.0 + READMIT_WINDOW_S)  # forgotten
    assert len(m) == 0
    with pytest.raises(ValueError):
        Refusals(window_s=0)


def keyed(name: str, at: float, key):
    e = entry(name, at, 1.0)
    e.key = key
    return e


def test_replicas_sharing_one_memory_know_each_others_refusals():
    """Refused at one replica, the retry reaches another: with one memory it is readmitted
    there (and leaves at its bound rather than being refused again); with a memory each, it is
    a stranger."""
    shared = Refusals()
    a = make_dispatcher("fifo", max_queue_wait_s=10.0)
    a.refusals = shared
    b = make_dispatcher("fifo", max_queue_wait_s=10.0)
    b.refusals = shared
    a.admit(keyed("x1", 0.0, ("p", 1)), 0.0)
    assert [r.entry.handle for r in a.expire(10.5)] == ["x1"]
    x2 = keyed("x2", 12.0, ("p", 1))
    b.admit(x2, 12.0)
    assert x2.readmitted and b.expire(22.5) == [] and [e.handle for e in b.take_overdue()] == ["x2"]
    x3 = keyed("x3", 23.0, ("p", 1))  # the one refusal is used up, at either replica
    a.admit(x3, 23.0)
    assert not x3.readmitted

    own = make_dispatcher("fifo", max_queue_wait_s=10.0)  # a memory of its own
    a.admit(keyed("y1", 30.0, ("q", 2)), 30.0)
    a.expire(40.5)
    y2 = keyed("y2", 42.0, ("q", 2))
    own.admit(y2, 42.0)
    assert not y2.readmitted


def test_spec_build_takes_the_shared_memory():
    m = Refusals()
    d1, d2 = ROUTER_DISPATCH.build(m), ROUTER_DISPATCH.build(m)
    assert d1.refusals is m and d2.refusals is m
    assert ROUTER_DISPATCH.build().refusals is not ROUTER_DISPATCH.build().refusals


def _wait_refusals(replicas: int, mode: str = "claims"):
    """Two instances past the knee, clients that never give up: per request, how many times
    a queue refused it for its wait; the run's metrics; the simulator."""
    trace = load_trace(default_trace())
    spec = LoadSpec(mode="sessions", session_rate=0.04, duration=1800.0, seed=3)
    d = ROUTER_DISPATCH
    if replicas > 1:
        d = d.updated(d.order, {"replicas": replicas, "replica_mode": mode})
    s = Simulator(
        trace, "smetric-global", SimConfig(instances=2, dispatch=d, clients=ClientModel(patience_s=1e6)), spec
    )
    refused: collections.Counter = collections.Counter()
    reject = s.queue.reject

    def recorded(now, r):
        if r.reason == MAX_QUEUE_WAIT:
            tr, sess, _, _ = r.entry.handle
            refused[(sess.copy, id(tr))] += 1
        reject(now, r)

    s.queue.reject = recorded
    return refused, s.run().metrics, s


@pytest.mark.parametrize("mode", ["claims", "own"])
def test_in_the_simulator_no_retry_is_refused_for_its_wait_again_whichever_replica_it_reaches(mode):
    """Attempts go to the replicas round-robin (a load balancer), so a retry seldom reaches
    the replica that refused it. With one memory across the replicas no request is refused
    for its wait twice (its clients never give up, so nothing else ends a readmitted attempt),
    and none fails after its retries. (A memory per replica refused some 49 requests twice
    here, and 13 failed.)"""
    refused, m, s = _wait_refusals(4, mode)
    assert len({id(d.refusals) for d in s.queue.disps}) == 1
    assert len(refused) > 20 and max(refused.values()) == 1
    assert m["overdue"] > 0 and m["failed_after_retries"] == 0
    one, m1, _ = _wait_refusals(1)
    assert max(one.values()) == 1 and m1["failed_after_retries"] == 0


def test_a_refusal_used_up_early_does_not_shorten_a_later_ones_window():
    m = Refusals(window_s=10.0)
    m.remember("k", 0.0)
    assert m.readmits("k", 1.0)  # its retry
    m.remember("k", 5.0)  # refused again later (a newcomer with the same prompt)
    assert m.readmits("k", 12.0)  # remembered until 15, not forgotten at 10 with the first
    assert not m.readmits("k", 12.0)
