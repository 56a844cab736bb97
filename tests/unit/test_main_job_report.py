"""The main job's report as a person reads it (`smetric demo-live`): the product is called
`product` in every table and in the verdict, its full label printed once; every line fits 100
columns; the verdict is a few lines; the JSON keeps the full labels beside the names."""

from __future__ import annotations

import argparse
import json
import random

from rich.console import Console

from stack.bench import main_job as MJ
from stack.bench import main_job_report as R
from stack.bench.main_job_run import REPORT_WIDTH, report

PRODUCT_LABEL = MJ.DEFAULT_POLICIES[0]


def _fig(rng: random.Random, tps: float) -> dict:
    return {
        "prefill_tps_within_slo": tps * rng.uniform(0.97, 1.03),
        "slo_attainment": rng.uniform(0.6, 0.7),
        "ttft_p50": 1.2,
        "ttft_p90": 5.5,
        "ttft_p99": 33.0,
        "over_5x_slo": 0.02,
        "queue_wait_mean": 0.4,
        "queue": {"queue_wait_mean": 0.4},
        "requests": 558,
        "errors": 0,
        "model_clock": {"resyncs": 0},
    }


def _inputs(tmp_path):
    rng = random.Random(0)
    pols, extra = [PRODUCT_LABEL, "lmetric"], ["least-load"]
    base = {PRODUCT_LABEL: 52_000.0, "lmetric": 47_000.0, "least-load": 50_000.0, "dynamo": 40_000.0}
    scale = {
        p: [_fig(rng, base[p] * 17) for _ in range(3)]
        for p in (PRODUCT_LABEL, "least-load", "lmetric", "dynamo")
    }
    seed_runs = {p: [_fig(rng, base[p]) for _ in range(10)] for p in pols + extra}
    perturbed = {p: [_fig(rng, base[p]) for _ in range(10)] for p in pols}
    runs = {p: [_fig(rng, base[p])] for p in pols}
    sims = {p: _fig(rng, base[p]) for p in pols}
    args = argparse.Namespace(
        prefill=8,
        decode=2,
        trace="stack/data/agentic_short.jsonl.gz",
        session_rate=0.34,
        duration=600.0,
        seed=0,
        repeat=1,
        seeds=10,
        out=str(tmp_path / "out.json"),
    )
    return args, pols, extra, scale, seed_runs, perturbed, runs, sims


def test_the_report_names_the_product_and_fits_100_columns(tmp_path):
    args, pols, extra, scale, seed_runs, perturbed, runs, sims = _inputs(tmp_path)
    console = Console(width=REPORT_WIDTH, record=True, color_system=None)
    report(args, console, pols, extra, None, scale, seed_runs, perturbed, runs, sims, {})
    text = console.export_text()
    lines = text.splitlines()
    # the definition once, in the legend; everywhere else: "product"
    assert text.count(PRODUCT_LABEL) == 1 and f"product = {PRODUCT_LABEL}" in text
    too_wide = [ln for ln in lines if len(ln) > REPORT_WIDTH and PRODUCT_LABEL not in ln]
    assert not too_wide, too_wide
    assert "product beats" in text or "product and" in text or "no clear winner" in text
    verdict = [i for i, ln in enumerate(lines) if ln.startswith("verdict: ")]
    assert len(verdict) == 1 and len(lines) - verdict[0] <= 6  # a few lines, the report's last but the JSON's
    doc = json.loads((tmp_path / "out.json").read_text())
    assert doc["names"][PRODUCT_LABEL] == "product"
    assert set(doc["runs"]) == set(pols) and doc["comparisons"][0]["a"] == PRODUCT_LABEL  # full labels
    assert doc["verdict"].startswith("verdict: ") and PRODUCT_LABEL not in doc["verdict"]


def test_display_names():
    names = R.display_names(
        [PRODUCT_LABEL, "lmetric", "smetric+deadline-defer:age_k=2:far_k=5", "x"], PRODUCT_LABEL
    )
    assert names == {
        PRODUCT_LABEL: "product",
        "lmetric": "lmetric",
        "smetric+deadline-defer:age_k=2:far_k=5": "P1",
        "x": "x",
    }
    show = R.renamer(names)
    assert show(f"{PRODUCT_LABEL} beats lmetric; P1 vs x") == "product beats lmetric; P1 vs x"
    assert R.legend(names) == [f"product = {PRODUCT_LABEL}", "P1 = smetric+deadline-defer:age_k=2:far_k=5"]
