"""`smetric trace-stats`: the paper's workload statistics on hand-built traces."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from stack.commands.trace_stats import gini, trace_stats
from stack.traces.load import load_trace


def smetric(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "stack.cli", *args], capture_output=True, text=True, timeout=120
    )


def agentic(path, reqs):
    """reqs: (session, t, n_blocks, turn); every turn extends the session's blocks 0..n-1."""
    lines = []
    for s, t, n, turn in reqs:
        lines.append(json.dumps({
            "session_id": s, "agent": "main", "turn": turn, "timestamp": t, "t_in_session": t - 100 * s,
            "input_length": 64 * n, "output_length": 10, "hash_id_ranges": [[0, n - 1]], "think_time": 1.0,
        }))  # fmt: skip
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture
def two_sessions(tmp_path):
    # session 0: 10 blocks, then 20 (reuses 10), then 30 (reuses 20, 50 s later)
    # session 1: 10 blocks (ids are session-local: no reuse across sessions)
    return agentic(
        tmp_path / "t.jsonl", [(0, 0.0, 10, 1), (1, 100.0, 10, 1), (0, 5.0, 20, 2), (0, 55.0, 30, 3)]
    )


def test_reuse_and_session_statistics(two_sessions):
    st = trace_stats(load_trace(two_sessions), instances=2)
    prompt = 64 * (10 + 20 + 30 + 10)
    # hits are capped one token short of the prompt only when the whole prompt is cached
    assert st["ideal_reuse_ratio"] == pytest.approx(64 * (10 + 20) / prompt)
    assert st["intra_session_share_of_reuse"] == pytest.approx(1.0)
    assert st["first_turn_share_of_requests"] == pytest.approx(0.5)
    assert st["first_turn_reuse_ratio"] == 0
    # reuse intervals: 10 blocks after 5 s, 20 blocks after 50 s -> p50 = 50 s, all within 100 s
    assert st["reuse_interval_p90_s"] == pytest.approx(50.0)
    assert st["reuse_within_100s_share"] == pytest.approx(1.0)
    assert st["sessions"] == 2
    assert st["top10pct_sessions_token_share"] == pytest.approx(60 / 70)
    bp = st["balance_profile"]
    assert bp["instances"] == 2 and bp["imbalance_max"] >= 1.0


def test_gini():
    assert gini([1, 1, 1, 1]) == pytest.approx(0.0)
    assert gini([0, 0, 0, 10]) == pytest.approx(0.75)


def test_cli_writes_json_and_table(two_sessions, tmp_path):
    out = tmp_path / "s.json"
    r = smetric("trace-stats", str(two_sessions), "--json", str(out), "--instances", "4")
    assert r.returncode == 0, r.stderr
    data = json.loads(out.read_text())
    for k in ("ideal_reuse_ratio", "intra_session_share_of_reuse", "first_turn_share_of_requests",
              "reuse_interval_p50_s", "reuse_within_100s_share", "session_token_gini", "balance_profile"):  # fmt: skip
        assert k in data
    assert "ideal_reuse_ratio" in r.stdout


def test_cli_on_mooncake_trace(tmp_path):
    p = tmp_path / "m.jsonl"
    p.write_text(
        "".join(
            json.dumps(
                {"timestamp": 1000 * i, "input_length": 1024, "output_length": 4, "hash_ids": [0, i + 1]}
            )
            + "\n"
            for i in range(10)
        )
    )
    r = smetric("trace-stats", str(p), "--json", "-")
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout)
    # every request shares block 0 with an earlier one (except the first): 9 of 20 blocks
    assert data["ideal_reuse_ratio"] == pytest.approx(9 * 512 / (10 * 1024))
    assert data["intra_session_share_of_reuse"] == pytest.approx(0.0)


@pytest.mark.parametrize(
    "args,needle", [(["/nonexistent.jsonl"], "no such trace"), (["X", "--instances", "0"], "instances")]
)
def test_bad_input_exit_2(tmp_path, args, needle):
    args = [str(tmp_path / "t.jsonl") if a == "X" else a for a in args]
    if "X" not in args:
        (tmp_path / "t.jsonl").write_text("")
    r = smetric("trace-stats", *args)
    assert r.returncode == 2
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and needle in lines[0], r.stderr
