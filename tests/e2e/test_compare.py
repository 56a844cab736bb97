"""`smetric compare`, tiny: one of our policies and one sglang-router policy (the real Rust
router from PyPI, PD mode) on fresh emulated PD pools, a minute of modelled trace each, the
simulator beside them; checks the files and that every run served requests and lost none."""

from __future__ import annotations

import csv
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytest.importorskip("sglang_router")


def test_compare_tiny(tmp_path):
    out = tmp_path / "cmp"
    cmd = [
        sys.executable, "-m", "stack.cli", "compare",
        "--policies", "smetric", "--peer-policies", "round_robin",
        "--rate", "0.1", "--duration", "60", "--warmup", "10", "--time-factor", "0.1",
        "--request-timeout", "20", "--out", str(out), "--no-progress",
    ]  # fmt: skip
    if shutil.which("mooncake_master") is None:
        cmd.append("--no-mooncake")
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=150)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    for name in ("compare.json", "compare.csv", "compare.png"):
        assert (out / name).stat().st_size > 0, name
    assert (out / "compare.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    res = json.loads((out / "compare.json").read_text())
    assert set(res) >= {"settings", "rows", "ordering", "runs", "sim"}
    assert [r["config"] for r in res["rows"]] == ["ours:smetric", "sglang-router:round_robin"]
    for cfg, runs in res["runs"].items():
        assert len(runs) == 1, cfg
        for r in runs:
            assert r["requests"] > 0, cfg
            assert r["errors"] == 0, (cfg, r["error_examples"])
            assert r["lost"] == 0, cfg
            assert r["requests_total"] == r["requests_sent"], cfg
            assert r["ttft_p50"] is not None and r["ttft_p50"] > 0, cfg
            assert r["reuse_total"] is not None, cfg  # cached_tokens came back through either router
            assert len(r["loadavg_before"]) == 3
            workers = r["prefill_workers"]  # server-side counters of the two prefill workers
            assert len(workers) == 2 and sum(w.get("requests", 0) for w in workers) > 0
    assert res["runs"]["ours:smetric"][0]["router"] == "smetric router"
    assert res["runs"]["sglang-router:round_robin"][0]["router"] == "sglang-router"
    rows = {r["config"]: r for r in res["rows"]}
    assert rows["sglang-router:round_robin"]["sim_policy"] == "round-robin"
    assert rows["ours:smetric"]["sim_policy"] == "smetric"
    for r in rows.values():
        assert r["sim_requests"] > 0
        assert r["sim_prefill_tps_within_slo"] is not None
        assert r["live_lost_max"] == 0
    assert res["ordering"]["pairs"] == 1
    assert set(res["ordering"]["live_order"]) == set(rows)
    with (out / "compare.csv").open() as f:
        lines = list(csv.DictReader(f))
    assert [x["config"] for x in lines] == list(rows)
    want = {"live_prefill_tps_within_slo", "sim_prefill_tps_within_slo", "gap_tps_within_slo"}
    assert want <= set(lines[0])
    assert "ordering by prefill TPS within SLO" in p.stdout

    # --resim: no live runs, the stored ones simulated again and every output rewritten
    from stack.cli import main

    (out / "compare.csv").unlink()
    args = [
        "compare",
        "--resim",
        "--policies",
        "smetric",
        "--peer-policies",
        "round_robin",
        "--out",
        str(out),
    ]
    assert main(args) == 0
    assert (out / "compare.csv").exists()
    again = json.loads((out / "compare.json").read_text())
    assert again["runs"] == res["runs"]


def test_cache_aware_stand_in():
    """The simulator's stand-in for sglang-router's cache_aware: a follow-up goes back to its
    session's worker when its history share passes the threshold, others to the smallest tree."""
    from stack.core.cost_model import load_hardware
    from stack.core.types import SLO, ClusterView, InstanceState, Request
    from stack.policies import PolicyContext
    from stack.policies.sglang_cache_aware import SGLangCacheAwareApprox

    ctx = PolicyContext(cost=load_hardware("h20").cost, slo=SLO())
    pol = SGLangCacheAwareApprox(ctx)
    view = ClusterView(now=0.0, instances=[InstanceState(0), InstanceState(1)])
    a = pol.choose(Request(prompt_tokens=1000, session_id="a"), view).instance
    b = pol.choose(Request(prompt_tokens=1000, session_id="b"), view).instance
    assert a != b  # smallest tree
    assert pol.choose(Request(prompt_tokens=2000, turn=2, est_hit=1000, session_id="a"), view).instance == a
    blind = SGLangCacheAwareApprox(ctx, history_visible=0)
    x = blind.choose(Request(prompt_tokens=5000, session_id="a"), view).instance
    assert blind.choose(Request(prompt_tokens=6000, turn=2, est_hit=5000, session_id="a"), view).instance != x


def test_compare_rejects_unknown_peer_policy(tmp_path):
    from stack.cli import main

    assert main(["compare", "--peer-policies", "bogus", "--out", str(tmp_path)]) == 2
