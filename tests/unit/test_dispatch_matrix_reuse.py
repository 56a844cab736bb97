"""benchmarks/dispatch_matrix.py --baselines-from: a second candidate reads the baselines' runs
of a first candidate's matrix and runs only itself; the verdicts match running everything."""

from __future__ import annotations

import csv
import importlib.util
import json
import sys
from pathlib import Path

import pytest

from stack.bench import matrix as M

ROOT = Path(__file__).resolve().parents[2]
C0 = "smetric-global+deadline-defer"
C1 = "smetric-global+deadline-defer:age_k=1:aged_share=0:far_k=5"
BASELINES = "least-load,lmetric"


def _script():
    spec = importlib.util.spec_from_file_location(
        "dispatch_matrix", ROOT / "benchmarks" / "dispatch_matrix.py"
    )
    mod = importlib.util.module_from_spec(spec)
    sys.modules["dispatch_matrix"] = mod  # its dataclasses look their module up
    spec.loader.exec_module(mod)  # type: ignore[union-attr]
    return mod


def _tps(label: str, rate: float, perturb: int | None) -> float:
    """A made-up curve per label: peaks in the grid, a little noise per perturbation."""
    top = {"least-load": 0.13, "lmetric": 0.14}.get(label, 0.15)
    scale = {"least-load": 700e3, "lmetric": 720e3}.get(label, 800e3 + 10e3 * len(label) % 7)
    return scale * (1 - 4 * (rate - top) ** 2 / top**2) * (1 + 0.002 * (perturb or 0))


@pytest.fixture
def fake(monkeypatch):
    mod = _script()
    calls: list[list[str]] = []

    def run_bench(argv: list[str], log: Path) -> None:
        out = Path(argv[argv.index("--out") + 1])
        if (out / "results.csv").exists():
            return
        calls.append(argv)
        specs = argv[argv.index("--policies") + 1].split(",")
        rates = [float(r) for r in argv[argv.index("--rates") + 1].split(",")]
        perturb = int(argv[argv.index("--perturb") + 1]) if "--perturb" in argv else None
        out.mkdir(parents=True, exist_ok=True)
        with (out / "results.csv").open("w", newline="") as f:
            w = csv.writer(f)
            w.writerow(
                [
                    "policy",
                    "dispatch",
                    "rate",
                    "prefill_tps_within_slo",
                    "ttft_p99",
                    "over_5x_slo",
                    "slo_attainment",
                    "failed_after_retries",
                    "session_slowdown_p90",
                    "ttft_max",
                ]
            )
            for s in specs:
                policy, order = M.split_policy(s)
                label = M.label_of(s)
                dispatch = "" if order is None else label.split("+", 1)[1]
                for r in rates:
                    w.writerow(
                        [
                            policy,
                            dispatch,
                            r,
                            _tps(label, r, perturb),
                            50 * r / 0.13,
                            0.01,
                            0.95 - (r - 0.12),
                            50,
                            1.2,
                            600,
                        ]
                    )

    monkeypatch.setattr(mod, "run_bench", run_bench)
    return mod, calls


def _main(mod, *extra: str) -> dict:
    argv = [
        "--matrix",
        "protocol",
        "--cells",
        "agentic s0,agentic s1",
        "--clients",
        "--chaos",
        "2",
        "--baselines",
        BASELINES,
        "--jobs",
        "1",
        *extra,
    ]
    mod.main(argv)
    out = Path(extra[extra.index("--out") + 1])
    return json.loads((out / "matrix.json").read_text())


def test_baselines_from_runs_only_the_candidate_and_judges_alike(fake, tmp_path: Path):
    mod, calls = fake
    first = _main(mod, "--candidate", C0, "--out", str(tmp_path / "c0"))
    n_first = len(calls)
    assert any("least-load" in a[a.index("--policies") + 1] for a in calls)
    calls.clear()
    # the same candidate again, once from scratch and once reusing: the same verdicts
    whole = _main(mod, "--candidate", C1, "--out", str(tmp_path / "c1-whole"))
    calls.clear()
    reuse = _main(
        mod, "--candidate", C1, "--out", str(tmp_path / "c1"), "--baselines-from", str(tmp_path / "c0")
    )
    # only the candidate ran: two cells, grid and 1.1x each, no chaos runs
    assert len(calls) == 4 < n_first
    assert all(a[a.index("--policies") + 1] == C1 for a in calls)
    assert reuse["baselines_from"] == str(tmp_path / "c0") and whole["baselines_from"] is None
    assert reuse["cells"] == whole["cells"]
    assert first["cells"][0]["cell"] == reuse["cells"][0]["cell"]


def test_baselines_from_a_missing_or_different_run_is_refused(fake, tmp_path: Path):
    mod, _ = fake
    with pytest.raises(SystemExit, match="is missing"):
        _main(
            mod, "--candidate", C1, "--out", str(tmp_path / "c1"), "--baselines-from", str(tmp_path / "none")
        )
    _main(mod, "--candidate", C0, "--out", str(tmp_path / "c0"), "--baselines", "least-load")
    with pytest.raises(SystemExit, match="has no lmetric"):
        _main(mod, "--candidate", C1, "--out", str(tmp_path / "c2"), "--baselines-from", str(tmp_path / "c0"))
