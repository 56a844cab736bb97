"""Headroom accounting (stack/sim/headroom.py): the split of missed tokens on hand-built
scenarios, the records leaving the simulation unchanged, and the window bound staying a
bound."""

from __future__ import annotations

import math

import pytest

from stack.core.cost_model import CostModel, Hardware
from stack.core.types import SLO, ClusterView, Decision, Request
from stack.dispatch import SIM_DISPATCH, DispatchSpec
from stack.paths import default_trace
from stack.policies import Policy, PolicyContext
from stack.sim.engine import GlobalTierSpec, SimConfig, Simulator
from stack.sim.headroom import CAUSES, attribute, own_compute, run_headroom, window_bound
from stack.sim.load import LoadSpec
from stack.traces.load import load_trace
from support.traces import agentic_record, write_jsonl

COST = CostModel(c_linear=1e-4, c_attn=1e-9, c_fwd=0.01)
L = 640  # 10 blocks
ONE = COST.c_fwd + COST.chunk(L, L)  # one such request alone on an idle instance


def hw() -> Hardware:
    return Hardware(
        name="test", cost=COST, hbm_kv_tokens=1_000_000, chunk_tokens=8192, kv_bytes_per_token=1000,
        gpus_per_server=2, nic_gbps=8.0, link_efficiency=1.0, decode_tpot_s=0.0,
    )  # fmt: skip


class First(Policy):
    """Every request to instance 0 (the other instances stay idle)."""

    name = "first"

    def choose(self, req: Request, view: ClusterView) -> Decision:
        return Decision(0)


def simulate(tmp_path, records, policy, instances=2, slo=0.1, **cfg):
    t = load_trace(write_jsonl(tmp_path / "t.jsonl", records))
    config = SimConfig(instances=instances, hardware=hw(), slo=SLO(b=slo, a=0.0), **cfg)
    if not isinstance(policy, str):
        policy = policy(PolicyContext(cost=COST, slo=config.slo))
    spec = LoadSpec(mode="compress", rate_scale=1.0, warmup=0.0, measure_until=math.inf)
    sim = Simulator(t, policy, config, spec)
    sim.hr = []
    res = sim.run()
    split = attribute(sim.hr, sim.cost, sim.chunk, sim.fetch_bw_est, config.slo)
    return sim, res, split


def three_at_once() -> list[dict]:
    return [agentic_record(s, 1, 0.0, 10, start_id=100 * s + 1) for s in range(3)]


def test_queueing_while_another_instance_is_idle_is_imbalance(tmp_path):
    sim, res, split = simulate(tmp_path, three_at_once(), First)
    # the first meets its SLO alone; the other two share the next forward on instance 0
    # while instance 1 stays idle: all their lateness is imbalance
    assert res.metrics["slo_attainment"] == pytest.approx(1 / 3)
    assert split.missed == 2 and split.missed_tokens == 2 * L
    assert split.tokens["imbalance"] == pytest.approx(2 * L)
    assert split.imbalance_idle == pytest.approx(2 * L)
    assert sum(split.tokens[c] for c in CAUSES) == pytest.approx(split.missed_tokens)


def test_queueing_with_no_better_instance_is_queue(tmp_path):
    # least-load on 2 instances: the third request finds both busy with as much work
    sim, res, split = simulate(tmp_path, three_at_once(), "least-load")
    assert split.missed == 1
    assert split.tokens["queue"] == pytest.approx(L)
    assert split.tokens["imbalance"] == 0.0
    (rec,) = [r for r in sim.hr if r[7] > 0.1]
    assert rec[8] == pytest.approx(ONE)  # q_min: the other instance's queued work


def test_an_oversized_request_is_infeasible(tmp_path):
    recs = [agentic_record(0, 1, 0.0, 10)]
    _, _, split = simulate(tmp_path, recs, "least-load", slo=ONE / 2)
    assert split.missed == 1 and split.tokens["infeasible"] == L
    assert sum(split.tokens.values()) == L


def test_a_request_held_at_the_router_is_router(tmp_path):
    # one instance; the readiness threshold is below one request's work, so the second
    # waits in the router's queue until the first is done
    recs = [agentic_record(s, 1, 0.0, 10, start_id=100 * s + 1) for s in range(2)]
    sim, _, split = simulate(
        tmp_path,
        recs,
        "least-load",
        instances=1,
        dispatch=SIM_DISPATCH.updated("fifo", {"max_queued_s": ONE / 2}),
    )
    held = [r for r in sim.hr if r[2] > 0]
    assert len(held) == 1 and held[0][2] == pytest.approx(ONE)
    assert split.missed == 1
    assert split.tokens["router"] == pytest.approx(L)


def test_link_backlog_is_fetch_and_own_transfer_is_not():
    slo = SLO(b=1.0, a=0.0)
    bw = 1000.0  # tokens/s
    n = 64
    C = own_compute(COST, 8192, n, L)
    # fetched 576 tokens: 0.576 s own transfer; waited 1.576 s (1 s behind other transfers)
    rec = (0, 0.0, 0.0, 1.576, 576, n, L, 1.576 + C, 0.0)
    split = attribute([rec], COST, 8192, bw, slo)
    assert split.tokens["fetch"] == pytest.approx(L)
    # the same transfer alone on its link, already past the SLO: infeasible
    rec = (0, 0.0, 0.0, 1.2, 1200, n, L, 1.2 + C, 0.0)
    assert attribute([rec], COST, 8192, bw, slo).tokens["infeasible"] == L


def test_tokens_split_in_proportion_to_the_avoidable_seconds():
    slo = SLO(b=1.0, a=0.0)
    n = 64
    C = own_compute(COST, 8192, n, L)
    # 1 s held at the router, 3 s queued (1 s of which another instance would have spared)
    rec = (0, 0.0, 1.0, 0.0, 0, n, L, 1.0 + 3.0 + C, 2.0)
    split = attribute([rec], COST, 8192, 1e6, slo)
    assert split.tokens["router"] == pytest.approx(L / 4)
    assert split.tokens["queue"] == pytest.approx(L / 2)
    assert split.tokens["imbalance"] == pytest.approx(L / 4)
    assert split.dominant["queue"] == L


def test_records_do_not_change_the_simulation():
    trace = load_trace(default_trace())
    spec = LoadSpec(mode="sessions", rate_scale=4.0, duration=3600.0, warmup=600.0, seed=1)
    plain = Simulator(trace, "smetric-global", SimConfig(instances=8), spec).run().metrics
    rec = Simulator(trace, "smetric-global", SimConfig(instances=8), spec)
    rec.hr = []
    m = rec.run().metrics
    for k in ("prefill_tps_within_slo", "ttft_p99", "requests", "fetch_tokens", "over_5x_slo"):
        assert m[k] == plain[k]
    assert len(rec.hr) == m["requests"] and not rec.hr_qmin


def test_window_bound_charges_a_burst():
    # 10 requests at once, each 0.3 s of work, SLO 1 s, one instance: at most 3 fit (the
    # LP relaxation allows 3.33)
    cost = CostModel(c_linear=0.3 / L, c_attn=0.0, c_fwd=0.0)
    recs = [(i, 0.0, 0.0, 0.0, 0, L, L, 5.0, 0.0) for i in range(10)]
    b = window_bound(recs, cost, 8192, SLO(b=1.0, a=0.0), 1, lengths=(1.0,))
    assert 3 * L <= b["tokens"] <= 10 / 3 * L + 1e-6
    assert b["feasible_tokens"] == 10 * L
    # spread over time, every one fits
    recs = [(i, 2.0 * i, 0.0, 0.0, 0, L, L, 5.0, 0.0) for i in range(10)]
    spread = window_bound(recs, cost, 8192, SLO(b=1.0, a=0.0), 1, lengths=(1.0, 4.0))
    assert spread["tokens"] == pytest.approx(10 * L)


@pytest.mark.parametrize(
    "policy,dispatch",
    [
        ("least-load", "immediate"),
        ("lmetric", "immediate"),
        ("smetric-global", "slack"),
        ("round-robin", "immediate"),
    ],
)
def test_the_bounds_hold_on_a_small_run(policy, dispatch):
    from stack.bench.bound import clairvoyant, ideal_hits

    trace = load_trace(default_trace())
    ideal = ideal_hits(trace)
    cfg = SimConfig(instances=4, dispatch=DispatchSpec.parse(dispatch), global_tier=GlobalTierSpec("full"))
    spec = LoadSpec(mode="sessions", rate_scale=3.0, duration=3600.0, warmup=900.0, seed=2)
    cb = clairvoyant(trace, cfg.hardware, 4, "sessions", 3600.0, ideal, cfg.slo)
    row = run_headroom(trace, policy, cfg, spec, ideal, cb.prefill_tps_within_slo)
    got = row["prefill_tps_within_slo"]
    assert got <= row["window_bound_tps"] * (1 + 1e-9)
    assert row["window_bound_tps"] <= row["feasible_offered_tps"] * (1 + 1e-9)
    assert row["tighter_bound_tps"] <= cb.prefill_tps_within_slo
    assert sum(row[f"missed_{c}_tps"] for c in CAUSES) == pytest.approx(row["missed_tps"])
    assert row["missed_tps"] == pytest.approx(row["prefill_tps"] - got)


def test_oracle_is_achievable_and_never_above_the_bound():
    from stack.sim.oracle import oracle_schedule

    cost = CostModel(c_linear=0.3 / L, c_attn=0.0, c_fwd=0.0)
    slo = SLO(b=1.0, a=0.0)
    # a burst of 10 on one instance: 3 whole requests fit in the first second
    burst = [(i, 0.0, 0.0, 0.0, 0, L, L, 5.0, 0.0) for i in range(10)]
    o = oracle_schedule(burst, cost, L, 1e6, slo, 1)
    assert o["met_tokens"] == 3 * L and o["tokens"] == 10 * L
    assert o["met_tokens"] <= window_bound(burst, cost, L, slo, 1, lengths=(1.0,))["tokens"]
    # two instances: 6 fit
    assert oracle_schedule(burst, cost, L, 1e6, slo, 2)["met_tokens"] == 6 * L
    # a hopeless request (own compute over its SLO) delays one that can make it by one
    # forward at most: the next one is the feasible request's
    big = CostModel(c_linear=2.0 / L, c_attn=0.0, c_fwd=0.0)
    recs = [(0, 0.0, 0.0, 0.0, 0, L, L, 5.0, 0.0), (1, 0.01, 0.0, 0.0, 0, L // 10, L, 5.0, 0.0)]
    o = oracle_schedule(recs, big, L // 10, 1e6, slo, 1)
    assert o["met_requests"] == 1 and o["met_tokens"] == L
