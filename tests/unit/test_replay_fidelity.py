"""Live against simulated (stack/replay/fidelity.py): the knee, spreads, gaps, the verdict."""

from __future__ import annotations

import pytest

from stack.replay import fidelity


def _curve(policy: str, rate: float) -> float:
    # attainment falls past a knee; "b" holds on longer than "a"
    knee = {"a": 0.10, "b": 0.14}[policy]
    return 0.9 if rate <= knee else max(0.0, 0.9 - 4 * (rate - knee))


def test_knee_is_where_the_best_baseline_keeps_its_share():
    rates = [round(0.02 * i, 2) for i in range(1, 16)]
    k = fidelity.knee_rate(_curve, ["a", "b"], rates, share=0.9)
    assert k.baseline == "b" and k.ceiling == pytest.approx(0.9) and k.target == pytest.approx(0.81)
    assert k.rate == 0.16 and k.attainment >= k.target  # 0.9 - 4*0.02 = 0.82 >= 0.81; 0.18 is not
    only_a = fidelity.knee_rate(_curve, ["a"], rates, share=0.9)
    assert only_a.rate == 0.12 and only_a.baseline == "a"
    with pytest.raises(ValueError):
        fidelity.knee_rate(_curve, [], rates)


def test_spread_gap_and_summary():
    s = fidelity.spread([10.0, 12.0, None, 14.0])
    assert (s.mean, s.lo, s.hi, s.n) == (12.0, 10.0, 14.0, 3) and s.rel == pytest.approx(2 / 12)
    assert fidelity.spread([]).mean is None and fidelity.gap(11.0, 10.0) == pytest.approx(0.1)
    assert fidelity.gap(None, 1.0) is None and fidelity.gap(1.0, 0.0) is None
    runs = [
        {"prefill_tps_within_slo": 95.0, "ttft_p50": 1.1, "errors": 0},
        {"prefill_tps_within_slo": 105.0, "ttft_p50": 1.3, "errors": 1},
    ]
    summ = fidelity.summarize_runs(runs, {"prefill_tps_within_slo": 100.0, "ttft_p50": 1.0})
    assert summ["prefill_tps_within_slo"]["gap"] == pytest.approx(0.0)
    assert summ["ttft_p50"]["gap"] == pytest.approx(0.2) and summ["errors"] == 1 and summ["runs"] == 2
    assert fidelity.within_tolerance(summ) == {"prefill_tps_within_slo": True, "ttft_p50": False}


def test_verdict_names_winner_lead_tail_and_agreement():
    runs = {
        "x": [{"prefill_tps_within_slo": 120.0, "ttft_p99": 10.0, "over_5x_slo": 0.01}] * 3,
        "y": [{"prefill_tps_within_slo": 100.0, "ttft_p99": 20.0, "over_5x_slo": 0.02}] * 3,
    }
    v = fidelity.verdict(runs, {"x": {"prefill_tps_within_slo": 50.0}, "y": {"prefill_tps_within_slo": 40.0}})
    assert v.startswith("verdict: x wins live by 1.20x") and "in 3 of 3 repeats" in v
    assert "x P99 TTFT 10.0 s, 1.0% past 5x SLO" in v and "simulator: x by 1.25x" in v and "agree" in v
    tie = fidelity.verdict(
        runs, {"x": {"prefill_tps_within_slo": 100.0}, "y": {"prefill_tps_within_slo": 99.5}}
    )
    assert "simulator: a tie (x by 1.01x): live and simulated DISAGREE" in tie  # live leads by 1.20x
    flipped = fidelity.verdict(
        runs, {"x": {"prefill_tps_within_slo": 1.0}, "y": {"prefill_tps_within_slo": 2.0}}
    )
    assert "DISAGREE" in flipped
    runs["y"] = [runs["y"][0], {"prefill_tps_within_slo": 130.0}, runs["y"][2]]  # y wins repeat 2
    v = fidelity.verdict(runs, None)
    assert v.startswith("verdict: x wins live") and "in 2 of 3 repeats" in v and "simulator" not in v
