"""`smetric bench --executor ray` against the session's Ray instance on loopback.

One Ray instance for the module (tests/conftest.py's ``ray_cluster``). The CLI joins it
with ``--address`` (a second driver, as on a real cluster); the in-process runs use it
directly. Tiny simulations (2 instances, 1200 s of arrivals on the shipped slice), a few
seconds in all besides Ray's start.
"""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys

import pytest

from stack.commands import bench
from support.bench_faults import TINY, FaultyTask, bench_args, check_retried_once_then_reported

WALL_CLOCK = {"sim_wall_s", "sim_requests_per_s"}


def smetric(*args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "stack.cli", *args], capture_output=True, text=True, timeout=timeout
    )


def csv_rows(path) -> list[dict]:
    with open(path, newline="") as fh:
        return list(csv.DictReader(fh))


def without_wall_clock(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if k not in WALL_CLOCK} for r in rows]


def test_the_test_cluster_is_on_loopback(ray_cluster):
    import ray

    assert ray_cluster.startswith("127.0.0.1:")
    assert {n["NodeManagerAddress"] for n in ray.nodes()} == {"127.0.0.1"}


def test_ray_results_equal_the_local_run_row_for_row(ray_cluster, tmp_path):
    # a rate search (its later rounds depend on the earlier rounds' results) with a seed
    sweep = ["bench", "--policies", "smetric,least-load", "--max-rounds", "1", "--seed", "3", *TINY]
    local = smetric(*sweep, "--jobs", "2", "--out", str(tmp_path / "local"))
    assert local.returncode == 0, local.stderr
    on_ray = smetric(*sweep, "--executor", "ray", "--address", ray_cluster, "--out", str(tmp_path / "ray"))
    assert on_ray.returncode == 0, on_ray.stderr

    a, b = csv_rows(tmp_path / "local" / "results.csv"), csv_rows(tmp_path / "ray" / "results.csv")
    assert len(a) >= 10 and list(a[0]) == list(b[0])
    assert without_wall_clock(a) == without_wall_clock(b)
    assert WALL_CLOCK <= set(a[0])  # the columns left out exist (and were measured on each side)
    assert all(float(r["sim_wall_s"]) > 0 for r in b)

    s = json.loads((tmp_path / "ray" / "summary.json").read_text())
    assert s["executor"]["kind"] == "ray" and s["executor"]["address"] == ray_cluster
    assert s["executor"]["workers"] == 2 and s["executor"]["nodes_used"] == 1
    # the trace went into the object store once; each worker process fetched it once at most
    assert 1 <= s["executor"]["trace_loads"] <= 2 < s["runs"] == len(b)
    assert s["failed_runs"] == [] and s["retried_runs"] == []
    local_s = json.loads((tmp_path / "local" / "summary.json").read_text())
    assert (local_s["executor"]["kind"], local_s["executor"]["workers"]) == ("local", 2)
    assert s["executor"]["start_s"] > 0  # joining the cluster
    assert s["smetric_vs_best_baseline"] == local_s["smetric_vs_best_baseline"]


def test_a_run_failing_twice_makes_the_cli_exit_1_with_the_run_listed(ray_cluster, tmp_path, monkeypatch):
    always = FaultyTask(raise_always=frozenset({("lmetric", 0.008)}))
    real = bench.run_bench
    monkeypatch.setattr(bench, "run_bench", lambda *a, **kw: real(*a, **{**kw, "task": always}))
    args = bench_args(
        "--policies", "lmetric", "--rates", "0.004,0.008", "--executor", "ray", "--out", str(tmp_path)
    )  # fmt: skip
    assert bench.run(args) == 1
    s = json.loads((tmp_path / "summary.json").read_text())
    assert [(f["policy"], f["rate"]) for f in s["failed_runs"]] == [("lmetric", 0.008)]
    assert [float(r["rate"]) for r in csv_rows(tmp_path / "results.csv")] == [0.004]


def test_an_address_where_no_cluster_answers_is_one_line_exit_2(ray_cluster, tmp_path):
    r = smetric(
        "bench", "--policies", "lmetric", "--rates", "0.004", "--executor", "ray", "--address",
        "127.0.0.1:1", "--out", str(tmp_path), *TINY, timeout=60,
    )  # fmt: skip
    assert r.returncode == 2, r.stderr
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and "--address 127.0.0.1:1: no Ray cluster answers there" in lines[0], r.stderr
    assert not (tmp_path / "results.csv").exists()


def test_a_failed_or_lost_task_is_retried_once_then_reported(ray_cluster, capsys):
    check_retried_once_then_reported("ray", 2, "WorkerCrashedError: ", capsys)


@pytest.mark.parametrize("how", ["--address auto", "RAY_ADDRESS"])
def test_the_cli_finds_the_cluster_by_auto_or_ray_address(ray_cluster, tmp_path, how):
    env = dict(os.environ)
    args = ["--address", "auto"] if how == "--address auto" else []
    if how == "RAY_ADDRESS":
        env["RAY_ADDRESS"] = ray_cluster
    r = subprocess.run(
        [sys.executable, "-m", "stack.cli", "bench", "--policies", "lmetric", "--rates", "0.004",
         "--executor", "ray", *args, "--out", str(tmp_path), *TINY],
        capture_output=True, text=True, timeout=180, env=env,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    s = json.loads((tmp_path / "summary.json").read_text())
    assert s["executor"]["address"] == ("auto" if how == "--address auto" else ray_cluster)
    assert s["executor"]["workers"] == 2 and s["runs"] == 1  # the module's instance, not a new one
