"""Simulator options that make it closer to SGLang + Mooncake: schedule-time prefix matching
with locks (``match_at``), global-tier writes over the link (``global_write``), and the
metrics added with them (window utilization, evicted follow-ups, fetch wait)."""

from __future__ import annotations

import math

import pytest

from stack.commands.simopts import add_cluster_arguments, sim_config
from stack.core.cost_model import CostModel, Hardware
from stack.core.types import SLO
from stack.kv_tier.prefix_cache import LockingPrefixCache
from stack.paths import default_trace
from stack.sim.engine import GlobalTierSpec, SimConfig, Simulator
from stack.sim.load import LoadSpec
from stack.traces.load import load_trace
from support.traces import agentic_record, write_jsonl

COST = CostModel(c_linear=1e-4, c_attn=1e-9, c_fwd=0.01)
BS = 64


def hw(hbm=1_000_000, chunk=8192, bw_gbps=8.0) -> Hardware:
    # link: bw_gbps * 1e9 / 8 / 1000 B per token (8 Gbps = 1M tokens/s)
    return Hardware(
        name="test", cost=COST, hbm_kv_tokens=hbm, chunk_tokens=chunk, kv_bytes_per_token=1000,
        gpus_per_server=2, nic_gbps=bw_gbps, link_efficiency=1.0, decode_tpot_s=0.0,
    )  # fmt: skip


def run(trace, policy="round-robin", instances=1, gt="full", link="per-gpu", hardware=None, **opts):
    cfg = SimConfig(
        instances=instances,
        hardware=hardware or hw(),
        global_tier=GlobalTierSpec.parse(gt),
        link=link,
        slo=SLO(),
        **opts,
    )
    spec = LoadSpec(mode="compress", rate_scale=1.0, warmup=0.0, measure_until=math.inf)
    sim = Simulator(trace, policy, cfg, spec)
    return sim, sim.run()


def rec(session, turn, ts, blocks, **kw):
    # distinct block ids per session (no shared prefix across sessions)
    return agentic_record(session, turn, ts, blocks, start_id=1 + 100_000 * session, t_in_session=ts, **kw)


# ---------------------------------------------------------------- locking cache
def test_locked_prefix_survives_eviction_until_unlocked():
    c = LockingPrefixCache(120)
    a = ((1, 0, 100),)
    b = ((2, 0, 100),)
    c.insert(a)
    held = c.lock(a, 100)
    c.insert(b)  # 200 blocks in a 120-block cache: only b's blocks are evictable
    assert c.hit(a) == 100
    assert c.hit(b) == 20 and c.used == 120
    c.insert(((3, 0, 50),))  # over capacity while a is locked: b goes first, then c's own tail
    assert c.hit(a) == 100 and c.used <= 150
    c.unlock(held)
    assert c.used <= 120  # back within capacity once unlocked
    # a partial lock keeps only its prefix
    d = LockingPrefixCache(50)
    d.insert(((7, 0, 40),))
    h = d.lock(((7, 0, 40),), 10)
    d.insert(((8, 0, 45),))
    assert d.hit(((7, 0, 40),)) == 10
    d.unlock(h)
    assert d._locks == {}


def test_locks_are_counted_per_holder():
    c = LockingPrefixCache(10)
    p = ((1, 0, 10),)
    c.insert(p)
    h1 = c.lock(p, 10)
    h2 = c.lock(p, 4)
    c.unlock(h1)
    c.insert(((2, 0, 10),))
    assert c.hit(p) == 4  # the second holder still protects its 4 blocks
    c.unlock(h2)
    c.insert(((3, 0, 10),))
    assert c.hit(p) == 0


# ---------------------------------------------------------------- match_at
def _evicted_while_queued(tmp_path):
    """A1 (100 blocks) fills a 120-block cache; B1 (100 blocks, another session) starts at
    t=1.0; A2 (110 blocks) arrives at t=1.1 with 100 blocks cached, and waits behind B1,
    whose completion evicts 80 of A's blocks before A2 is scheduled."""
    recs = [
        rec(0, 1, 0.0, 100),
        rec(1, 1, 1.0, 100),
        rec(0, 2, 1.1, 110, think=0.0),
    ]
    return load_trace(write_jsonl(tmp_path / "e.jsonl", recs))


def test_schedule_time_match_sees_the_eviction_arrival_time_does_not(tmp_path):
    t = _evicted_while_queued(tmp_path)
    small = hw(hbm=120 * BS)
    L2 = 110 * BS
    b_done = 1.0 + COST.cost(100 * BS, 100 * BS)
    # old behaviour: A2 keeps the 6,400 tokens it saw at arrival
    _, arr = run(t, gt="none", hardware=small, match_at="arrival")
    assert arr.metrics["reused_tokens"] == 100 * BS
    assert arr.ttfts[2] == pytest.approx(b_done - 1.1 + COST.cost(L2 - 100 * BS, L2))
    # SGLang: matched when scheduled; 20 blocks left; no global tier: the rest is computed
    _, sch = run(t, gt="none", hardware=small, match_at="schedule")
    m = sch.metrics
    assert m["reused_tokens"] == 20 * BS and m["reuse_global"] == 0
    assert m["rematch_short"] == 1 and m["rematch_short_tokens"] == 80 * BS
    assert m["computed_tokens"] == arr.metrics["computed_tokens"] + 80 * BS
    assert sch.ttfts[2] == pytest.approx(b_done - 1.1 + COST.cost(L2 - 20 * BS, L2))
    # with a global tier the shortfall is fetched over the link, then the rest computed
    _, glob = run(t, gt="full", hardware=small, match_at="schedule")
    m = glob.metrics
    assert m["reuse_local"] * m["prompt_tokens"] == pytest.approx(20 * BS)
    assert m["reuse_global"] * m["prompt_tokens"] == pytest.approx(80 * BS)
    assert m["fetch_tokens"] == 80 * BS and m["fetch_requests"] == 1
    fetch = 80 * BS / 1e6
    assert m["fetch_wait_s"] == pytest.approx(fetch)
    assert glob.ttfts[2] == pytest.approx(b_done - 1.1 + fetch + COST.cost(L2 - 100 * BS, L2))


def test_schedule_time_match_equals_arrival_match_without_pressure(tmp_path):
    t = _evicted_while_queued(tmp_path)
    _, a = run(t, match_at="arrival")
    _, s = run(t, match_at="schedule")
    assert s.ttfts == pytest.approx(a.ttfts)
    assert s.metrics["reused_tokens"] == a.metrics["reused_tokens"] == 100 * BS
    assert s.metrics["rematch_short"] == 0


def test_schedule_time_match_picks_up_kv_that_arrived_after_the_decision(tmp_path):
    # Mooncake-style ids: two sessions share 6 blocks of 512 tokens; the second arrives while
    # the first is computing (nothing cached at its arrival) and is scheduled after it
    import json

    p = tmp_path / "m.jsonl"
    recs = [
        {"timestamp": 0, "input_length": 13 * 512, "output_length": 1, "hash_ids": list(range(13))},
        {"timestamp": 1, "input_length": 7 * 512, "output_length": 1, "hash_ids": [*range(6), 100]},
    ]
    p.write_text("".join(json.dumps(r) + "\n" for r in recs))
    t = load_trace(p)
    _, a = run(t, gt="none", match_at="arrival")
    _, s = run(t, gt="none", match_at="schedule")
    assert a.metrics["reused_tokens"] == 0
    assert s.metrics["reused_tokens"] == 6 * 512 and s.metrics["rematch_short"] == 0
    L = 7 * 512
    assert s.ttfts[1] == pytest.approx(a.ttfts[1] - COST.cost(L, L) + COST.cost(L - 6 * 512, L))


def test_match_at_schedule_conserves_on_the_shipped_slice():
    trace = load_trace(default_trace())
    for name in ("smetric", "smetric-global", "dynamo", "least-load"):
        cfg = SimConfig(
            instances=8, hbm_tokens=100_000, match_at="schedule", global_write="link", link="shared"
        )
        spec = LoadSpec(mode="sessions", rate_scale=4.0, duration=3600.0, warmup=600.0, seed=1)
        sim = Simulator(trace, name, cfg, spec)
        m = sim.run().metrics
        assert sim.tally.issued == sim.tally.served > 0, name
        assert m["reused_tokens"] + m["computed_tokens"] == m["prompt_tokens"], name
        assert all(i.n_jobs == 0 and i.q_tokens == 0 and not i.cache._locks for i in sim.insts), name
        assert all(i.cache.used <= i.cache.capacity for i in sim.insts), name
        assert m["write_tokens"] > 0 and m["fetch_requests"] > 0


# ---------------------------------------------------------------- global_write
def test_follow_up_before_the_write_completes_misses_the_global_tier(tmp_path):
    # turn 1 (6,400 tokens) ends at ~0.67 s; at 1,000 tokens/s its write takes 6.4 s; turn 2
    # arrives at 5 s on the other instance (round-robin)
    recs = [rec(0, 1, 0.0, 100), rec(0, 2, 5.0, 110, think=1.0)]
    t = load_trace(write_jsonl(tmp_path / "w.jsonl", recs))
    slow = hw(bw_gbps=0.008)
    _, inst = run(t, instances=2, hardware=slow, global_write="instant")
    assert inst.metrics["reused_tokens"] == 100 * BS and inst.metrics["write_tokens"] == 0
    _, link = run(t, instances=2, hardware=slow, global_write="link")
    m = link.metrics
    assert m["reused_tokens"] == 0 and m["fetch_tokens"] == 0
    L2 = 110 * BS
    assert link.ttfts[1] == pytest.approx(COST.cost(L2, L2))
    # both prompts were written in full (the second one before the first became visible)
    assert m["write_tokens"] == 100 * BS + L2
    # a later follow-up finds it
    recs = [rec(0, 1, 0.0, 100), rec(0, 2, 8.0, 110, think=1.0)]
    t = load_trace(write_jsonl(tmp_path / "w2.jsonl", recs))
    _, late = run(t, instances=2, hardware=slow, global_write="link")
    assert late.metrics["reused_tokens"] == 100 * BS
    assert late.metrics["write_tokens"] == 100 * BS + 10 * BS  # only the new blocks


def _writer_and_fetcher(tmp_path):
    """Round-robin on 2 instances: Y1 -> 0, X1 -> 1, Z1 -> 0, W1 (100 blocks) -> 1 behind X1;
    X2 at t=1.0 -> 0 fetches X's 20 blocks while instance 1 writes W's 100 blocks."""
    recs = [
        rec(0, 1, 0.0, 10),  # Y
        rec(1, 1, 0.0001, 20),  # X
        rec(2, 1, 0.0002, 5),  # Z
        rec(3, 1, 0.0003, 100),  # W
        rec(1, 2, 1.0, 25, think=0.5),  # X2
    ]
    return load_trace(write_jsonl(tmp_path / "n.jsonl", recs))


def test_a_shared_nic_delays_a_fetch_behind_another_gpus_write(tmp_path):
    t = _writer_and_fetcher(tmp_path)
    h = hw(bw_gbps=0.08)  # 10k tokens/s
    fetch = 20 * BS / 10_000
    waits = {}
    for link in ("per-gpu", "shared"):
        for gw in ("instant", "link"):
            _, r = run(t, instances=2, link=link, hardware=h, global_write=gw)
            assert r.metrics["fetch_tokens"] == 20 * BS, (link, gw)
            waits[link, gw] = r.metrics["fetch_wait_s"]
    assert waits["per-gpu", "instant"] == pytest.approx(fetch)
    assert waits["shared", "instant"] == pytest.approx(fetch)
    assert waits["per-gpu", "link"] == pytest.approx(fetch)  # instance 0's own link is free
    # W's write (6,400 tokens, 0.64 s) started at ~0.81 s on the shared NIC: the fetch waits
    w_done = 0.0001 + COST.cost(20 * BS, 20 * BS) + COST.cost(100 * BS, 100 * BS)
    assert waits["shared", "link"] == pytest.approx(w_done + 100 * BS / 10_000 - 1.0 + fetch, rel=1e-6)
    assert waits["shared", "link"] > fetch + 0.4


def test_write_backlog_shows_in_the_router_view(tmp_path):
    t = _writer_and_fetcher(tmp_path)
    sim = Simulator(
        t,
        "round-robin",
        SimConfig(instances=2, hardware=hw(bw_gbps=0.08), link="shared", global_write="link"),
        LoadSpec(mode="compress", rate_scale=1.0, warmup=0.0, measure_until=math.inf),
    )
    seen = []
    orig = sim.policy.choose

    def spy(req, view):
        seen.append([s.fetch_backlog_s for s in view.instances])
        return orig(req, view)

    sim.policy.choose = spy
    sim.run()
    assert seen[-1][0] > 0.3 and seen[-1][0] == seen[-1][1]  # X2 sees W's write queued


# ---------------------------------------------------------------- metrics
def test_utilization_over_the_window_and_over_the_run(tmp_path):
    # one 6,400-token prefill at t=0 and one at t=100: busy 2 x cost out of a 100 s window
    recs = [rec(0, 1, 0.0, 100), rec(1, 1, 100.0, 100)]
    t = load_trace(write_jsonl(tmp_path / "u.jsonl", recs))
    cfg = SimConfig(instances=1, hardware=hw())
    c = COST.cost(100 * BS, 100 * BS)
    spec = LoadSpec(mode="compress", rate_scale=1.0, warmup=50.0)
    m = Simulator(t, "round-robin", cfg, spec).run().metrics
    # window [50, 100]: the second prefill starts at its end; the first is in the warm-up
    assert m["gpu_utilization"] == pytest.approx(0.0, abs=1e-9)
    assert m["gpu_utilization_run"] == pytest.approx(2 * c / (100 + c))
    spec = LoadSpec(mode="compress", rate_scale=1.0, warmup=0.0, measure_until=math.inf)
    m = Simulator(t, "round-robin", cfg, spec).run().metrics
    assert m["gpu_utilization"] == pytest.approx(2 * c / (100 + c))


def test_evicted_follow_ups_are_counted_apart_from_first_turns(tmp_path):
    # smetric on 2 instances, no local room: turn 2 finds nothing locally, so SMetric
    # balances it as a first turn; it is now counted as an evicted follow-up
    recs = [rec(0, 1, 0.0, 100), rec(0, 2, 5.0, 110, think=1.0)]
    t = load_trace(write_jsonl(tmp_path / "f.jsonl", recs))
    _, r = run(t, policy="smetric", instances=2, hardware=hw(hbm=0))
    m = r.metrics
    assert m["first_turns"] == 1 and m["evicted_followups"] == 1 and m["sticks"] == 0
    _, r = run(t, policy="smetric", instances=2)
    assert r.metrics["first_turns"] == 1 and r.metrics["evicted_followups"] == 0
    assert r.metrics["sticks"] == 1


def test_defaults_and_cli_options():
    cfg = SimConfig()
    assert cfg.match_at == "arrival" and cfg.global_write == "instant"
    with pytest.raises(ValueError):
        SimConfig(match_at="later").validate()
    with pytest.raises(ValueError):
        SimConfig(global_write="never").validate()
    import argparse

    p = argparse.ArgumentParser()
    add_cluster_arguments(p)
    args = p.parse_args(["--match-at", "schedule", "--global-write", "link"])
    cfg = sim_config(args)
    assert cfg.match_at == "schedule" and cfg.global_write == "link"
    cfg = sim_config(p.parse_args([]))
    assert cfg.match_at == "arrival" and cfg.global_write == "instant"


def test_bench_and_sim_take_the_options(tmp_path):
    import csv
    import json
    import subprocess
    import sys

    tiny = ["--instances", "2", "--duration", "1200", "--no-progress", "--match-at", "schedule"]
    tiny += ["--global-write", "link"]
    r = subprocess.run(
        [sys.executable, "-m", "stack.cli", "bench", "--policies", "smetric", "--rates", "0.008"]
        + ["--out", str(tmp_path / "b"), "--jobs", "1", "--no-plots", *tiny],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    with (tmp_path / "b" / "results.csv").open() as fh:
        row = next(csv.DictReader(fh))
    assert row["match_at"] == "schedule" and row["global_write"] == "link"
    r = subprocess.run(
        [sys.executable, "-m", "stack.cli", "sim", "--policy", "smetric", "--out", str(tmp_path / "s.json")]
        + ["--session-rate", "0.008", *tiny],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    m = json.loads((tmp_path / "s.json").read_text())
    assert m["match_at"] == "schedule" and m["global_write"] == "link" and "fetch_wait_s" in m
