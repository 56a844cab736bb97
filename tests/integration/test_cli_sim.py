"""`smetric sim` end to end: JSON keys, help, and one-line errors for bad input."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

REQUIRED = [
    "requests", "duration_s", "prefill_tps_within_slo", "slo_attainment", "ttft_p50", "ttft_p90",
    "ttft_p99", "imbalance_mean", "imbalance_p99", "reuse_total", "reuse_local", "reuse_global",
    "sticks", "migrations", "first_turns", "sim_wall_s",
]  # fmt: skip


def smetric(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "stack.cli", *args], capture_output=True, text=True, timeout=timeout
    )


def test_sim_writes_json_with_required_keys(tmp_path):
    out = tmp_path / "r.json"
    r = smetric("sim", "--policy", "smetric", "--instances", "8", "--duration", "3600", "--out", str(out))
    assert r.returncode == 0, r.stderr
    data = json.loads(out.read_text())
    for k in REQUIRED:
        assert k in data, k
    assert data["policy"] == "smetric" and data["requests"] > 0


def test_sim_runs_on_mooncake_trace_in_compress_mode(tmp_path):
    p = tmp_path / "m.jsonl"
    p.write_text(
        "".join(
            json.dumps(
                {"timestamp": 1000 * i, "input_length": 1024, "output_length": 4, "hash_ids": [0, i + 1]}
            )
            + "\n"
            for i in range(20)
        )
    )
    r = smetric("sim", "--policy", "lmetric", "--trace", str(p), "--instances", "2")
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout)
    assert data["load_mode"] == "compress" and data["requests"] > 0


def test_sim_help_explains_every_option():
    r = smetric("sim", "--help")
    assert r.returncode == 0
    for opt in [
        "--policy",
        "--instances",
        "--rate-scale",
        "--global-tier",
        "--slo-b",
        "--slo-a",
        "--out",
        "--link",
    ]:
        assert opt in r.stdout


def test_top_level_help():
    r = smetric("--help")
    assert r.returncode == 0 and "sim" in r.stdout and "SMetric" in r.stdout


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--policy", "nope"], "unknown policy"),
        (["--policy", "smetric", "--trace", "/no/such/file.jsonl"], "no such trace"),
        (["--policy", "smetric", "--instances", "0"], "instances"),
        (["--policy", "smetric", "--rate-scale", "0"], "rate scale"),
        (["--policy", "smetric", "--rate-scale", "-1"], "rate scale"),
        (["--policy", "smetric", "--global-tier", "-5"], "capacity"),
        (["--policy", "smetric", "--hbm-tokens", "-1"], "hbm"),
        (["--policy", "smetric", "--hardware", "tpu9"], "unknown hardware"),
        (["--policy", "smetric", "--param", "hit_ratio=7"], "hit_ratio"),
    ],
)
def test_bad_input_is_one_line_and_nonzero(args, needle):
    r = smetric("sim", *args)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert needle in lines[0].lower()
    assert "Traceback" not in r.stderr


def test_malformed_trace_names_file_and_line(tmp_path):
    p = tmp_path / "bad.jsonl"
    p.write_text('{"session_id": 1, "hash_id_ranges": [[1,2]], "input_length": 100, "timestamp": 0}\n{oops\n')
    r = smetric("sim", "--policy", "smetric", "--trace", str(p))
    assert r.returncode == 2
    assert f"{p}:2" in r.stderr and "Traceback" not in r.stderr


def test_sim_colocated_reports_tpot_and_tps_within_both_slos(tmp_path):
    out = tmp_path / "c.json"
    r = smetric(
        "sim", "--policy", "smetric", "--mode", "colocated", "--slo-tpot", "0.03", "--instances", "4",
        "--duration", "1800", "--out", str(out),
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    data = json.loads(out.read_text())
    for k in REQUIRED + ["tps_within_slo", "output_tps", "tpot_p50", "tpot_p90", "slo_attainment_both"]:
        assert k in data, k
    assert data["mode"] == "colocated" and data["tpot_slo_s"] == 0.03
    assert 0 < data["tps_within_slo"] <= data["output_tps"]
    assert data["decode_events"] < data["decode_forwards"]


@pytest.mark.parametrize("args,needle", [(["--mode", "both"], "--mode"), (["--slo-tpot", "0"], "slo-tpot")])
def test_sim_colocated_bad_input_is_one_line(args, needle):
    r = smetric("sim", "--policy", "smetric", *args)
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert needle in r.stderr and "Traceback" not in r.stderr
