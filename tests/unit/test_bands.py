"""The main job's rules of evidence (stack/replay/bands.py, stack/bench/main_job_report.py): a
winner only outside the band, live held to its band and chaos floor, a verdict whose words do
not move with a number's last digits, and no seed chosen behind the user's back."""

from __future__ import annotations

import argparse

import pytest

from stack.bench import main_job_report as R
from stack.replay import bands as B


def test_band_is_the_10th_to_90th_percentile_over_at_least_ten_values():
    b = B.band(list(range(1, 12)))  # 1..11
    assert (b.p10, b.median, b.p90, b.n) == (2.0, 6.0, 10.0, 11)
    assert b.half_width == pytest.approx(4 / 6)
    assert b.contains(2.0) and not b.contains(1.9) and b.contains(1.9, widen=0.1)
    with pytest.raises(ValueError, match="at least 10"):
        B.band([1.0] * 9)
    assert B.band([1.0] * 9 + [float("nan"), 2.0]).n == 10  # non-finite values do not count


def test_a_winner_is_named_only_when_the_whole_ratio_band_is_on_one_side_of_one():
    base = [100.0] * 10
    a_wins = B.compare("a", [105, 104, 106, 103, 105, 107, 104, 105, 106, 104], "b", base)
    assert a_wins.winner == "a" and a_wins.ratio.p10 > 1 and "a beats b" in a_wins.sentence()
    b_wins = B.compare("a", [95, 96, 94, 97, 95, 93, 96, 95, 94, 96], "b", base)
    assert b_wins.winner == "b" and "b beats a" in b_wins.sentence()
    # a median lead of 3% whose band reaches below 1: no winner
    tied = B.compare("a", [103, 108, 99, 97, 104, 103, 110, 98, 103, 105], "b", base)
    assert tied.ratio.median > 1.02 and tied.ratio.p10 < 1 < tied.ratio.p90
    assert tied.winner is None and "no clear winner" in tied.sentence()
    g = B.growth_needed(tied)
    assert g is not None and g > 1
    assert B.growth_needed(B.compare("a", [99, 101] * 5, "b", base)) is None  # medians tie exactly
    with pytest.raises(ValueError, match="same seeds"):
        B.ratios([1.0], [1.0, 2.0])


def test_live_claims_agree_unless_live_names_the_other_winner():
    base = [100.0] * 10
    c = B.compare("a", [105.0] * 10, "b", base)  # the model: a wins, x1.05
    assert B.live_claim(c, 1.04, floor=0.01) == ("a", True)
    assert B.live_claim(c, 1.005, floor=0.01) == (None, True)  # a tie within the floor is no evidence
    assert B.live_claim(c, 0.90, floor=0.01) == ("b", False)
    none = B.compare("a", [99, 101, 100, 102, 98, 100, 101, 99, 100, 100], "b", base)
    assert none.winner is None
    assert B.live_claim(none, 1.01, floor=0.005)[1] is True  # inside the model's ratio band
    assert B.live_claim(none, 1.30, floor=0.005) == ("a", False)  # a winner the model cannot see


def _runs(values):
    return [{"prefill_tps_within_slo": v} for v in values]


def test_scale_claim_compares_the_product_with_its_best_baseline_on_every_seed():
    runs = {"p": _runs([110, 112, 108]), "x": _runs([100, 101, 99]), "y": _runs([90, 90, 90])}
    c = R.scale_claim("p", runs)
    assert c.best == "x" and c.winner == "p" and "on every seed" in c.sentence()
    runs["x"] = _runs([100, 113, 99])  # one seed goes the other way
    c = R.scale_claim("p", runs)
    assert c.winner is None and "no clear winner" in c.sentence()
    with pytest.raises(ValueError):
        R.scale_claim("p", {"p": _runs([1, 2, 3])})


def test_verdict_words_depend_on_classes_not_on_digits():
    base = [100.0] * 10
    seed_runs = {"a": _runs([105.0 + i % 3 for i in range(10)]), "b": _runs(base)}
    comps = [B.compare("a", R.tps(seed_runs["a"]), "b", base)]

    def line(live_a):
        checks = R.live_checks(
            {"a": live_a, "b": 99.5}, {"a": 106.0, "b": 100.0}, seed_runs, {"a": 0.01, "b": 0.01}
        )
        claims = [(c, *B.live_claim(c, live_a / 99.5, 0.01)) for c in comps]
        return R.verdict(None, comps, claims, checks, 8)

    assert line(104.5) == line(106.9)  # two runs measuring the same thing
    assert "a beats b" in line(105.0) and "live agrees" in line(105.0)
    assert "every live figure in its band" in line(105.0)
    assert "OUTSIDE" in line(130.0)  # far above its band
    assert "DISAGREE" in line(80.0)  # live says b wins


def test_verdict_says_when_the_scale_cannot_tell():
    base = [100.0] * 10
    tied = B.compare("a", [103, 108, 99, 97, 104, 103, 110, 98, 103, 105], "b", base)
    text = R.verdict(None, [tied], [], [], 8)
    assert "cannot be told apart" in text and "x the sessions would be needed" in text


def test_demo_live_defaults_choose_no_seed_for_its_result():
    """The live run's seed is the first of the band's seeds, and the bands cover seeds 0..N-1:
    no seed outside that rule, and the verdict never reads the live seed's own simulation."""
    from stack.commands import demo_live

    p = argparse.ArgumentParser()
    demo_live.add_arguments(p)
    a = p.parse_args([])
    assert a.seed == 0 and a.seeds >= B.MIN_SEEDS and a.perturbations >= B.MIN_SEEDS
    assert a.trace.endswith("agentic_short.jsonl.gz")
    from stack.bench.main_job_run import validate

    with pytest.raises(ValueError, match="--seeds"):
        validate(p.parse_args(["--seeds", "3"]))
    long = p.parse_args(["--long"])
    validate(long)
    assert (long.duration, long.seeds, long.scale_seeds) == (1800.0, 20, 5)
