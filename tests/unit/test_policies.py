"""Each policy's decision pinned on small hand-built clusters."""

from __future__ import annotations

import math

import pytest

from stack.core.cost_model import CostModel
from stack.core.types import SLO, ClusterView, Decision, DecisionKind, InstanceState, Request
from stack.policies import POLICIES, NoInstanceError, PolicyContext, make_policy
from stack.policies.smetric import (
    GlobalTierTTFT,
    LeastLoaded,
    LoadMargin,
    LocalTTFT,
    NoMigration,
    OnTimeOrStay,
    SLODeadline,
    SMetric,
    TokenDeadline,
)

COST = CostModel(c_linear=4.4e-5, c_attn=6.0e-9, c_fwd=0.025)
CTX = PolicyContext(cost=COST, slo=SLO(b=1.0, a=62.5e-6), block_size=64)


def view(*insts: dict, global_hit: int = 0, fetch: float = 200_000.0) -> ClusterView:
    return ClusterView(
        now=0.0,
        instances=[InstanceState(index=i, **kw) for i, kw in enumerate(insts)],
        global_hit=global_hit,
        fetch_tokens_per_s=fetch,
    )


def follow_up(L: int = 100_000, est_hit: int = 96_000) -> Request:
    return Request(prompt_tokens=L, turn=5, est_hit=est_hit, session_id="s1")


# --------------------------------------------------------------------------- SMetric
def test_smetric_sticks_when_sticky_instance_meets_slo():
    p = make_policy("smetric", CTX)
    v = view(
        {"queued_seconds": 0.0},
        {"local_hit": 96_000, "queued_seconds": 1.0, "running": 1},  # sticky, busy but on time
        {"queued_seconds": 0.0},
    )
    d = p.choose(follow_up(), v)
    assert d.instance == 1
    assert d.kind is DecisionKind.STICK


def test_smetric_migrates_when_sticky_instance_would_miss_slo():
    p = make_policy("smetric", CTX)
    slo = CTX.slo.ttft(100_000)  # 7.25 s
    # Faithful SMetric counts only local hits: elsewhere the 100k prompt is a full recompute
    # (~35 s on H20), so a sticky instance just over the deadline is still the least loaded.
    v = view(
        {"queued_seconds": 0.5},
        {"local_hit": 96_000, "queued_seconds": slo + 1.0, "running": 3},
        {"queued_seconds": 0.2},
    )
    d = p.choose(follow_up(), v)
    assert d.instance == 1 and d.kind is DecisionKind.STICK
    # once the sticky instance's queue outweighs a recompute, the session migrates
    v.instances[1].queued_seconds = 60.0
    d = p.choose(follow_up(), v)
    assert d.kind is DecisionKind.MIGRATE
    # least loaded, KV-aware: instance 2 has the smallest queue + own cost
    assert d.instance == 2


def test_smetric_when_no_instance_meets_slo_adds_least_new_work():
    slo = CTX.slo.ttft(100_000)
    v = view(
        {"queued_seconds": slo * 3},
        {"local_hit": 96_000, "queued_seconds": slo * 2, "running": 3},
        {"queued_seconds": slo * 4},
    )
    # reading A: the KV-aware least-loaded instance; here the sticky one (its hit saves ~40 s)
    a = make_policy("smetric", CTX).choose(follow_up(), v)
    assert a.instance == 1
    # reading B: stay on the highest hit when nobody meets the deadline
    v2 = view(
        {"queued_seconds": slo * 1.0},
        {"local_hit": 96_000, "queued_seconds": slo * 60, "running": 3},
    )
    b = make_policy("smetric-b", CTX).choose(follow_up(), v2)
    assert b.instance == 1 and b.kind is DecisionKind.STICK
    # while reading A moves it to the instance with the least total work
    a2 = make_policy("smetric", CTX).choose(follow_up(), v2)
    assert a2.instance == 0 and a2.kind is DecisionKind.MIGRATE


def test_smetric_first_turn_balances_kv_aware():
    p = make_policy("smetric", CTX)
    first = Request(prompt_tokens=20_000, turn=1, est_hit=0)
    # instance 2 caches the system prompt: same queue, less work -> preferred
    v = view({"queued_seconds": 0.3}, {"queued_seconds": 0.3}, {"queued_seconds": 0.3, "local_hit": 15_000})
    d = p.choose(first, v)
    assert d.instance == 2 and d.kind is DecisionKind.FIRST_TURN
    # but load wins over a small hit
    v = view({"queued_seconds": 0.0}, {"queued_seconds": 5.0, "local_hit": 15_000})
    assert p.choose(first, v).instance == 0


def test_smetric_evicted_session_is_treated_as_first_turn():
    p = make_policy("smetric", CTX)
    # the best local hit is far below what the session should have cached
    v = view({"queued_seconds": 2.0, "local_hit": 10_000}, {"queued_seconds": 0.0})
    d = p.choose(follow_up(est_hit=96_000), v)
    assert d.kind is DecisionKind.FIRST_TURN
    assert d.instance == 1


def test_smetric_slack_extremes():
    slo = CTX.slo.ttft(100_000)
    # SLACK = 0: stickiness is off, every follow-up is placed by KV-aware least load
    v = view({"queued_seconds": 0.0}, {"local_hit": 96_000, "queued_seconds": 40.0})
    d = make_policy("smetric", CTX, slack=0.0).choose(follow_up(), v)
    assert d.instance == 0 and d.kind is DecisionKind.MIGRATE
    v = view({"queued_seconds": 0.0}, {"local_hit": 96_000, "queued_seconds": slo * 0.1})
    assert make_policy("smetric", CTX).choose(follow_up(), v).kind is DecisionKind.STICK
    # SLACK = inf: the SLO is ignored
    v = view({"queued_seconds": 0.0}, {"local_hit": 96_000, "queued_seconds": slo * 50})
    d = make_policy("smetric", CTX, slack=math.inf).choose(follow_up(), v)
    assert d.instance == 1 and d.kind is DecisionKind.STICK


def test_smetric_basic_never_migrates():
    v = view({"queued_seconds": 0.0}, {"local_hit": 96_000, "queued_seconds": 1e6})
    d = make_policy("smetric-basic", CTX).choose(follow_up(), v)
    assert d.instance == 1 and d.kind is DecisionKind.STICK


def test_smetric_load_threshold_migration():
    p = make_policy("smetric-load", CTX, load_margin=0.5)
    # sticky instance holds 3x the mean queued tokens -> leaves
    v = view(
        {"queued_tokens": 0},
        {"local_hit": 96_000, "queued_tokens": 90_000, "queued_seconds": 60.0},
        {"queued_tokens": 0},
    )
    assert p.choose(follow_up(), v).kind is DecisionKind.MIGRATE
    v = view(
        {"queued_tokens": 40_000}, {"local_hit": 96_000, "queued_tokens": 50_000}, {"queued_tokens": 40_000}
    )
    assert p.choose(follow_up(), v).kind is DecisionKind.STICK


def test_smetric_tokens_uses_token_counts():
    p = make_policy("smetric-tokens", CTX)
    # a queue of 50k tokens ~ 2.2 s at the linear rate: within 7.25 s -> stick, although the
    # cost model with attention would say otherwise for a 100k-context queue
    v = view({"queued_tokens": 0}, {"local_hit": 96_000, "queued_tokens": 50_000, "queued_seconds": 40.0})
    assert p.choose(follow_up(), v).kind is DecisionKind.STICK
    assert make_policy("smetric", CTX).choose(follow_up(), v).kind is DecisionKind.MIGRATE


def test_smetric_global_counts_global_hits_and_fetch_time():
    # Without global awareness, instance 0 looks ~40 s costlier (full recompute); with it,
    # the fetch (96k tokens at 200k tok/s ~0.5 s) is what it costs.
    slo = CTX.slo.ttft(100_000)
    v = view({"queued_seconds": 0.0}, {"local_hit": 96_000, "queued_seconds": slo + 0.5}, global_hit=96_000)
    faithful = make_policy("smetric", CTX).choose(follow_up(), v)
    glob = make_policy("smetric-global", CTX).choose(follow_up(), v)
    assert faithful.instance == 1  # recompute elsewhere looks worse than the overloaded sticky one
    assert glob.instance == 0 and glob.kind is DecisionKind.MIGRATE


# ------------------------------------------------------- SMetric's parts, one at a time
class _FixedTTFT:
    """A stub estimator: a fixed estimate per instance index (and a count of the calls)."""

    def __init__(self, by_index: dict[int, float]) -> None:
        self.by_index = by_index
        self.calls = 0

    def estimate(self, s: InstanceState, req: Request, view: ClusterView) -> float:
        self.calls += 1
        return self.by_index[s.index]


def test_smetric_local_ttft_is_queue_plus_own_prefill():
    est = LocalTTFT(COST)
    v = view({"queued_seconds": 2.0, "local_hit": 30_000}, global_hit=90_000)
    # the global hit is ignored: only the local 30k is reused
    assert est.estimate(v.instances[0], follow_up(), v) == 2.0 + COST.cost(70_000, 100_000)


def test_smetric_global_tier_ttft_counts_fetch_and_link_backlog():
    est = GlobalTierTTFT(COST)
    req = follow_up()
    # 60k tokens more in the global tier: fetched at 200k tok/s behind a 0.25 s backlog
    # (0.55 s), which overlaps with the 0.4 s queue; only the last 10k are computed
    v = view({"queued_seconds": 0.4, "local_hit": 30_000, "fetch_backlog_s": 0.25}, global_hit=90_000)
    fetch = 0.25 + 60_000 / 200_000.0
    assert est.estimate(v.instances[0], req, v) == max(0.4, fetch) + COST.cost(10_000, 100_000)
    # a queue longer than the fetch hides it
    v.instances[0].queued_seconds = 3.0
    assert est.estimate(v.instances[0], req, v) == 3.0 + COST.cost(10_000, 100_000)
    # no link (no global tier) or nothing more in it than locally: the local estimate
    for v in (
        view({"queued_seconds": 0.4, "local_hit": 30_000}, global_hit=90_000, fetch=0.0),
        view({"queued_seconds": 0.4, "local_hit": 30_000}, global_hit=20_000),
    ):
        assert est.estimate(v.instances[0], req, v) == LocalTTFT(COST).estimate(v.instances[0], req, v)


def test_smetric_global_avoids_a_busy_link():
    # two instances without the prefix; instance 0's link is 2 s behind: the global-aware
    # estimate places the first turn on instance 1, the local one cannot tell them apart
    first = Request(prompt_tokens=100_000, turn=1)
    v = view({"fetch_backlog_s": 2.0}, {"fetch_backlog_s": 0.0}, global_hit=90_000)
    assert make_policy("smetric-global", CTX).choose(first, v).instance == 1
    assert make_policy("smetric", CTX).choose(first, v).instance == 0


def test_smetric_slo_deadline_rule():
    slo = CTX.slo.ttft(100_000)
    v = view({}, {})
    req = follow_up()
    rule = SLODeadline(CTX.slo, 1.0, _FixedTTFT({0: slo, 1: slo + 1e-9}))
    assert rule.meets(v.instances[0], req, v, v.instances)  # on the deadline is on time
    assert not rule.meets(v.instances[1], req, v, v.instances)
    assert SLODeadline(CTX.slo, 2.0, _FixedTTFT({1: slo + 1e-9})).meets(v.instances[1], req, v, v.instances)
    # SLACK = inf: always on time, nothing estimated
    est = _FixedTTFT({})
    assert SLODeadline(CTX.slo, math.inf, est).meets(v.instances[0], req, v, v.instances)
    assert est.calls == 0


def test_smetric_token_deadline_rule():
    rule = TokenDeadline(CTX.slo, 1.0, COST)
    req = Request(prompt_tokens=10_000, turn=2, est_hit=8_000)
    slo = CTX.slo.ttft(10_000)  # 1.625 s
    # new work = queued + L - local hit, at the linear rate, plus one forward's overhead
    on_time = int((slo - COST.c_fwd) / COST.c_linear)  # tokens that fit in the deadline
    v = view(
        {"queued_tokens": on_time - 2_000, "local_hit": 8_000}, {"queued_tokens": on_time, "local_hit": 8_000}
    )
    assert rule.meets(v.instances[0], req, v, v.instances)
    assert not rule.meets(v.instances[1], req, v, v.instances)
    assert TokenDeadline(CTX.slo, math.inf, COST).meets(v.instances[1], req, v, v.instances)


def test_smetric_load_margin_and_no_migration_rules():
    # mean queued tokens 20k: a 50 % margin allows up to 30k
    v = view(
        {"queued_tokens": 30_000}, {"queued_tokens": 30_001}, {"queued_tokens": 0}, {"queued_tokens": 19_999}
    )
    rule = LoadMargin(0.5)
    assert [rule.meets(s, follow_up(), v, v.instances) for s in v.instances] == [True, False, True, True]
    assert all(NoMigration().meets(s, follow_up(), v, v.instances) for s in v.instances)


def test_smetric_fallbacks_reading_a_and_b():
    # mean queued tokens 60k, margin 20 %: the sticky instance 1 fails the load rule;
    # instance 0 has the smallest estimate but fails it too; instance 2 is on time
    v = view(
        {"queued_tokens": 90_000},
        {"queued_tokens": 90_000, "local_hit": 96_000},
        {"queued_tokens": 0},
    )
    est = _FixedTTFT({0: 1.0, 1: 5.0, 2: 3.0})
    best = v.instances[1]
    for fallback, want in ((LeastLoaded(), 0), (OnTimeOrStay(), 2)):
        p = SMetric(CTX, estimator=est, rule=LoadMargin(0.2), fallback=fallback)
        assert fallback.target(p, best, follow_up(), v, v.instances).index == want
        assert p.choose(follow_up(), v) == Decision(want, DecisionKind.MIGRATE)
    # nobody on time: reading B stays with the session (a stick), reading A still balances
    nobody = SMetric(CTX, estimator=est, rule=SLODeadline(CTX.slo, 0.0, est), fallback=OnTimeOrStay())
    assert nobody.choose(follow_up(), v) == Decision(1, DecisionKind.STICK)
    nobody_a = SMetric(CTX, estimator=est, rule=SLODeadline(CTX.slo, 0.0, est), fallback=LeastLoaded())
    assert nobody_a.choose(follow_up(), v) == Decision(0, DecisionKind.MIGRATE)


@pytest.mark.parametrize(
    ("name", "estimator", "rule", "fallback"),
    [
        ("smetric", LocalTTFT, SLODeadline, LeastLoaded),
        ("smetric-b", LocalTTFT, SLODeadline, OnTimeOrStay),
        ("smetric-basic", LocalTTFT, NoMigration, LeastLoaded),
        ("smetric-load", LocalTTFT, LoadMargin, LeastLoaded),
        ("smetric-tokens", LocalTTFT, TokenDeadline, LeastLoaded),
        ("smetric-global", GlobalTierTTFT, SLODeadline, LeastLoaded),
        ("smetric-global-b", GlobalTierTTFT, SLODeadline, OnTimeOrStay),
    ],
)
def test_smetric_variants_compose_their_parts(name, estimator, rule, fallback):
    p = make_policy(name, CTX)
    assert p.name == name
    assert (type(p.estimator), type(p.rule), type(p.fallback)) == (estimator, rule, fallback)
    # the SLO rule judges by the variant's own estimate (global-aware for -global)
    if isinstance(p.rule, SLODeadline):
        slo = CTX.slo.ttft(100_000)
        v = view({"queued_seconds": slo - 3.0}, {"queued_seconds": slo - 2.0}, global_hit=96_000)
        for s in v.instances:
            on_time = p.estimator.estimate(s, follow_up(), v) <= slo
            assert p.rule.meets(s, follow_up(), v, v.instances) is on_time


def test_smetric_params_retune_and_swap_parts():
    p = make_policy("smetric", CTX, slack=1.5, hit_ratio=0.9, fallback="stay")
    assert (p.rule.slack, p.hit_ratio, type(p.fallback)) == (1.5, 0.9, OnTimeOrStay)
    p = make_policy("smetric-load", CTX, load_margin=1.0)
    assert p.rule.margin == 1.0
    p = make_policy("smetric", CTX, migration="tokens", count_global=True)
    assert (type(p.estimator), type(p.rule)) == (GlobalTierTTFT, TokenDeadline)
    for bad in ({"fallback": "nope"}, {"migration": "nope"}, {"slack": -1.0}, {"estimator": LocalTTFT(COST)}):
        with pytest.raises(ValueError):
            make_policy("smetric", CTX, **bad)


def test_smetric_default_parts_are_the_faithful_variant():
    p = SMetric(CTX)
    assert (type(p.estimator), type(p.rule), type(p.fallback)) == (LocalTTFT, SLODeadline, LeastLoaded)
    assert p.rule.slack == 1.0 and p.hit_ratio == 0.8
    v = view({"queued_seconds": 0.0}, {"local_hit": 96_000, "queued_seconds": 60.0}, {"queued_seconds": 0.2})
    assert p.choose(follow_up(), v) == make_policy("smetric", CTX).choose(follow_up(), v)


# --------------------------------------------------------------------------- baselines
def test_lmetric_multiplies_work_and_batch():
    p = make_policy("lmetric", CTX)
    # (q + L - c) * (l + 1): inst0 (0 + 10k) * 3 = 30k; inst1 (5k + 10k - 8k) * 1 = 7k
    v = view({"running": 2}, {"queued_tokens": 5_000, "local_hit": 8_000})
    assert p.choose(Request(10_000), v).instance == 1
    v = view({"running": 0}, {"queued_tokens": 5_000, "local_hit": 8_000, "running": 1})
    # inst0: 10k * 1 = 10k ; inst1: 7k * 2 = 14k
    assert p.choose(Request(10_000), v).instance == 0


def test_linear_prefers_cache_with_large_lambda():
    p = make_policy("linear", CTX)  # lambda 0.9
    v = view({"running": 0}, {"running": 4, "local_hit": 9_000})
    assert p.choose(Request(10_000), v).instance == 1
    p0 = make_policy("linear", CTX, lam=0.0)  # pure load
    assert p0.choose(Request(10_000), v).instance == 0


def test_least_load_ignores_cache():
    p = make_policy("least-load", CTX)
    v = view(
        {"queued_tokens": 10}, {"queued_tokens": 0, "local_hit": 0}, {"queued_tokens": 5, "local_hit": 9_000}
    )
    assert p.choose(Request(10_000), v).instance == 1


def test_dynamo_counts_new_blocks_including_queued():
    p = make_policy("dynamo", CTX)
    # inst0: (0 + 10k)/64 ; inst1: (3k + 10k - 9k)/64 -> inst1
    v = view({}, {"queued_tokens": 3_000, "local_hit": 9_000})
    assert p.choose(Request(10_000), v).instance == 1
    v = view({}, {"queued_tokens": 30_000, "local_hit": 9_000})
    assert p.choose(Request(10_000), v).instance == 0


def test_preble_prefix_then_load_filter():
    p = make_policy("preble", CTX)
    # match ratio > 0.5 -> the least-loaded instance holding the longest match
    v = view({"running": 0}, {"running": 2, "local_hit": 8_000}, {"running": 1, "local_hit": 8_000})
    assert p.choose(Request(10_000), v).instance == 2
    # running spread > 8 -> only the least loaded are candidates, whatever their cache
    v = view({"running": 0}, {"running": 10, "local_hit": 8_000})
    assert p.choose(Request(10_000), v).instance == 0
    # low match -> least estimated work
    v = view({"queued_seconds": 3.0}, {"queued_seconds": 1.0, "local_hit": 1_000})
    assert p.choose(Request(10_000), v).instance == 1


def test_session_affinity_needs_and_uses_session_id():
    p = make_policy("session", CTX)
    assert p.needs_session_id
    v = view({"queued_tokens": 5}, {"queued_tokens": 0})
    first = p.choose(Request(1_000, turn=1, session_id="a"), v)
    assert first.instance == 1 and first.kind is DecisionKind.FIRST_TURN
    # the session sticks even when its instance became the busier one
    v = view({"queued_tokens": 0}, {"queued_tokens": 50_000})
    again = p.choose(Request(2_000, turn=2, session_id="a"), v)
    assert again.instance == 1 and again.kind is DecisionKind.STICK
    # its instance left: the session moves
    v.instances[1].healthy = False
    moved = p.choose(Request(3_000, turn=3, session_id="a"), v)
    assert moved.instance == 0 and moved.kind is DecisionKind.MIGRATE


def test_slo_predictor_packs_into_least_positive_headroom():
    p = make_policy("slo-predictor", CTX)
    slo = CTX.slo.ttft(10_000)  # 1.625 s
    v = view({"queued_seconds": 0.0}, {"queued_seconds": slo - 0.8}, {"queued_seconds": slo + 5})
    # instance 1 meets the SLO with the least headroom; instance 2 does not meet it
    assert p.choose(Request(10_000), v).instance == 1
    # none meets: smallest predicted TTFT
    v = view({"queued_seconds": slo + 3}, {"queued_seconds": slo + 1})
    assert p.choose(Request(10_000), v).instance == 1


def test_slo_predictor_learns_from_observations():
    p = make_policy("slo-predictor", CTX)
    x = [1.0, 0.5, 2.0, 1.0]
    before = float(p.w @ x)
    for _ in range(50):
        p.observe(Request(1), 0, x, ttft=10.0)
    assert abs(float(p.w @ x) - 10.0) < abs(before - 10.0)


def test_round_robin_cycles_over_healthy():
    p = make_policy("round-robin", CTX)
    v = view({}, {}, {})
    v.instances[1].healthy = False
    assert [p.choose(Request(1), v).instance for _ in range(4)] == [0, 2, 0, 2]


def test_random_is_seeded_and_spreads_over_healthy():
    v = view({}, {}, {})
    v.instances[1].healthy = False
    picks = [make_policy("random", CTX, seed=7).choose(Request(1), v).instance for _ in range(1)]
    a = make_policy("random", CTX, seed=7)
    b = make_policy("random", CTX, seed=7)
    seq = [a.choose(Request(1), v).instance for _ in range(200)]
    assert seq == [b.choose(Request(1), v).instance for _ in range(200)]
    assert set(seq) == {0, 2} and 60 < seq.count(0) < 140 and picks[0] == seq[0]


@pytest.mark.parametrize("name", POLICIES)
def test_every_policy_routes_to_a_healthy_instance(name):
    p = make_policy(name, CTX)
    v = view({"queued_tokens": 100, "running": 1}, {"local_hit": 500}, {"queued_seconds": 1.0})
    v.instances[1].healthy = False
    for turn in (1, 2):
        d = p.choose(Request(1_000, turn=turn, est_hit=500, session_id="x"), v)
        assert d.instance in (0, 2)


@pytest.mark.parametrize("name", POLICIES)
def test_no_healthy_instance_raises(name):
    p = make_policy(name, CTX)
    v = view({})
    v.instances[0].healthy = False
    with pytest.raises(NoInstanceError):
        p.choose(Request(100), v)


def test_unknown_policy_and_bad_params():
    with pytest.raises(ValueError, match="unknown policy"):
        make_policy("nope", CTX)
    with pytest.raises(ValueError):
        make_policy("smetric", CTX, hit_ratio=1.5)
    with pytest.raises(ValueError):
        make_policy("linear", CTX, lam=2)


def test_policies_import_no_io_frameworks():
    import subprocess
    import sys

    code = (
        "import sys, stack.policies, stack.core.cost_model, stack.sim.engine;"
        "bad=[m for m in ('fastapi','zmq','redis','mooncake','httpx','uvicorn') if m in sys.modules];"
        "print(bad); sys.exit(1 if bad else 0)"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


# --- llm-d's agentic prefill rule (affinity filter + token-load scorer) ---------------------


def _llmd(**kw):
    return make_policy("llm-d-agentic", CTX, **kw)


def test_llmd_peak_throughput_is_one_unloaded_8k_chunk():
    from stack.policies.llmd import peak_prefill_tps

    p = _llmd()
    assert p.peak_tps == pytest.approx(8192 / CTX.cost.cost(8192, 8192))
    assert p.peak_tps == peak_prefill_tps(CTX)


def test_llmd_keeps_the_holder_while_its_penalty_is_small():
    p = _llmd()
    L = 64 * 100
    # instance 1 holds 90% of the blocks but has more in flight than instance 0 (within 18 s)
    v = view({"queued_tokens": 0}, {"queued_tokens": 50_000, "local_hit": 90 * 64})
    d = p.choose(Request(L, turn=2, est_hit=L // 2), v)
    assert d.instance == 1 and d.kind == DecisionKind.STICK


def test_llmd_breaks_stickiness_past_the_maximum_penalty():
    p = _llmd()
    L = 64 * 100
    over = int(p.peak_tps * 18.0) + 64 * 1000  # the holder's queue costs more than 18 s extra
    v = view({"queued_tokens": 0}, {"queued_tokens": over, "local_hit": 90 * 64})
    d = p.choose(Request(L, turn=2, est_hit=L // 2), v)
    assert d.instance == 0 and d.kind == DecisionKind.MIGRATE


def test_llmd_below_the_affinity_threshold_is_pure_token_load():
    p = _llmd()
    L = 64 * 100
    # 70% < 80%: no holder; the scorer counts this request's uncached tokens
    v = view({"queued_tokens": 3000}, {"queued_tokens": 4000, "local_hit": 70 * 64})
    # instance 0: 3000 + 6400 = 9400; instance 1: 4000 + 1920 = 5920
    assert p.choose(Request(L, turn=2), v).instance == 1


def test_llmd_ties_are_random_but_seeded():
    picks = {_llmd(seed=s).choose(Request(640), view({}, {}, {}, {})).instance for s in range(20)}
    assert len(picks) > 1
    a = [_llmd(seed=3).choose(Request(640), view({}, {}, {}, {})).instance for _ in range(5)]
    b = [_llmd(seed=3).choose(Request(640), view({}, {}, {}, {})).instance for _ in range(5)]
    assert a == b


def test_lmetric_is_the_reference_product_rule():
    # (q + L - c) * (l + 1): 0: (0+6400)*1 = 6400; 1: (1000+6400-6336)*3 = 3192; 2: (0+6400)*(0+1) tie -> 0
    v = view({"queued_tokens": 0}, {"queued_tokens": 1000, "running": 2, "local_hit": 99 * 64}, {})
    assert make_policy("lmetric", CTX).choose(Request(6400, turn=2), v).instance == 1
    v = view({"queued_tokens": 100}, {"queued_tokens": 100})
    assert make_policy("lmetric", CTX).choose(Request(640), v).instance == 0  # first minimum


# --- the reference Bailian scheduler (weighted random over normalised terms) ----------------


def test_bailian_weights_follow_the_reference_formula():
    p = make_policy("bailian", CTX)
    v = view(
        {"local_hit": 0, "running": 4, "active_tokens": 40_000},
        {"local_hit": 6_000, "running": 0, "active_tokens": 0},
        {"local_hit": 3_000, "running": 2, "active_tokens": 20_000},
    )
    ps = p.weights(Request(6_400, turn=2), v.instances)
    # 0: worst on every term -> 0; 1: best on all -> 0.7+0.15+0.15; 2: halfway on all
    assert ps == pytest.approx([0.0, 1.0, 0.5])


def test_bailian_draws_in_proportion_and_falls_back_to_the_first():
    v = view(
        {"local_hit": 0, "running": 1}, {"local_hit": 6_000, "running": 1}, {"local_hit": 3_000, "running": 1}
    )
    picks = [
        make_policy("bailian", CTX, seed=s).choose(Request(6_400, turn=2), v).instance for s in range(400)
    ]
    assert picks.count(0) == 0  # p = 0: never drawn
    assert 2.0 * 0.75 < picks.count(1) / max(1, picks.count(2)) < 2.0 * 1.33  # 0.7 vs 0.35
    same = view({}, {}, {})  # identical instances: every p is 0 -> the first one, as there
    assert make_policy("bailian", CTX).choose(Request(640), same).instance == 0
