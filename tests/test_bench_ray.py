"""`smetric bench --executor ray` against a Ray instance this module starts on loopback.

One Ray instance for the module (2 CPUs, a small object store, no dashboard): the CLI joins
it with ``--address``; the in-process runs use it directly. Tiny simulations (2 instances,
1200 s of arrivals on the shipped slice), a few seconds in all besides Ray's start.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import subprocess
import sys

import pytest

from stack.bench.executors import LOOPBACK_ENV

os.environ.setdefault(*LOOPBACK_ENV)  # before Ray is imported: its servers on 127.0.0.1 only
try:
    import ray
except ImportError:  # the project's setup installs the ray extra; CI must run these tests
    if os.environ.get("CI", "").lower() in ("true", "1", "yes"):
        raise
    pytest.skip("ray is not installed: pip install 'stack[ray]'", allow_module_level=True)

import support.bench_faults as bench_faults
from stack.bench.experiments import Setting
from stack.commands import bench
from support.bench_faults import FaultyTask

WALL_CLOCK = {"sim_wall_s", "sim_requests_per_s"}
TINY = ["--instances", "2", "--duration", "1200", "--no-progress", "--no-plots"]


@pytest.fixture(scope="module")
def cluster():
    ray.init(
        num_cpus=2,
        object_store_memory=80 * 1024 * 1024,
        include_dashboard=False,
        logging_level="WARNING",
    )
    # the fault-injecting task is sent to Ray's workers by value (tests/ is not on their path)
    ray.cloudpickle.register_pickle_by_value(bench_faults)
    try:
        yield ray.get_runtime_context().gcs_address
    finally:
        ray.cloudpickle.unregister_pickle_by_value(bench_faults)
        ray.shutdown()


def smetric(*args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "stack.cli", *args], capture_output=True, text=True, timeout=timeout
    )


def csv_rows(path) -> list[dict]:
    with open(path, newline="") as fh:
        return list(csv.DictReader(fh))


def without_wall_clock(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if k not in WALL_CLOCK} for r in rows]


def test_cluster_is_on_loopback(cluster):
    assert cluster.startswith("127.0.0.1:")


def test_ray_results_equal_the_local_run_row_for_row(cluster, tmp_path):
    # a rate search (its later rounds depend on the earlier rounds' results) with a seed
    sweep = ["bench", "--policies", "smetric,least-load", "--max-rounds", "1", "--seed", "3", *TINY]
    local = smetric(*sweep, "--jobs", "2", "--out", str(tmp_path / "local"))
    assert local.returncode == 0, local.stderr
    on_ray = smetric(*sweep, "--executor", "ray", "--address", cluster, "--out", str(tmp_path / "ray"))
    assert on_ray.returncode == 0, on_ray.stderr

    a, b = csv_rows(tmp_path / "local" / "results.csv"), csv_rows(tmp_path / "ray" / "results.csv")
    assert len(a) >= 10 and list(a[0]) == list(b[0])
    assert without_wall_clock(a) == without_wall_clock(b)
    assert WALL_CLOCK <= set(a[0])  # the columns left out exist (and were measured on each side)
    assert all(float(r["sim_wall_s"]) > 0 for r in b)

    s = json.loads((tmp_path / "ray" / "summary.json").read_text())
    assert s["executor"]["kind"] == "ray" and s["executor"]["address"] == cluster
    assert s["executor"]["workers"] == 2 and s["executor"]["nodes_used"] == 1
    # the trace went into the object store once; each worker process fetched it once at most
    assert 1 <= s["executor"]["trace_loads"] <= 2 < s["runs"] == len(b)
    assert s["failed_runs"] == [] and s["retried_runs"] == []
    local_s = json.loads((tmp_path / "local" / "summary.json").read_text())
    assert local_s["executor"] == {"kind": "local", "workers": 2}
    assert s["smetric_vs_best_baseline"] == local_s["smetric_vs_best_baseline"]


def bench_args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    bench.add_arguments(p)
    return p.parse_args([*argv, *TINY])


FAULTS = FaultyTask(
    raise_once=frozenset({("smetric", 0.004)}),
    crash_once=frozenset({("lmetric", 0.004)}),
    raise_always=frozenset({("least-load", 0.008)}),
)


def faulty_sweep(executor: str, jobs: int, task=FAULTS) -> dict:
    return bench.run_bench(
        bench_args(),
        experiment="pd-disagg",
        settings=(Setting(),),
        policies=("smetric", "lmetric", "least-load"),
        rates=[0.004, 0.008],
        out=None,
        jobs=jobs,
        executor=executor,
        task=task,
    )


def by_run(rows: list[dict]) -> dict:
    return {(r["policy"], r["rate"]): {k: v for k, v in r.items() if k not in WALL_CLOCK} for r in rows}


@pytest.mark.parametrize("executor,jobs", [("ray", 2), ("local", 2)])
def test_a_failed_or_lost_run_is_retried_once_then_reported(cluster, executor, jobs, capsys):
    res = faulty_sweep(executor, jobs)
    s = res["summary"]
    # the sweep completed without the run that always fails
    assert set(by_run(res["rows"])) == {
        (p, r) for p in ("smetric", "lmetric", "least-load") for r in (0.004, 0.008)
    } - {("least-load", 0.008)}
    assert s["runs"] == 5
    [failed] = s["failed_runs"]
    assert (failed["policy"], failed["rate"], failed["attempts"]) == ("least-load", 0.008, 2)
    assert failed["setting"] == "default" and failed["dispatch"] == "immediate"
    assert failed["error"].startswith("InjectedFault: injected: least-load @ 0.008 always fails (attempt 1)")
    # one raised, one lost its worker: both ran on their second attempt
    retried = {(r["policy"], r["rate"]): r for r in s["retried_runs"]}
    assert set(retried) == {("smetric", 0.004), ("lmetric", 0.004)}
    assert retried[("smetric", 0.004)]["error"] == "InjectedFault: injected: smetric @ 0.004 fails once"
    lost = {"ray": "WorkerCrashedError: ", "local": "WorkerLost: worker process "}[executor]
    assert retried[("lmetric", 0.004)]["error"].startswith(lost)
    assert all(r["attempts"] == 2 for r in retried.values())
    assert "least-load @ 0.008 (default) failed 2 times: InjectedFault" in capsys.readouterr().err
    # the recovered runs are the runs a clean sweep gets
    clean = faulty_sweep("local", 1, task=FaultyTask())
    assert by_run(res["rows"]) == {
        k: v for k, v in by_run(clean["rows"]).items() if k != ("least-load", 0.008)
    }


def test_a_failing_run_in_the_cli_is_listed_and_the_exit_status_says_so(cluster, tmp_path, monkeypatch):
    # the CLI's exit status and message when a run fails twice, in-process on the module's Ray
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


def test_an_address_where_no_cluster_answers_is_one_line_exit_2(cluster, tmp_path):
    r = smetric(
        "bench", "--policies", "lmetric", "--rates", "0.004", "--executor", "ray", "--address",
        "127.0.0.1:1", "--out", str(tmp_path), *TINY, timeout=60,
    )  # fmt: skip
    assert r.returncode == 2, r.stderr
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and "--address 127.0.0.1:1: no Ray cluster answers there" in lines[0], r.stderr
