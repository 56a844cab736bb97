"""`smetric bench` end to end on the shipped slice with tiny clusters and durations."""

from __future__ import annotations

import csv
import json
import subprocess
import sys

import pytest

from stack.bench.summary import read_csv, summarize

SIM_KEYS = [
    "requests", "duration_s", "prefill_tps_within_slo", "slo_attainment", "ttft_p50", "ttft_p90",
    "ttft_p99", "imbalance_mean", "imbalance_p99", "reuse_total", "reuse_local", "reuse_global",
    "sticks", "migrations", "first_turns", "sim_wall_s", "gpu_utilization",
]  # fmt: skip
SETTING_KEYS = ["experiment", "setting", "setting_params", "rate", "rate_unit", "slo_b", "slo_a_ms_per_1k"]
TINY = ["--instances", "2", "--duration", "1200", "--no-progress"]


def smetric(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "stack.cli", *args], capture_output=True, text=True, timeout=timeout
    )


@pytest.fixture(scope="module")
def explicit_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    r = smetric(
        "bench",
        "--policies",
        "smetric,lmetric,least-load",
        "--rates",
        "0.004,0.008,0.016",
        "--out",
        str(out),
        "--jobs",
        "1",
        *TINY,
    )
    assert r.returncode == 0, r.stderr
    return out, r


def test_bench_writes_csv_summary_and_plots(explicit_run):
    out, r = explicit_run
    for name in (
        "results.csv",
        "summary.json",
        "curves.json",
        "tps_vs_rate.png",
        "ttft_cdf.png",
        "imbalance_cdf.png",
        "reuse_split.png",
    ):
        assert (out / name).stat().st_size > 0, name
    with (out / "results.csv").open() as fh:
        rows = list(csv.DictReader(fh))
    assert len(rows) == 3 * 3  # policy x rate x one setting
    for k in SIM_KEYS + SETTING_KEYS:
        assert k in rows[0], k
    assert {row["policy"] for row in rows} == {"smetric", "lmetric", "least-load"}
    assert {float(row["rate"]) for row in rows} == {0.004, 0.008, 0.016}
    assert all(row["rate_unit"] == "sessions/s" for row in rows)
    # the terminal table names every policy
    for p in ("smetric", "lmetric", "least-load"):
        assert p in r.stdout


def test_summary_is_consistent_with_the_csv(explicit_run):
    out, _ = explicit_run
    rows = read_csv(out / "results.csv")
    summary = json.loads((out / "summary.json").read_text())
    pol = summary["policies"]
    for p in ("smetric", "lmetric", "least-load"):
        prs = [r for r in rows if r["policy"] == p]
        best = max(prs, key=lambda r: r["prefill_tps_within_slo"])
        assert pol[p]["peak_prefill_tps_within_slo"] == pytest.approx(best["prefill_tps_within_slo"])
        assert pol[p]["peak_rate"] == pytest.approx(best["rate"])
        ok = [r["rate"] for r in prs if r["slo_attainment"] >= 0.9]
        assert pol[p]["capacity"] == (pytest.approx(max(ok)) if ok else None)
    base = max(pol[p]["peak_prefill_tps_within_slo"] for p in ("lmetric", "least-load"))
    assert summary["smetric_vs_best_baseline"] == pytest.approx(
        pol["smetric"]["peak_prefill_tps_within_slo"] / base
    )
    assert summary["faithful_smetric_vs_best_baseline"] == pytest.approx(summary["smetric_vs_best_baseline"])
    caps = [pol[p]["capacity"] for p in ("lmetric", "least-load") if pol[p]["capacity"]]
    if caps and pol["smetric"]["capacity"]:
        assert summary["smetric_capacity_vs_best_baseline"] == pytest.approx(
            pol["smetric"]["capacity"] / max(caps)
        )
    # TTFT at SMetric's peak rate is read from that rate's rows
    ref = summary["smetric_peak_rate"]
    assert ref == pol["smetric"]["peak_rate"]
    for p in pol:
        row = next(r for r in rows if r["policy"] == p and r["rate"] == ref)
        assert pol[p]["at_smetric_peak_rate"]["ttft_p90"] == pytest.approx(row["ttft_p90"])
    # recomputing from the CSV alone gives the same ratios
    again = summarize(rows)
    assert again["smetric_vs_best_baseline"] == pytest.approx(summary["smetric_vs_best_baseline"])
    assert summary["upper_bound"]["prefill_tps"] > 0


def test_bench_searches_rates_without_rates(tmp_path):
    out = tmp_path / "auto"
    r = smetric(
        "bench",
        "--policies",
        "lmetric",
        "--out",
        str(out),
        "--jobs",
        "2",
        "--no-plots",
        "--max-rounds",
        "3",
        *TINY,
    )
    assert r.returncode == 0, r.stderr
    rows = read_csv(out / "results.csv")
    rates = sorted(r["rate"] for r in rows)
    assert len(rates) >= 5
    s = json.loads((out / "summary.json").read_text())
    peak = s["policies"]["lmetric"]["peak_rate"]
    # the sweep brackets the peak: a lower and a higher rate were run
    assert min(rates) < peak < max(rates)


def test_bench_experiment_settings_columns(tmp_path):
    out = tmp_path / "gt"
    r = smetric(
        "bench", "--experiment", "hyper", "--policies", "smetric", "--rates", "0.008", "--out", str(out),
        "--jobs", "1", "--no-plots", *TINY,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    rows = read_csv(out / "results.csv")
    labels = [r["setting"] for r in rows]
    assert "slack=0.5" in labels and "hit_ratio=0.9" in labels
    assert any(r["setting_params"] == "slack=0.5" for r in rows)
    s = json.loads((out / "summary.json").read_text())
    assert set(s["settings"]) == set(labels)


@pytest.mark.parametrize(
    "args,needle",
    [
        (["--policies", "nope"], "unknown policy"),
        (["--rates", "0.1,-1"], "--rates"),
        (["--rates", "abc"], "--rates"),
        (["--experiment", "nope"], "unknown experiment"),
        (["--trace", "/nonexistent.jsonl"], "no such trace"),
        (["--instances", "0"], "instances"),
        (["--jobs", "0"], "--jobs"),
        (["--global-tier", "-5"], "global tier"),
        (["--experiment", "slo", "--settings", "b=99"], "--settings"),
        (["--address", "127.0.0.1:6379"], "--address needs --executor ray"),
    ],
)
def test_bench_bad_input_is_one_line_exit_2(tmp_path, args, needle):
    r = smetric("bench", "--out", str(tmp_path / "x"), "--no-progress", "--policies", "lmetric", *args)
    assert r.returncode == 2, (r.returncode, r.stderr)
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and needle in lines[0], r.stderr
    assert "Traceback" not in r.stderr


def test_resummarize_recomputes_from_the_csv(explicit_run, tmp_path):
    import shutil

    out, _ = explicit_run
    copy = tmp_path / "copy"
    shutil.copytree(out, copy)
    before = json.loads((copy / "summary.json").read_text())
    (copy / "summary.json").unlink()
    r = smetric(
        "bench", "--out", str(copy), "--resummarize", "--no-plots", "--instances", "2", "--duration", "1200"
    )
    assert r.returncode == 0, r.stderr
    after = json.loads((copy / "summary.json").read_text())
    assert after["smetric_vs_best_baseline"] == pytest.approx(before["smetric_vs_best_baseline"])
    assert after["upper_bound"]["prefill_tps"] == pytest.approx(before["upper_bound"]["prefill_tps"])
    assert (copy / "summary.md").read_text().count("|") > 10


def test_bench_dispatch_axis_labels_runs_and_reports_the_tail(tmp_path):
    r = smetric(
        "bench",
        "--policies",
        "smetric,least-load",
        "--dispatch",
        "immediate,deadline-defer:age_k=2",
        "--rates",
        "0.008,0.016",
        "--out",
        str(tmp_path),
        "--jobs",
        "1",
        "--no-plots",
        *TINY,
    )
    assert r.returncode == 0, r.stderr
    rows = read_csv(tmp_path / "results.csv")
    assert len(rows) == 2 * 2 * 2
    assert {row["dispatch"] for row in rows} == {"immediate", "deadline-defer:age_k=2"}
    for k in ("over_2x_slo", "over_5x_slo", "queue_wait_p99", "rejected"):
        assert k in rows[0], k
    summary = json.loads((tmp_path / "summary.json").read_text())
    pol = summary["policies"]
    assert set(pol) == {
        "smetric",
        "least-load",
        "smetric+deadline-defer:age_k=2",
        "least-load+deadline-defer:age_k=2",
    }
    assert summary["dispatch_orders"] == ["deadline-defer:age_k=2", "immediate"]
    for p in pol.values():
        assert p["dispatch"] in ("immediate", "deadline-defer:age_k=2")
        at = p["at_smetric_peak_rate"]
        assert at["rate"] == summary["smetric_peak_rate"]
        row = next(
            x
            for x in rows
            if x["rate"] == at["rate"] and (x["policy"], x["dispatch"]) == (p["policy"], p["dispatch"])
        )
        assert at["ttft_p99"] == pytest.approx(row["ttft_p99"])
        assert at["over_5x_slo"] == pytest.approx(row["over_5x_slo"])
    assert "least-load+deadline-defer" in r.stdout


def test_bench_without_ray_runs_locally_and_names_the_extra_for_ray(tmp_path):
    # Ray made unimportable: the local executor needs none, --executor ray says what to install
    no_ray = "import sys; sys.modules['ray'] = None; from stack.cli import main; sys.exit(main(sys.argv[1:]))"
    common = ["bench", "--policies", "lmetric", "--rates", "0.004", "--jobs", "2", "--no-plots", *TINY]
    r = subprocess.run(
        [sys.executable, "-c", no_ray, *common, "--out", str(tmp_path / "local")],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert len(read_csv(tmp_path / "local" / "results.csv")) == 1
    r = subprocess.run(
        [sys.executable, "-c", no_ray, *common, "--executor", "ray", "--out", str(tmp_path / "ray")],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert r.returncode == 2, r.stderr
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and "--executor ray needs Ray" in lines[0] and "stack[ray]" in lines[0], r.stderr
    assert not (tmp_path / "ray").exists()


def test_bench_policy_pinned_to_one_order_is_not_crossed_with_the_axis(tmp_path):
    r = smetric(
        "bench",
        "--policies",
        "smetric-global+slack:age_k=2,least-load",
        "--rates",
        "0.008",
        "--out",
        str(tmp_path),
        "--jobs",
        "1",
        "--no-plots",
        *TINY,
    )
    assert r.returncode == 0, r.stderr
    rows = read_csv(tmp_path / "results.csv")
    assert sorted((row["policy"], row["dispatch"]) for row in rows) == [
        ("least-load", "immediate"),
        ("smetric-global", "slack:age_k=2"),
    ]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert set(summary["policies"]) == {"least-load", "smetric-global+slack:age_k=2"}
    assert summary["best_baseline"] == "least-load"
    bad = smetric("bench", "--policies", "least-load+nosuch", "--rates", "0.008", "--no-plots", *TINY)
    assert bad.returncode != 0 and "nosuch" in bad.stderr


def test_bench_colocation_experiment_scores_both_slos(tmp_path):
    out = tmp_path / "co"
    r = smetric(
        "bench", "--experiment", "colocation", "--settings", "colocated/full", "--policies",
        "smetric,lmetric", "--rates", "0.008,0.016", "--out", str(out), "--jobs", "1", "--no-plots", *TINY,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    rows = read_csv(out / "results.csv")
    assert {row["mode"] for row in rows} == {"colocated"} and len(rows) == 4
    co = json.loads((out / "colocation.json").read_text())["colocated/full"]
    for p in ("smetric", "lmetric"):
        mine = [row for row in rows if row["policy"] == p]
        best = max(row["tps_within_slo"] for row in mine)
        assert co["policies"][p]["peak"]["tps_within_slo"] == pytest.approx(best)
    assert "TPOT p90" in (out / "colocation.md").read_text()
