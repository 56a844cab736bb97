"""Summary definitions (peak, capacity, ratios) and the rate search, on synthetic rows."""

from __future__ import annotations

import pytest

from stack.bench.experiments import EXPERIMENTS, parse_policies, parse_rates
from stack.bench.rate_search import coarse_grid, next_rates
from stack.bench.runner import quantiles
from stack.bench.summary import capacity, read_csv, summarize, write_csv


def row(policy, rate, tps, att, p90=1.0, setting="default"):
    return {
        "setting": setting, "policy": policy, "rate": rate, "prefill_tps_within_slo": tps,
        "slo_attainment": att, "ttft_p50": 0.5, "ttft_p90": p90,
    }  # fmt: skip


ROWS = [
    row("smetric", 1, 100, 0.99, 1.0), row("smetric", 2, 190, 0.95, 2.0), row("smetric", 3, 210, 0.85, 3.0),
    row("smetric", 4, 150, 0.5, 9.0),
    row("smetric-global", 1, 100, 0.99), row("smetric-global", 2, 200, 0.92), row("smetric-global", 3, 205, 0.91),
    row("lmetric", 1, 100, 0.99, 1.1), row("lmetric", 2, 195, 0.93, 2.5), row("lmetric", 3, 180, 0.7, 4.0),
    row("dynamo", 1, 100, 0.98, 1.2), row("dynamo", 2, 180, 0.89, 3.0),
]  # fmt: skip


def test_capacity_is_the_highest_rate_with_90pct_attainment():
    assert capacity([row("x", 1, 1, 0.95), row("x", 2, 1, 0.5), row("x", 3, 1, 0.9)]) == 3
    assert capacity([row("x", 1, 1, 0.89)]) is None


def test_summary_ratios():
    s = summarize(ROWS)
    p = s["policies"]
    assert p["smetric"]["peak_prefill_tps_within_slo"] == 210 and p["smetric"]["peak_rate"] == 3
    assert p["smetric"]["capacity"] == 2 and p["smetric-global"]["capacity"] == 3
    assert p["lmetric"]["capacity"] == 2 and p["dynamo"]["capacity"] == 1
    assert s["best_smetric"] == "smetric" and s["best_baseline"] == "lmetric"
    assert s["smetric_vs_best_baseline"] == pytest.approx(210 / 195)
    assert s["smetric_capacity_vs_best_baseline"] == pytest.approx(3 / 2)
    assert s["faithful_smetric_vs_best_baseline"] == pytest.approx(210 / 195)
    assert s["faithful_smetric_capacity_vs_best_baseline"] == pytest.approx(2 / 2)
    # latencies at SMetric's peak rate (3); dynamo lacks rate 3: its nearest rate (2)
    assert s["smetric_peak_rate"] == 3
    assert p["lmetric"]["at_smetric_peak_rate"]["ttft_p90"] == 4.0
    assert p["dynamo"]["at_smetric_peak_rate"]["rate"] == 2
    assert s["smetric_ttft_p90_vs_best_baseline"] == pytest.approx(3.0 / 4.0)


def test_summary_per_setting_and_csv_roundtrip(tmp_path):
    rows = ROWS + [row("smetric", 1, 50, 0.95, setting="b=2"), row("lmetric", 1, 100, 0.95, setting="b=2")]
    s = summarize(rows)
    assert list(s["settings"]) == ["default", "b=2"]
    assert s["settings"]["b=2"]["smetric_vs_best_baseline"] == pytest.approx(0.5)
    write_csv(tmp_path / "r.csv", rows)
    back = read_csv(tmp_path / "r.csv")
    assert summarize(back)["settings"]["b=2"]["smetric_vs_best_baseline"] == pytest.approx(0.5)
    assert back[0]["rate"] == 1 and back[0]["setting"] == "default"


def test_no_baseline_gives_no_ratio():
    s = summarize([row("smetric", 1, 10, 0.95)])
    assert s["smetric_vs_best_baseline"] is None and s["best_baseline"] is None


def test_terminal_table_shows_the_setting_label_and_says_when_there_is_no_baseline():
    from rich.console import Console

    from stack.bench.report import print_summary

    s = summarize([row("smetric", 1, 10, 0.95, setting="slack=0")])
    con = Console(record=True, width=200)
    print_summary(s, "sessions/s", console=con)
    text = con.export_text()
    assert "[slack=0]" in text  # not eaten as rich markup
    assert "no baseline in this run" in text and "best baseline (None)" not in text


def test_search_extends_while_rising_and_refines_the_peak():
    rows = {r: {"prefill_tps_within_slo": r * 10, "slo_attainment": 1.0} for r in (1.0, 2.0)}
    assert max(next_rates(rows)) > 2.0  # still rising at the top
    rows = {1.0: {"prefill_tps_within_slo": 10, "slo_attainment": 1.0},
            2.0: {"prefill_tps_within_slo": 30, "slo_attainment": 0.95},
            4.0: {"prefill_tps_within_slo": 5, "slo_attainment": 0.1}}  # fmt: skip
    new = next_rates(rows)
    assert any(1.0 < r < 2.0 for r in new) and any(2.0 < r < 4.0 for r in new)
    dense = {
        1.0 + 0.01 * k: {"prefill_tps_within_slo": 10 - abs(k - 5), "slo_attainment": 0.95 if k <= 5 else 0.5}
        for k in range(11)
    }
    assert next_rates(dense) == []  # resolved within a few percent
    assert coarse_grid(1.0)[0] < 1.0 < coarse_grid(1.0)[-1]


def test_parsers_and_experiments():
    assert parse_rates("0.2,0.1,0.1") == [0.1, 0.2]
    with pytest.raises(ValueError):
        parse_rates("0")
    with pytest.raises(ValueError):
        parse_policies("smetric,bogus", ())
    assert "smetric" in parse_policies("all", ())
    assert [s for s in EXPERIMENTS["ablation"].policies][:4] == [
        "smetric-basic",
        "smetric-load",
        "smetric-tokens",
        "smetric",
    ]
    labels = [s.label for s in EXPERIMENTS["global-tier"].settings]
    assert "none" in labels and "full/shared" in labels and "full/per-gpu" in labels
    assert [s.instances for s in EXPERIMENTS["scale"].settings] == [8, 16, 32, 64, 128]
    assert quantiles([3, 1, 2], 2) == [1, 2, 3]


def test_slo_settings_use_the_command_line_units():
    from stack.bench.runner import setting_options
    from stack.sim.options import SimOptions

    base = SimOptions(trace="unused")
    slos = {s.label: setting_options(base, s).sim_config({}).slo for s in EXPERIMENTS["slo"].settings}
    assert slos["a=125ms"].a == pytest.approx(125e-6) and slos["a=125ms"].b == 1.0
    assert slos["b=2"].b == 2.0 and slos["b=2"].a == pytest.approx(62.5e-6)
