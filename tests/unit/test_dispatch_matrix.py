"""The dispatch evidence matrix's judging (stack/bench/matrix.py): peaks, tolerances, the
tail checks at and past the best baseline's peak rate, the gain bar and the replica share."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

from stack.bench import matrix as M

CELL = M.Cell("c", M.AGENTIC, (0.12, 0.13, 0.14))
CAND = "smetric-global+slack:T=4"


def P(label: str, rate: float, tps: float, over5: float = 0.01, p99: float = 50.0) -> M.Point:
    return M.Point(label, rate, tps, p99, over5)


def _cell_points(cand_tps: tuple[float, float, float], cand_over5=(0.01, 0.02, 0.05)) -> list[M.Point]:
    pts = [P("least-load", 0.12, 700e3), P("least-load", 0.13, 800e3, 0.02), P("least-load", 0.14, 780e3)]
    pts += [P("lmetric", 0.12, 690e3), P("lmetric", 0.13, 760e3), P("lmetric", 0.14, 740e3)]
    pts += [P(CAND, r, t, o) for r, t, o in zip((0.12, 0.13, 0.14), cand_tps, cand_over5, strict=True)]
    pts += [P("least-load", 0.143, 600e3, 0.10), P(CAND, 0.143, 650e3, 0.08)]
    return pts


def test_peak_and_best_baseline():
    pts = _cell_points((710e3, 830e3, 850e3))
    assert M.peak(pts, CAND).rate == 0.14
    b = M.best_baseline(pts, M.BASELINES)
    assert (b.label, b.rate, b.tps) == ("least-load", 0.13, 800e3)
    assert M.past_peak_rate(0.13) == 0.143
    with pytest.raises(ValueError, match="no baseline"):
        M.best_baseline([P(CAND, 0.1, 1.0)], M.BASELINES)


def test_judge_meets_every_check_and_names_what_it_misses():
    v = M.judge(CELL, _cell_points((710e3, 830e3, 850e3), (0.01, 0.015, 0.05)), CAND, M.BASELINES, 0.01)
    assert v.ok and v.ratio == pytest.approx(850 / 800)
    assert v.cand_at_base.rate == 0.13 and v.cand_past.rate == 0.143 and v.base_past.over5 == 0.10
    # more past 5x at the baseline's peak rate than the baseline: the tail check fails alone
    v = M.judge(CELL, _cell_points((710e3, 830e3, 850e3), (0.01, 0.03, 0.05)), CAND, M.BASELINES, 0.01)
    assert v.checks == {"peak": True, "tail at peak": False, "tail past peak": True}
    # 1% below the baseline is inside a 2% tolerance, outside a 0.5% one
    low = _cell_points((700e3, 792e3, 780e3), (0.01, 0.01, 0.01))
    assert M.judge(CELL, low, CAND, M.BASELINES, 0.02).checks["peak"]
    assert not M.judge(CELL, low, CAND, M.BASELINES, 0.005).checks["peak"]
    # the gain bar of a held-out seed
    gc = M.Cell("g", M.AGENTIC, (0.12, 0.13, 0.14), gain_bar=1.07)
    v = M.judge(gc, _cell_points((710e3, 830e3, 850e3), (0.01, 0.015, 0.05)), CAND, M.BASELINES, 0.01)
    assert v.checks["gain >= 1.07"] is False
    # the candidate missing from the rows is an error, not a pass
    with pytest.raises(ValueError, match="did not run"):
        M.judge(CELL, _cell_points((1, 2, 3)), "smetric", M.BASELINES, 0.01)


def test_tolerance_is_the_seed_spread_of_the_group_else_one_percent():
    cells = [M.Cell(f"s{i}", M.AGENTIC, (0.1,), seed=i, group="g") for i in range(3)]
    cells.append(M.Cell("alone", M.SYNTHETIC, (7.0,)))
    tol = M.tolerances(cells, {"s0": 800.0, "s1": 820.0, "s2": 780.0, "alone": 5.0})
    assert tol["s0"] == tol["s2"] == pytest.approx(40 / 800)
    assert tol["alone"] == M.FLAT_TOLERANCE


def test_replica_share_and_labels():
    single = M.judge(CELL, _cell_points((710e3, 830e3, 880e3)), CAND, M.BASELINES, 0.01)  # x1.10
    multi = M.judge(CELL, _cell_points((710e3, 830e3, 865e3)), CAND, M.BASELINES, 0.01)  # x1.08125
    assert M.replica_check(multi, single)  # 81% of the gain kept
    multi = M.judge(CELL, _cell_points((710e3, 830e3, 860e3)), CAND, M.BASELINES, 0.01)  # x1.075
    assert not M.replica_check(multi, single)  # 75%
    assert (
        M.with_replicas("smetric-global+slack:T=4", 4)
        == "smetric-global+slack:T=4:replicas=4:replica_mode=claims"
    )
    assert M.with_replicas("x+slack:replica_mode=own", 2) == "x+slack:replica_mode=own:replicas=2"
    assert M.label_of(M.with_replicas("smetric-global+slack:T=4", 4))  # a spec the parser takes
    assert M.with_replicas("least-load", 4) == "least-load"
    assert M.with_replicas("smetric-global+immediate", 4) == "smetric-global+immediate"
    assert M.label_of("least-load") == "least-load"
    assert M.label_of("smetric-global+slack:T=4") == M.label_of("smetric-global+slack:max_queued_s=4")


def test_bench_argv_and_reading_rows(tmp_path: Path):
    c = M.Cell("x y", M.AGENTIC, (0.12,), seed=3, experiment="local-tier", setting="hbm=200k/shared")
    a = M.bench_argv(c, ["least-load", CAND], [0.12, 0.13], tmp_path, 2)
    assert a[:5] == ["bench", "--trace", M.AGENTIC, "--policies", f"least-load,{CAND}"]
    assert a[a.index("--seed") + 1] == "3" and a[a.index("--settings") + 1] == "hbm=200k/shared"
    assert c.key == "x_y"
    f = tmp_path / "results.csv"
    with f.open("w", newline="") as fh:
        w = csv.DictWriter(
            fh, ["policy", "dispatch", "rate", "prefill_tps_within_slo", "ttft_p99", "over_5x_slo"]
        )
        w.writeheader()
        w.writerow({"policy": "least-load", "dispatch": "immediate", "rate": 0.12, "prefill_tps_within_slo": 5,
                    "ttft_p99": 9, "over_5x_slo": 0.1})  # fmt: skip
        w.writerow({"policy": "smetric-global", "dispatch": "slack:T=4", "rate": 0.12, "prefill_tps_within_slo": 6,
                    "ttft_p99": 8, "over_5x_slo": 0.05})  # fmt: skip
    pts = M.read_points(f)
    assert [p.label for p in pts] == ["least-load", M.label_of(CAND)]
    text = M.table([M.judge(c, pts, M.label_of(CAND), ("least-load",), 0.01)])
    assert "x1.200" in text and "missed: tail past peak" in text
