"""Faults under load, counted: every request ends ok or with a clean error, none is lost.

The scenarios (``stack.faults``) run real processes on loopback: emulated SGLang
workers, the ``smetric router`` command and, for the global tier, a real ``mooncake_master``.
``pytest -m faults`` selects them; ``python -m stack.faults`` prints the same counts
as a table (docs/research/faults.md).
"""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from stack import faults
from stack.decode_router.sse import SSECheck
from stack.kv_tier.global_index import MooncakeExistence
from stack.launch.loopback import mooncake_skip_reason
from stack.pool import parse_loads

N = 48  # requests per scenario (plus an after-batch), 8 in flight
CONC = 8
DEADLINE = 60.0  # a request with no answer after this long is a hang (lost)


def _report(res: faults.Result) -> None:
    c = res.counts
    print(f"\n{res.name}: {c.row()} checks={res.checks}")
    for reason, k in sorted(c.reasons.items()):
        print(f"    {k:4d}  {reason}")
    for note in res.notes:
        print(f"    {note}")
    assert c.sent == c.ok + c.clean + c.lost
    assert c.lost == 0, dict(c.reasons)
    assert all(res.checks.values()), res.checks


@pytest.mark.faults
@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    "scenario",
    [
        "prefill_killed",
        "decode_killed",
        "slow_worker",
        "handoff_stalled",
        "malformed_worker",
        "hostile_client",
    ],
)
def test_fault_scenario(scenario, tmp_path):
    res = faults.SCENARIOS[scenario](tmp_path, n=N, concurrency=CONC, deadline=DEADLINE)
    assert res.counts.sent >= N
    _report(res)


@pytest.mark.faults
@pytest.mark.mooncake
@pytest.mark.timeout(240)
@pytest.mark.skipif(mooncake_skip_reason() is not None, reason=mooncake_skip_reason() or "")
def test_fault_mooncake_master_stopped(tmp_path):
    res = faults.mooncake_master_stopped(tmp_path, n=N, concurrency=CONC, deadline=DEADLINE)
    _report(res)
    assert res.counts.ok == res.counts.sent  # the global tier is an optimisation: nothing fails


# -- the classifier itself ------------------------------------------------------------------------
def test_classifier():
    ok_sse = b'data: {"choices": [{"delta": {"content": "a"}}]}\n\ndata: [DONE]\n\n'
    assert faults.classify_sse(ok_sse)[0] == "ok"
    err = b'data: {"error": {"message": "x"}}\n\ndata: [DONE]\n\n'
    assert faults.classify_sse(b'data: {"a": 1}\n\n' + err)[0] == "clean"
    assert faults.classify_sse(b'data: {"a": 1}\n\ndata: {"error": {"message": "x"}}\n\n')[0] == "lost"
    assert faults.classify_sse(b'data: {"a": 1}\n\n')[0] == "lost"  # truncated
    assert faults.classify_sse(b'data: {"a": \n\ndata: [DONE]\n\n')[0] == "lost"
    assert faults.classify_json(b'{"choices": []}')[0] == "ok"
    # an abort with no output is an empty success: an agent reads it as an empty answer
    assert faults.classify_json(b'{"choices": [{"finish_reason": "abort"}]}')[0] == "lost"
    aborted = b'{"choices": [{"finish_reason": "abort", "message": {"content": "par"}}]}'
    assert faults.classify_json(aborted)[0] == "clean"
    empty = b'data: {"choices": [{"delta": {}, "finish_reason": "abort"}]}\n\ndata: [DONE]\n\n'
    assert faults.classify_sse(empty)[0] == "lost"
    part = b'data: {"choices": [{"delta": {"content": "a"}}]}\n\n' + empty
    assert faults.classify_sse(part)[0] == "clean"
    assert faults.classify_json(b'{"choices": [')[0] == "lost"
    assert faults.classify_error(502, b'{"error": {"message": "m", "type": "t"}}')[0] == "clean"
    assert faults.classify_error(500, b"Internal Server Error")[0] == "lost"


# -- router pieces the scenarios found wanting --------------------------------------------------------
def test_sse_check_forwards_whole_events_and_rejects_malformed_ones():
    s = SSECheck()
    assert s.feed(b'data: {"a"') == b""
    assert s.feed(b': 1}\n\ndata: {"b": 2}') == b'data: {"a": 1}\n\n'
    assert s.feed(b"\n\ndata: [DONE]\n\n") == b'data: {"b": 2}\n\ndata: [DONE]\n\n'
    assert s.done
    with pytest.raises(ValueError):
        SSECheck().feed(b"data: {not json\n\n")
    s = SSECheck()
    assert s.feed(b": keep-alive\n\n") == b": keep-alive\n\n" and not s.done


def test_parse_loads_tolerates_nonsense():
    assert parse_loads({"loads": [{"num_running_reqs": "lots"}]}) is None
    assert parse_loads({"loads": [{"num_running_reqs": 1e400}]}) is None
    assert parse_loads({"load": [1]}) is None
    assert parse_loads({"loads": [{"num_running_reqs": 2, "num_waiting_reqs": 1}]}) == (2, 1, 0.0)


def test_mooncake_existence_does_not_queue_behind_a_dead_store():
    gate = threading.Event()
    calls = []

    class Stuck:
        def batch_is_exist(self, keys):
            calls.append(len(keys))
            gate.wait(10)
            return [True] * len(keys)

    g = MooncakeExistence(Stuck(), timeout_s=0.02, max_inflight=2)

    async def go():
        got = [await g.hit_blocks([i, i + 1]) for i in range(6)]
        assert got == [0] * 6  # every lookup misses at once
        assert len(calls) == 2 and g.timeouts == 2 and g.skipped == 4
        gate.set()
        t0 = time.monotonic()
        while g.inflight and time.monotonic() - t0 < 5:
            await asyncio.sleep(0.01)
        assert g.inflight == 0
        assert await g.hit_blocks([100, 101]) == 2  # the store is back

    asyncio.run(go())


@pytest.mark.faults
@pytest.mark.timeout(120)
def test_a_worker_whose_port_another_server_answers_is_refused(tmp_path):
    """The CI failure behind stack/ports.py: a prefill worker handed the port of the first one's
    bootstrap server looked started (that server answers /health) and every request routed to
    it got 404. The fault stack now checks who answers each port (the bootstrap server has no
    /server_info)."""
    s = faults.FaultStack(tmp_path)
    s.prefill[1].port = s.prefill[0].bootstrap_port
    with s.procs:
        s.start_worker(s.prefill[0])
        with pytest.raises(RuntimeError, match="is answered by None"):
            s.start_worker(s.prefill[1])
    s.http.close()
