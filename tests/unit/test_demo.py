"""`smetric demo`: the main job prints the comparison table."""

from __future__ import annotations

import json
import subprocess
import sys

from stack.dispatch import ROUTER_DISPATCH


def smetric(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "stack.cli", *args], capture_output=True, text=True, timeout=300
    )


def test_demo_quick_prints_the_table(tmp_path):
    r = smetric(
        "demo", "--quick", "--instances", "2", "--duration", "1200", "--no-progress", "--out", str(tmp_path)
    )
    assert r.returncode == 0, r.stderr
    for p in ("smetric", "smetric-global", "lmetric", "linear", "least-load", "dynamo"):
        assert p in r.stdout
    assert "best baseline" in r.stdout and "capacity" in r.stdout
    s = json.loads((tmp_path / "summary.json").read_text())
    assert s["experiment"] == "demo" and len(s["policies"]) == 7
    # the product's default (slack dispatch) beside the baselines as shipped (immediate)
    default = ROUTER_DISPATCH.label()
    assert s["policies"][f"smetric-global+{default}"]["dispatch"] == default
    assert s["policies"]["least-load"]["dispatch"] == "immediate"
    assert not s["best_baseline"].endswith("slack")
    assert (tmp_path / "tps_vs_rate.png").exists()


def test_demo_bad_input(tmp_path):
    r = smetric("demo", "--quick", "--policies", "bogus")
    assert r.returncode == 2 and "unknown policy" in r.stderr and "Traceback" not in r.stderr
