"""The bounded wait in both drivers: the same arrivals, under the same dispatch spec, while no
instance can take work, are refused alike by the simulator and by the live router's queue:
the same requests, for the same reasons (``queue_full`` at admission, a queued request shed
for a newcomer worth more, ``max_queue_wait`` at the bound), after the same waits, with the
same Retry-After (the queue's drain estimate, one rule: Dispatcher.retry_after)."""

from __future__ import annotations

import asyncio
import math

import pytest
from prometheus_client import CollectorRegistry
from test_live_queue import FakeRouting, feats

from stack.core.cost_model import CostModel, Hardware
from stack.core.types import SLO
from stack.dispatch import SIM_DISPATCH
from stack.pool import WorkerRegistry
from stack.prefill_router.errors import Overloaded
from stack.prefill_router.queue import LiveQueue
from stack.sim.clients import ClientModel
from stack.sim.engine import GlobalTierSpec, SimConfig, Simulator
from stack.sim.load import LoadSpec
from stack.sim.queues import RouterQueue
from stack.traces.load import load_trace
from support.traces import agentic_record, write_jsonl

pytestmark = pytest.mark.timeout(60)

COST = CostModel(c_linear=1e-4, c_attn=1e-9, c_fwd=0.01)
HW = Hardware(
    name="test", cost=COST, hbm_kv_tokens=1_000_000, chunk_tokens=1024, kv_bytes_per_token=1000,
    gpus_per_server=2, nic_gbps=8.0, link_efficiency=1.0, decode_tpot_s=0.0,
)  # fmt: skip
SLO_ = SLO(b=0.2, a=2e-4)  # a 10k-token request: 2.2 s, about twice its prefill
#: a queue of two, every wait bounded by 2 s; readiness: an instance with more than 2 s of
#: prefill queued takes nothing (the simulator's instance, busy for about 20 s)
SPEC = SIM_DISPATCH.updated("deadline", {"T": 2.0, "max_queue": 2, "max_queue_wait_s": 2.0})
BLOCKS = 156  # 9,984 tokens: about 1.1 s of prefill each
#: (name, arrival s): A and B fill the queue; C finds it full and, all three feasible, is the
#: latest arrival: refused at once; D comes when A and B can no longer meet their SLO: the
#: latest of those, B, is shed for D; A and then D leave at the 2 s bound
ARRIVALS = [("A", 0.30), ("B", 0.32), ("C", 0.34), ("D", 1.5)]


def _simulated(tmp_path) -> dict[str, tuple[str, float, float]]:
    """name -> (reason, waited s, Retry-After s) of each refusal in the simulator, one instance
    kept busy by a 100k-token request from t = 0."""
    recs = [agentic_record(0, 1, 0.0, 1600)]
    recs += [agentic_record(1 + i, 1, t, BLOCKS) for i, (_, t) in enumerate(ARRIVALS)]
    trace = load_trace(write_jsonl(tmp_path / "parity.jsonl", recs))
    cfg = SimConfig(
        instances=1,
        hardware=HW,
        global_tier=GlobalTierSpec.parse("full"),
        slo=SLO_,
        dispatch=SPEC,
        clients=ClientModel(patience_s=1000.0, max_retries=0),
    )
    spec = LoadSpec(mode="compress", rate_scale=1.0, warmup=0.0, measure_until=math.inf)
    sim = Simulator(trace, "least-load", cfg, spec)
    names = {tr.session: ARRIVALS[i][0] for i, tr in enumerate(trace.requests[1:])}
    reasons: dict[int, tuple[str, float]] = {}
    out: dict[str, tuple[str, float, float]] = {}
    reject, retry_or_fail = sim.queue.reject, sim.retries.retry_or_fail

    def spy_reject(now, r):
        reasons[id(r.entry.handle[3])] = (r.reason, r.waited_s)
        reject(now, r)

    def spy_retry_or_fail(now, handle, retry_after, measured, refused):
        tr, _, _, att = handle
        reason, waited = reasons[id(att)]
        out[names[tr.session]] = (reason, waited, retry_after)
        retry_or_fail(now, handle, retry_after, measured, refused)

    sim.queue.reject, sim.retries.retry_or_fail = spy_reject, spy_retry_or_fail
    m = sim.run().metrics
    assert sim.tally.issued == len(ARRIVALS) + 1 and sim.tally.rejected == len(out), (m, out)
    assert RouterQueue.reject is not spy_reject  # the spies were on this run only
    return out


async def _live() -> dict[str, tuple[str, float, float]]:
    """The same arrivals on the live router's queue, its one worker busy throughout."""
    reg = WorkerRegistry(eject_cooldown_s=0)
    reg.add("prefill", "http://127.0.0.1:10000")
    live_spec = SPEC.updated(None, {"max_running": 1})  # the live worker: busy while it runs one
    q = LiveQueue(live_spec.build(), FakeRouting(reg), reg, COST, SLO_, CollectorRegistry(), retry_after_s=1)
    reg.book(reg.workers[0], 10, 0.01)  # never done: the worker takes nothing
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    out: dict[str, tuple[str, float, float]] = {}

    async def one(name: str, at: float) -> None:
        await asyncio.sleep(max(0.0, t0 + at - loop.time()))
        try:
            await q.route(feats(name, L=BLOCKS * 64, turn=1), set(), set(), False)
        except Overloaded as e:
            out[name] = (e.reason, e.waited_s, e.retry_after_s)

    await asyncio.wait_for(asyncio.gather(*(one(n, t) for n, t in ARRIVALS)), 10)
    return out


def test_the_simulator_and_the_live_queue_refuse_the_same_requests_alike(tmp_path):
    sim = _simulated(tmp_path)
    live = asyncio.run(_live())
    # what the scenario says, in the simulator's modelled seconds
    assert {n: r for n, (r, _, _) in sim.items()} == {
        "C": "queue_full",
        "B": "queue_full",
        "A": "max_queue_wait",
        "D": "max_queue_wait",
    }
    assert sim["C"][1] == 0.0 and sim["B"][1] == pytest.approx(1.5 - 0.32, abs=1e-6)
    assert sim["A"][1] == pytest.approx(2.0, abs=1e-3) and sim["D"][1] == pytest.approx(2.0, abs=1e-3)
    # the live queue: the same refusals, reasons and Retry-After; waits within its timers' slack
    assert set(live) == set(sim)
    for name, (reason, waited, retry_after) in sim.items():
        lr, lw, la = live[name]
        assert (lr, la) == (reason, retry_after), name
        assert lw == pytest.approx(waited, abs=0.25), name
    # Retry-After is the drain estimate of what was still queued, not a constant
    assert sim["C"][2] > sim["D"][2] == 1
