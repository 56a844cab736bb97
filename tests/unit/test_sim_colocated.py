"""PD colocation in the simulator: decode cost, conservation, TPOT and SLO accounting, KV
room, aggregated decode against step-by-step, decode-aware SMetric, dispatch."""

from __future__ import annotations

import math
import random

import pytest

from stack.core.cost_model import CostModel, DecodeCost, Hardware, load_hardware
from stack.core.types import SLO, ClusterView, DecisionKind, InstanceState, Request
from stack.dispatch import SIM_DISPATCH
from stack.paths import default_trace
from stack.policies import PolicyContext, make_policy
from stack.sim.colocated import ColocatedScheduler, interval_seconds, steps_within
from stack.sim.engine import GlobalTierSpec, SimConfig, Simulator, make_simulator
from stack.sim.load import LoadSpec
from stack.sim.scheduler import PDScheduler
from stack.traces.load import load_trace
from support.traces import agentic_record, write_jsonl

COST = CostModel(c_linear=1e-4, c_attn=1e-9, c_fwd=0.01)
DEC = DecodeCost(d_fwd=0.002, d_experts=0.01, expert_share=0.0625, d_ctx=1e-7)


def hw(hbm=1_000_000, chunk=8192) -> Hardware:
    return Hardware(
        name="test", cost=COST, hbm_kv_tokens=hbm, chunk_tokens=chunk, kv_bytes_per_token=1000,
        gpus_per_server=2, nic_gbps=8.0, link_efficiency=1.0, decode=DEC,
    )  # fmt: skip


def compress() -> LoadSpec:
    return LoadSpec(mode="compress", rate_scale=1.0, warmup=0.0, measure_until=math.inf)


def run(trace, policy="round-robin", instances=1, hardware=None, slo=None, steps="aggregate", **kw):
    cfg = SimConfig(
        instances=instances,
        hardware=hardware or hw(),
        global_tier=GlobalTierSpec.parse("full"),
        slo=slo or SLO(),
        mode="colocated",
        decode_steps=steps,
        **kw,
    )
    sim = Simulator(trace, policy, cfg, compress())
    sim.scheduler.keep_requests = True
    return sim, sim.run()


def records(tmp_path, recs, name="t.jsonl"):
    return load_trace(write_jsonl(tmp_path / name, recs))


# ------------------------------------------------------------------ the decode term
def test_h20_decode_term_is_calibrated_and_grows_with_batch_and_context():
    d = load_hardware("h20").decode
    assert (d.d_fwd, d.d_experts, d.expert_share, d.d_ctx) == (2.1e-3, 0.018, 0.0625, 3.48e-8)
    assert d.step(0, 0) == 0.0
    assert d.step(1, 100_000) < d.step(2, 100_000) < d.step(2, 200_000)
    # all experts read: the batch term saturates at d_experts
    assert d.step(512, 0) == pytest.approx(d.d_fwd + d.d_experts, rel=1e-6)
    # a mixed forward adds only the decodes' attention and their tokens' linear cost
    assert d.mixed_extra(3, 1000, 4.4e-5) == pytest.approx(3 * 4.4e-5 + 1000 * d.d_ctx)
    # h200: the other calibration has its own (faster) decode
    assert load_hardware("h200").decode.step(4, 100_000) < d.step(4, 100_000)


def test_interval_is_the_sum_of_its_steps_and_steps_within_inverts_it():
    rng = random.Random(3)
    for _ in range(200):
        base, d_ctx = rng.uniform(1e-3, 3e-2), rng.uniform(0, 1e-7)
        C, B, k = rng.randint(0, 500_000), rng.randint(1, 64), rng.randint(1, 400)
        steps = [base + d_ctx * (C + i * B) for i in range(k)]
        assert interval_seconds(k, base, d_ctx, C, B) == pytest.approx(sum(steps), rel=1e-9)
        j = rng.randint(0, k - 1)
        tau = sum(steps[:j]) + rng.random() * steps[j] * 0.999
        assert steps_within(tau, base, d_ctx, C, B) == j


# ------------------------------------------------------------------ one instance, by hand
def test_one_request_ttft_then_one_token_per_decode_forward(tmp_path):
    t = records(tmp_path, [agentic_record(0, 1, 0.0, 50, output=5)])
    sim, res = run(t)
    L = 50 * 64
    ttft = COST.cost(L, L)
    # four more forwards, each one decode step over the context so far (L + tokens out)
    steps = [DEC.step(1, L + 1 + i) for i in range(4)]
    (_, inst, arr, first, fin, n, tpot, measured) = res.per_request[0]
    assert first - arr == pytest.approx(ttft) and n == 5 and measured
    assert fin == pytest.approx(first + sum(steps))
    assert tpot == pytest.approx(sum(steps) / 4)
    m = res.metrics
    assert m["decode_tokens"] == 4 and m["decode_forwards"] == 4 and m["output_tokens"] == 5
    assert m["tpot_p50"] == pytest.approx(tpot)
    assert sim.insts[0].reserved == 0 and sim.insts[0].res_out == 0


def test_a_prefill_forward_carries_the_running_decodes(tmp_path):
    # B arrives while A decodes: B's prefill forward also yields one token of A and costs more
    L = 10 * 64
    recs = [agentic_record(0, 1, 0.0, 10, output=1000), agentic_record(1, 1, 0.2, 10, output=2)]
    sim, res = run(records(tmp_path, recs))
    by = {r[0]: r for r in res.per_request}
    a, b = by[0], by[1]
    # A's forwards: back to back from its first token; B's prefill starts at the end of the
    # decode step in progress at B's arrival (cut there), so it waits less than one step
    a_first = a[3]
    assert a_first < 0.2
    k = steps_within(0.2 - a_first, DEC.base(1), DEC.d_ctx, L + 1, 1)
    start = a_first + interval_seconds(k + 1, DEC.base(1), DEC.d_ctx, L + 1, 1)
    assert 0.2 <= start < 0.2 + DEC.step(1, L + 1 + k + 1)
    mixed = COST.cost(L, L) + DEC.mixed_extra(1, L + 1 + k + 1, COST.c_linear)
    assert b[3] == pytest.approx(start + mixed)
    assert a[5] == 1000 and b[5] == 2
    assert res.metrics["decode_tokens"] == 999 + 1


def test_kv_room_makes_a_request_wait_for_the_running_decode(tmp_path):
    # room 1200 tokens: A (640 + 300 out) runs; B (640 + 10) does not fit until A is done
    recs = [agentic_record(0, 1, 0.0, 10, output=300), agentic_record(1, 1, 0.01, 10, output=10)]
    _, res = run(records(tmp_path, recs), hardware=hw(hbm=1200))
    by = {r[0]: r for r in res.per_request}
    assert by[1][3] >= by[0][4]  # B's first token after A's last
    assert by[1][3] == pytest.approx(by[0][4] + COST.cost(640, 640))
    # with room for both B is served while A decodes
    _, res = run(records(tmp_path, recs), hardware=hw(hbm=3000))
    by = {r[0]: r for r in res.per_request}
    assert by[1][3] < by[0][4]


def test_tpot_slo_is_scored_with_the_ttft_slo(tmp_path):
    recs = [agentic_record(s, 1, 0.0, 10, output=50) for s in range(4)]
    t = records(tmp_path, recs)
    _, ok = run(t, slo=SLO(b=10.0, a=0.0, tpot=1.0))
    _, tight = run(t, slo=SLO(b=10.0, a=0.0, tpot=1e-4))
    _, late = run(t, slo=SLO(b=1e-4, a=0.0, tpot=1.0))
    for r in (ok, tight, late):
        assert r.metrics["output_tokens"] == 200
        assert r.metrics["output_tps"] == pytest.approx(200 / r.metrics["duration_s"])
    assert ok.metrics["tps_within_slo"] == pytest.approx(ok.metrics["output_tps"])
    assert ok.metrics["slo_attainment_both"] == 1.0 and ok.metrics["tpot_attainment"] == 1.0
    assert tight.metrics["tps_within_slo"] == 0.0 and tight.metrics["tpot_attainment"] == 0.0
    assert tight.metrics["over_2x_tpot"] == 1.0 and tight.metrics["slo_attainment"] == 1.0
    assert late.metrics["tps_within_slo"] == 0.0 and late.metrics["tpot_attainment"] == 1.0


# ------------------------------------------------------------------ the shipped slice
def _slice_run(policy, steps, instances=4, dispatch="immediate", dparams=None, rate=4.0):
    trace = load_trace(default_trace())
    cfg = SimConfig(
        instances=instances,
        mode="colocated",
        decode_steps=steps,
        dispatch=SIM_DISPATCH.updated(dispatch, dparams),
    )
    spec = LoadSpec(mode="sessions", rate_scale=rate, duration=1800.0, warmup=300.0, seed=2)
    sim = make_simulator(trace, policy, cfg, spec)
    assert isinstance(sim.scheduler, ColocatedScheduler)
    sim.scheduler.keep_requests = True
    return trace, sim, sim.run()


@pytest.mark.parametrize("policy", ["smetric", "lmetric", "dynamo"])
def test_every_output_token_is_decoded_once(policy):
    trace, sim, res = _slice_run(policy, "aggregate")
    m = res.metrics
    assert sim.tally.issued == sim.tally.served == len(res.per_request) > 0
    # each request leaves with its recorded output (at least the first token)
    out = {r.idx: max(1, r.output_len) for r in trace.requests}
    assert all(rec[5] == out[rec[0]] for rec in res.per_request)
    assert m["decode_tokens"] == sum(rec[5] - 1 for rec in res.per_request)
    assert all(not i.decs and i.reserved == 0 and i.res_out == 0 for i in sim.insts)
    assert m["tps_within_slo"] <= m["output_tps"] + 1e-9
    assert 0.0 <= m["slo_attainment_both"] <= m["slo_attainment"] <= 1.0
    assert m["decode_events"] < m["decode_forwards"] / 20  # aggregated
    assert m["tpot_p50"] <= m["tpot_p90"] <= m["tpot_p99"]


def test_tpot_is_measured_from_the_forwards_that_carried_the_request():
    # step by step (one event per forward), recording every forward
    trace = load_trace(default_trace())
    cfg = SimConfig(instances=2, mode="colocated", decode_steps="step")
    spec = LoadSpec(mode="sessions", rate_scale=2.0, duration=1800.0, warmup=300.0, seed=2)
    sim = Simulator(trace, "smetric", cfg, spec)
    sim.scheduler.keep_requests = True
    sim.scheduler.record_forwards = []
    res = sim.run()
    fwd: dict[int, list[tuple[float, float]]] = {}
    for inst, start, end, k, _ in sim.scheduler.record_forwards:
        assert k == 1
        fwd.setdefault(inst, []).append((start, end))
    checked = 0
    for _, inst, _, first, fin, n, tpot, _ in res.per_request[:300]:
        if n < 2:
            continue
        carried = [(s, e) for s, e in fwd[inst] if s >= first - 1e-12 and e <= fin + 1e-12]
        assert len(carried) == n - 1
        assert sum(e - s for s, e in carried) == pytest.approx(fin - first, rel=1e-9)
        assert tpot == pytest.approx(sum(e - s for s, e in carried) / (n - 1), rel=1e-9)
        checked += 1
    assert checked > 20


def test_aggregated_decode_agrees_with_step_by_step():
    _, agg, ra = _slice_run("smetric", "aggregate", rate=3.0)
    _, stp, rs = _slice_run("smetric", "step", rate=3.0)
    assert len(ra.per_request) == len(rs.per_request)
    for a, s in zip(sorted(ra.per_request), sorted(rs.per_request)):
        assert a[:2] == s[:2] and a[5] == s[5]
        for x, y in zip(a[2:5], s[2:5]):
            assert x == pytest.approx(y, rel=1e-9, abs=1e-9)
    ma, ms = ra.metrics, rs.metrics
    for key in ("tps_within_slo", "ttft_p50", "ttft_p99", "tpot_p90", "decode_forwards", "migrations"):
        assert ma[key] == pytest.approx(ms[key], rel=1e-9), key
    assert ms["decode_events"] == ms["decode_forwards"]
    assert ma["decode_events"] * 20 < ms["decode_events"]


@pytest.mark.parametrize(
    "dispatch,params", [("immediate", {}), ("deadline-defer", {"max_queued_s": 2.0}), ("fifo", {})]
)
def test_dispatch_orders_run_colocated(dispatch, params):
    _, sim, res = _slice_run("smetric", "aggregate", dispatch=dispatch, dparams=params)
    m = res.metrics
    assert sim.tally.issued == sim.tally.served + sim.tally.rejected and m["requests"] > 0
    assert m["dispatch"].startswith(dispatch) and m["mode"] == "colocated"


def test_pd_mode_is_the_pd_simulator():
    trace = load_trace(default_trace())
    spec = LoadSpec(mode="sessions", rate_scale=2.0, duration=1800.0, warmup=300.0, seed=2)
    sim = make_simulator(trace, "smetric", SimConfig(instances=4), spec)
    assert isinstance(sim.scheduler, PDScheduler)
    assert "tps_within_slo" not in sim.run().metrics
    with pytest.raises(ValueError, match="mode"):
        SimConfig(mode="both").validate()
    with pytest.raises(ValueError, match="decode_steps"):
        SimConfig(decode_steps="each").validate()


# ------------------------------------------------------------------ decode-aware SMetric
def _view(decode_step_s: float) -> ClusterView:
    L = 100_000
    slo = SLO().ttft(L)
    own = load_hardware("h20").cost.cost(L - 96_000, L)
    insts = [
        InstanceState(0, queued_seconds=0.5),
        # the session's instance: just on time without its decodes
        InstanceState(
            1, queued_tokens=60_000, queued_seconds=slo - own - 0.03, local_hit=96_000,
            running=3, decode_running=2, decode_step_s=decode_step_s,
        ),
        InstanceState(2, queued_seconds=0.2),
    ]  # fmt: skip
    return ClusterView(now=0.0, instances=insts, global_hit=96_000, fetch_tokens_per_s=200_000.0)


def test_an_instance_s_decode_load_makes_smetric_migrate():
    h = load_hardware("h20")
    req = Request(prompt_tokens=100_000, turn=5, est_hit=96_000)
    pd = PolicyContext(cost=h.cost, slo=SLO(), chunk_tokens=8192)
    co = PolicyContext(cost=h.cost, slo=SLO(), chunk_tokens=8192, colocated=True)
    # 7 ms of decode attention per forward (two decodes over ~200k tokens of context) on
    # each of the 8 forwards its queue and its own prefill take: past the deadline
    step = h.decode.mixed_extra(2, 200_000, h.cost.c_linear)
    for name in ("smetric-global", "smetric-global-b"):
        d = make_policy(name, co).choose(req, _view(step))
        assert d.kind is DecisionKind.MIGRATE and d.instance != 1, name
        # the same load read under PD (no decode on prefill instances), or no decode: stick
        assert make_policy(name, pd).choose(req, _view(step)).kind is DecisionKind.STICK
        assert make_policy(name, co).choose(req, _view(0.0)).kind is DecisionKind.STICK


def test_decode_load_in_the_simulator_makes_smetric_migrate_a_follow_up(tmp_path):
    # session 0's first turn on instance 0; session 1 (a long answer) then lands there too
    # (both idle: ties go to the first); session 0's follow-up finds instance 0 decoding:
    # 0.13 s of decode attention per forward pushes it past its 0.1 s deadline there
    big = DecodeCost(d_fwd=0.002, d_experts=0.01, expert_share=0.0625, d_ctx=1e-3)
    hard = Hardware(
        name="t", cost=COST, hbm_kv_tokens=1_000_000, chunk_tokens=8192, kv_bytes_per_token=1000,
        nic_gbps=8.0, link_efficiency=1.0, decode=big,
    )  # fmt: skip
    a1 = agentic_record(0, 1, 0.0, 10, output=1)  # answered with its first token
    a2 = agentic_record(0, 2, 2.0, 20, output=5, t_in_session=2.0)
    b = agentic_record(1, 1, 1.0, 2, output=2000, start_id=1_000)
    slo = SLO(b=0.1, a=0.0)
    _, res = run(records(tmp_path, [a1, b, a2], "busy.jsonl"), "smetric", 2, hard, slo)
    by = {r[0]: r for r in res.per_request}
    assert by[0][1] == 0 and by[1][1] == 0  # first turns on instance 0
    assert by[2][1] == 1 and res.metrics["migrations"] == 1  # the follow-up migrated
    # without the long decode the follow-up sticks with its session
    _, res = run(records(tmp_path, [a1, a2], "idle.jsonl"), "smetric", 2, hard, slo)
    assert res.metrics["migrations"] == 0 and res.metrics["sticks"] == 1
    assert {r[0]: r[1] for r in res.per_request}[1] == 0
