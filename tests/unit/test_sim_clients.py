"""The simulator's client model (stack/sim/clients.py): clients that time out and retry."""

from __future__ import annotations

import random

import pytest

from stack.dispatch import ROUTER_DISPATCH, SIM_DISPATCH
from stack.paths import default_trace
from stack.sim.clients import ClientModel
from stack.sim.engine import SimConfig, Simulator
from stack.sim.load import LoadSpec
from stack.traces.load import load_trace

WALL = {"sim_wall_s", "sim_requests_per_s"}


def test_delay_honours_retry_after_else_backs_off_with_jitter():
    cm = ClientModel()
    rng = random.Random(0)
    assert cm.delay(1, 7.0, rng) == 7.0  # Retry-After, as the SDKs honour it
    for retry, base in ((1, 0.5), (2, 1.0), (3, 2.0), (6, 8.0), (9, 8.0)):  # capped at 8 s
        for after in (None, 0.0, 61.0):  # none, unusable, or too long: the backoff
            d = cm.delay(retry, after, rng)
            assert 0.75 * base <= d <= base
    for bad in (ClientModel(patience_s=0), ClientModel(max_retries=-1), ClientModel(backoff_s=9.0)):
        with pytest.raises(ValueError):
            bad.validate()


def _run(clients, dispatch=ROUTER_DISPATCH, seed=3):
    trace = load_trace(default_trace())
    spec = LoadSpec(mode="sessions", session_rate=0.02, duration=1800.0, seed=seed)
    s = Simulator(trace, "smetric-global", SimConfig(instances=2, dispatch=dispatch, clients=clients), spec)
    return s, s.run().metrics


def test_clients_that_give_up_are_taken_back_and_retry():
    """Past the knee on two instances, clients with 20 s of patience: attempts time out, the
    router takes them back (out of its queue, off an instance they wait on), the clients retry
    and some requests fail after their retries; every attempt is accounted for."""
    s, m = _run(ClientModel(patience_s=20.0))
    assert m["timeouts"] > 0 and m["retries"] > 0 and s.tally.cancelled > 0
    assert m["attempts"] == m["requests"] + m["failed_after_retries"] + m["retries"]
    assert s.tally.issued == s.tally.served + s.tally.rejected + s.tally.cancelled
    # an answer reaches its client within its attempt's patience; counted from the first
    # attempt, a served request waited at most every attempt's patience and the waits before
    # its retries (a backoff of at most 1 s, or a Retry-After of at most 60 s)
    assert m["ttft_max"] <= 3 * 20.0 + 2 * 60.0
    # the router aborts an attempt its client gave up on, and the engine stops a prefill under
    # way at its next chunk boundary: every timed-out attempt was taken back, none answered
    # into the void (a prefill in its last chunk would be)
    assert s.tally.cancelled >= m["timeouts"] and m["abandoned_served"] == 0
    assert all(i.n_jobs == 0 and i.q_tokens == 0 for i in s.insts)  # nothing left behind
    assert 0 < m["failed_share"] < 1
    # the same seed, the same run (the jitter is seeded)
    _, again = _run(ClientModel(patience_s=20.0))
    assert {k: v for k, v in m.items() if k not in WALL} == {k: v for k, v in again.items() if k not in WALL}


def test_a_refused_request_is_retried_after_retry_after_and_timed_from_its_first_attempt():
    """A queue that holds one request refuses the others (queue_full); with clients they come
    back after Retry-After and are served, their TTFT counted from the first attempt."""
    tight = SIM_DISPATCH.updated("fifo", {"max_queue": 1})
    s0, off = _run(None, tight)
    s1, on = _run(ClientModel(), tight)
    assert off["rejected_measured"] > 0 and "attempts" not in off  # no client model: refusals end streams
    assert on["refusals"] > 0 and on["retries"] > 0
    # a refused request came back and was served: more refusals than the failed requests'
    # attempts account for (each failed one met at most 1 + its retries), and no timeouts
    assert on["timeouts"] == 0 and on["refusals"] > 3 * on["failed_after_retries"]
    assert s1.tally.issued == s1.tally.served + s1.tally.rejected + s1.tally.cancelled


def test_no_client_model_is_the_run_as_before():
    """``clients=None`` (the default) reports no client figures and never cancels."""
    s, m = _run(None)
    assert "attempts" not in m and s.tally.cancelled == 0
    assert s.tally.issued == s.tally.served + s.tally.rejected


def test_a_measured_request_retries_after_the_last_arrival():
    """The run's end stops new sessions and turns, not a measured request's client: an attempt
    that times out after the last arrival is retried like any other, so a measured request
    fails only once its retries are spent (the run's end is not counted as a failure)."""
    trace = load_trace(default_trace())
    spec = LoadSpec(mode="sessions", session_rate=0.05, duration=1800.0, seed=3)
    cm = ClientModel(patience_s=60.0)
    s = Simulator(trace, "smetric-global", SimConfig(instances=2, dispatch=ROUTER_DISPATCH, clients=cm), spec)
    late, failed = [], []
    orig = s.retries.retry_or_fail

    def spy(now, handle, retry_after, measured, refused):
        before = s.tally.failed + s.tally.rejected_measured
        orig(now, handle, retry_after, measured, refused)
        att = handle[3]
        if measured and now >= s.horizon:
            late.append(att.n)
        if s.tally.failed + s.tally.rejected_measured > before:
            failed.append(att.n)

    s.retries.retry_or_fail = spy
    m = s.run().metrics
    assert late, "no measured attempt timed out after the last arrival: the test saw nothing"
    assert failed and all(n == cm.max_retries + 1 for n in failed)
    assert m["failed_after_retries"] == len(failed)
