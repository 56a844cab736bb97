"""The simulator: conservation, SLO accounting, chunked prefill, tiers, links, causality."""

from __future__ import annotations

import math

import pytest

from stack.core.cost_model import CostModel, Hardware
from stack.core.types import SLO
from stack.paths import default_trace
from stack.policies import POLICIES
from stack.sim.engine import GlobalTierSpec, SimConfig, Simulator
from stack.sim.instance import Link
from stack.sim.load import LoadSpec
from stack.traces.load import load_trace
from support.traces import agentic_record, write_jsonl

COST = CostModel(c_linear=1e-4, c_attn=1e-9, c_fwd=0.01)


def hw(hbm=1_000_000, chunk=8192, tpot=0.0, bw_gbps=8.0, kv_bytes=1000) -> Hardware:
    # link: 8 Gbps * 1.0 efficiency / 1000 B per token = 1M tokens/s
    return Hardware(
        name="test", cost=COST, hbm_kv_tokens=hbm, chunk_tokens=chunk, kv_bytes_per_token=kv_bytes,
        gpus_per_server=2, nic_gbps=bw_gbps, link_efficiency=1.0, decode_tpot_s=tpot,
    )  # fmt: skip


def run(trace, policy="round-robin", instances=1, gt="full", link="per-gpu", hardware=None, slo=None, **load):
    cfg = SimConfig(
        instances=instances,
        hardware=hardware or hw(),
        global_tier=GlobalTierSpec.parse(gt),
        link=link,
        slo=slo or SLO(),
    )
    spec = LoadSpec(mode="compress", rate_scale=1.0, warmup=0.0, measure_until=math.inf, **load)
    sim = Simulator(trace, policy, cfg, spec)
    res = sim.run()
    return sim, res


def one_session(tmp_path, turns=2, blocks=100, growth=10, think=1.0, output=10):
    recs = [
        agentic_record(
            0,
            k + 1,
            5.0 * k,
            blocks + growth * k,
            t_in_session=5.0 * k,
            think=think if k else 0.0,
            output=output,
        )
        for k in range(turns)
    ]
    return load_trace(write_jsonl(tmp_path / "s.jsonl", recs))


def test_single_request_ttft_is_the_cost_model(tmp_path):
    t = load_trace(write_jsonl(tmp_path / "a.jsonl", [agentic_record(0, 1, 0.0, 50)]))
    sim, res = run(t)
    L = 50 * 64
    assert res.ttfts == [pytest.approx(COST.cost(L - 0, L))]
    m = res.metrics
    assert m["requests"] == 1 and m["computed_tokens"] == L and m["reused_tokens"] == 0


def test_chunked_prefill_splits_a_long_prompt_into_forwards(tmp_path):
    blocks = 20_000 // 64  # 312 blocks = 19,968 tokens
    t = load_trace(write_jsonl(tmp_path / "a.jsonl", [agentic_record(0, 1, 0.0, blocks)]))
    _, res = run(t, hardware=hw(chunk=8192))
    L = blocks * 64
    n_fwd = math.ceil(L / 8192)
    # the same compute as one pass, plus one per-forward overhead per extra chunk
    assert res.ttfts[0] == pytest.approx(COST.cost(L, L) + (n_fwd - 1) * COST.c_fwd)


def test_small_requests_share_a_forward_and_wait_fcfs_behind_a_chunked_one(tmp_path):
    # the first starts alone on the idle instance; the two that arrive meanwhile share a forward
    recs = [agentic_record(s, 1, 0.0, 10) for s in range(3)]
    t = load_trace(write_jsonl(tmp_path / "a.jsonl", recs))
    _, res = run(t)
    L = 640
    one = COST.c_fwd + COST.chunk(L, L)
    both = one + COST.c_fwd + 2 * COST.chunk(L, L)
    assert res.ttfts == [pytest.approx(one), pytest.approx(both), pytest.approx(both)]
    # a long cold prompt first, a short one right behind: with a 1k budget the short one
    # only gets into the forward that finishes the long one
    recs = [agentic_record(0, 1, 0.0, 40), agentic_record(1, 1, 0.001, 4)]
    t = load_trace(write_jsonl(tmp_path / "b.jsonl", recs))
    _, res = run(t, hardware=hw(chunk=1024))
    long_done, short_done = res.ttfts[0], res.ttfts[1]
    assert short_done + 0.001 == pytest.approx(long_done, rel=1e-6)


def test_conservation_on_the_shipped_slice_for_every_policy():
    trace = load_trace(default_trace())
    for name in POLICIES:
        cfg = SimConfig(instances=8)
        spec = LoadSpec(mode="sessions", rate_scale=4.0, duration=3600.0, warmup=600.0, seed=1)
        sim = Simulator(trace, name, cfg, spec)
        m = sim.run().metrics
        assert sim.tally.issued == sim.tally.served > 0, name  # every request ends exactly once
        assert m["reused_tokens"] + m["computed_tokens"] == m["prompt_tokens"], name
        parts = m["sticks"] + m["migrations"] + m["first_turns"] + m["evicted_followups"] + m["balanced"]
        assert parts == m["requests"], name
        assert 0.0 <= m["slo_attainment"] <= 1.0
        assert m["prefill_tps_within_slo"] <= m["prefill_tps"] + 1e-9
        assert all(i.n_jobs == 0 and i.q_tokens == 0 for i in sim.insts), name


def test_slo_accounting_counts_prompt_tokens_of_requests_meeting_it(tmp_path):
    # two requests of 3,200 tokens: TTFT ~0.33 s alone; the SLO b=0.35 s lets only one in time
    recs = [agentic_record(s, 1, 0.0, 50) for s in range(2)]
    t = load_trace(write_jsonl(tmp_path / "a.jsonl", recs))
    _, res = run(t, hardware=hw(chunk=3200), slo=SLO(b=0.35, a=0.0))
    m = res.metrics
    assert m["requests"] == 2
    assert m["slo_attainment"] == 0.5
    assert m["prefill_tps_within_slo"] == pytest.approx(3200 / m["duration_s"])


def test_follow_up_waits_for_its_predecessor_answer_plus_think(tmp_path):
    t = one_session(tmp_path, turns=2, think=3.0, output=100)
    sim, res = run(t, hardware=hw(tpot=0.01))
    first = COST.cost(6400, 6400)
    # turn 2 arrives at max(recorded 5 s, answer) in compress mode; here recorded wins
    assert res.metrics["requests"] == 2
    assert sim.tally.served == 2
    # sessions mode: the follow-up arrives exactly answer + think after the first turn
    spec = LoadSpec(mode="sessions", session_rate=0.001, duration=10_000.0, warmup=0.0, seed=3)
    s2 = Simulator(t, "round-robin", SimConfig(instances=1, hardware=hw(tpot=0.01)), spec)
    arrivals = []
    orig = s2._arrive

    def spy(now, item):
        arrivals.append(now)
        orig(now, item)

    s2._arrive = spy
    s2.run()
    assert len(arrivals) >= 2
    assert arrivals[1] - arrivals[0] == pytest.approx(first + 100 * 0.01 + 3.0)


def test_sticky_follow_up_reuses_local_kv(tmp_path):
    t = one_session(tmp_path, turns=2, blocks=100, growth=10)
    _, res = run(t, policy="smetric", instances=4)
    m = res.metrics
    assert m["reuse_local"] > 0 and m["reuse_global"] == 0
    assert m["sticks"] == 1 and m["first_turns"] == 1
    assert m["reused_tokens"] == 100 * 64


def test_migrated_follow_up_fetches_from_global_tier_over_the_link(tmp_path):
    t = one_session(tmp_path, turns=2, blocks=100, growth=10)
    # round-robin on 2 instances sends turn 2 elsewhere: its prefix comes from the global tier
    sim, res = run(t, policy="round-robin", instances=2)
    m = res.metrics
    assert m["reuse_local"] == 0
    assert m["reused_tokens"] == 6400 and m["fetch_tokens"] == 6400
    L2 = 110 * 64
    fetch = 6400 / 1_000_000  # tokens / link tokens per second
    assert res.ttfts[1] == pytest.approx(fetch + COST.cost(L2 - 6400, L2))
    # no global tier: the migrated follow-up recomputes everything
    _, res = run(t, policy="round-robin", instances=2, gt="none")
    assert res.metrics["reused_tokens"] == 0
    assert res.ttfts[1] == pytest.approx(COST.cost(L2, L2))


def test_sized_global_tier_evicts(tmp_path):
    t = one_session(tmp_path, turns=2, blocks=100, growth=10)
    # room for 50 blocks only: the follow-up finds half of its prefix
    _, res = run(t, policy="round-robin", instances=2, gt=str(50 * 64))
    assert res.metrics["reused_tokens"] == 50 * 64


def test_local_cache_capacity_zero_means_no_local_reuse(tmp_path):
    t = one_session(tmp_path, turns=3)
    _, res = run(t, policy="smetric", instances=2, hardware=hw(hbm=0))
    assert res.metrics["reuse_local"] == 0


def test_shared_link_serializes_fetches():
    link = Link(bw=1000.0)
    assert link.fetch(0.0, 500) == pytest.approx(0.5)
    assert link.fetch(0.1, 500) == pytest.approx(1.0)  # waits for the first transfer
    assert link.fetch(5.0, 1000) == pytest.approx(6.0)


def test_shared_nic_slows_concurrent_migrations(tmp_path):
    # two sessions whose follow-ups both move to other instances at the same time
    recs = []
    for s in range(2):
        recs.append(agentic_record(s, 1, 0.0, 100, start_id=1))
        recs.append(agentic_record(s, 2, 5.0, 110, t_in_session=5.0, think=1.0))
    t = load_trace(write_jsonl(tmp_path / "a.jsonl", recs))
    _, per_gpu = run(t, policy="round-robin", instances=4, link="per-gpu")
    _, shared = run(t, policy="round-robin", instances=4, link="shared", hardware=hw())
    assert shared.metrics["fetch_tokens"] == per_gpu.metrics["fetch_tokens"] > 0
    assert max(shared.ttfts) >= max(per_gpu.ttfts)


def test_imbalance_reported_over_windows():
    trace = load_trace(default_trace())
    sim = Simulator(trace, "round-robin", SimConfig(instances=4), LoadSpec(rate_scale=2.0, duration=3600.0))
    res = sim.run()
    assert res.imbalance and all(x >= 1.0 - 1e-9 for x in res.imbalance)
    assert res.metrics["imbalance_mean"] >= 1.0


def test_invalid_settings_rejected():
    trace = load_trace(default_trace())
    with pytest.raises(ValueError):
        Simulator(trace, "smetric", SimConfig(instances=0))
    with pytest.raises(ValueError):
        Simulator(trace, "smetric", SimConfig(hbm_tokens=-1))
    with pytest.raises(ValueError):
        LoadSpec(rate_scale=0).validate()
    with pytest.raises(ValueError):
        GlobalTierSpec.parse("lots")
    assert GlobalTierSpec.parse("2M").capacity_tokens == 2_000_000
    assert GlobalTierSpec.parse("96KB", kv_bytes_per_token=1000).capacity_tokens == 96
    assert GlobalTierSpec.parse("none").mode == "none"


def test_prefixes_shared_across_sessions_stay_shared(tmp_path):
    # Mooncake-style chained ids: two sessions share their first block (a system prompt)
    import json

    p = tmp_path / "m.jsonl"
    recs = [
        {
            "timestamp": 0,
            "input_length": 1024,
            "output_length": 1,
            "hash_ids": [0, 1],
            "inferred_session_id": 0,
        },
        {
            "timestamp": 5000,
            "input_length": 1024,
            "output_length": 1,
            "hash_ids": [0, 2],
            "inferred_session_id": 1,
        },
    ]
    p.write_text("".join(json.dumps(r) + "\n" for r in recs))
    t = load_trace(p)
    _, res = run(t, policy="smetric", instances=1)
    assert res.metrics["reused_tokens"] == 512  # block 0 reused by the second session
    # replayed copies of a session do not hit each other's private KV, but still share block 0
    spec = LoadSpec(mode="sessions", session_rate=0.05, duration=2000.0, warmup=0.0, seed=2)
    sim = Simulator(t, "smetric", SimConfig(instances=1, hardware=hw()), spec)
    m = sim.run().metrics
    assert m["requests"] > 4
    # every request but the very first finds block 0; none finds its session's private block
    assert m["reused_tokens"] == 512 * (m["requests"] - 1)


def test_compress_mode_measures_arrivals_within_the_compressed_span(tmp_path):
    # turn 1 takes longer than the recorded 5 s gap, so turn 2 arrives after the trace's span:
    # it is still served (conservation) but not credited to the window
    recs = [
        agentic_record(0, 1, 0.0, 700),
        agentic_record(0, 2, 5.0, 710, t_in_session=5.0, think=0.0),
        agentic_record(1, 1, 5.0, 2),
    ]
    t = load_trace(write_jsonl(tmp_path / "c.jsonl", recs))
    assert COST.cost(700 * 64, 700 * 64) > 5.0
    cfg = SimConfig(instances=2, hardware=hw())
    sim = Simulator(t, "least-load", cfg, LoadSpec(mode="compress", warmup=0.0))
    m = sim.run().metrics
    assert sim.tally.served == 3 and m["requests_total"] == 3
    assert m["requests"] == 2 and m["duration_s"] == pytest.approx(5.0)
