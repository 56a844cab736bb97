"""CPU integration tier: `smetric calibrate` and the real-engine replay against real SGLang.

One real-worker group (1 prefill + 1 decode SGLang CPU worker over `mooncake_tcp`, each on one
pinned core, our router in front) runs `benchmarks/sglang_fidelity.py` in its quick form
(`--calibrate-through-router`): the pair is calibrated through the router (client-side timing);
the sweep's prefills, as the prefill worker timed them and the router recorded them, are
fitted again with `smetric calibrate --from` and the PD hand-off is measured on top
(`--handoff ROUTER`); the simulator runs the same arrivals with that file (and without the
hand-off), and the sessions are replayed through the router. The checks are about behaviour, not timing: the calibration file's
held-out error is computed from enough held-out points and is finite, every replayed request
completes, and both sides' figures are there. The full measurement (the `small` model, an
engine-side calibration, two replays) is the documented command in docs/research/simulator.md.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "sglang_cpu"))
from _locate import sglang_python, skip_or_fail, skip_reason  # noqa: E402

pytestmark = pytest.mark.sglang

#: the quick design: 5 new-token lengths x 3 prefixes, every 3rd point held out
DESIGN = (
    "--max-context 1024 --new-levels 5 --cached-levels 3 --holdout-every 3 --repeats 2 "
    "--decode-contexts 0 --token-ids 10:500 --time-factor 1"
)
MIN_HELD_OUT = 4
KEYS = ("ttft_p50", "ttft_p90", "ttft_p99", "prefill_tps_within_slo", "over_5x_slo")


@pytest.fixture(scope="module")
def fidelity(tmp_path_factory) -> dict:
    py = sglang_python()
    if py is None:
        skip_or_fail(skip_reason())
    if shutil.which("taskset") is None:
        skip_or_fail("taskset (util-linux) is not installed: the replay pins each worker to a core")
    out = tmp_path_factory.mktemp("sglang-fidelity")
    argv = [
        sys.executable,
        str(ROOT / "benchmarks" / "sglang_fidelity.py"),
        "--out",
        str(out),
        "--size",
        "tiny",
        "--context",
        "4096",
        "--calibrate-through-router",
        "--fit-under-load",
        "--calibrate-args",
        DESIGN,
        "--runs",
        "1",
        "--sessions",
        "8",
        "--first-blocks",
        "2:6",
        "--turns",
        "2:4",
        "--session-rate",
        "0.4",
        "--duration",
        "25",
        "--warmup",
        "3",
    ]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    r = subprocess.run(argv, capture_output=True, text=True, timeout=1200, env=env, cwd=ROOT)
    assert r.returncode == 0, (r.stdout[-4000:], r.stderr[-4000:])
    res = json.loads((out / "fidelity.json").read_text())
    res["stdout"] = r.stdout
    res["out"] = out
    return res


def test_calibration_held_out_error_is_measured(fidelity):
    path = Path(fidelity["calibration"])
    doc = yaml.safe_load(path.read_text())
    pf = doc["calibration"]["prefill"]
    assert pf["holdout_points"] >= MIN_HELD_OUT, pf
    assert pf["holdout_mape"] is not None and math.isfinite(pf["holdout_mape"]), pf
    assert doc["cost"]["c_linear"] >= 0 and doc["cost"]["c_fwd"] >= 0
    assert doc["calibration"]["timing_mode"] == "client"  # through the router: the client's clock
    # the file is a calibration the simulator takes
    from stack.core.cost_model import load_hardware

    assert load_hardware(str(path)).cost.cost(512, 1024) > 0


def test_the_hand_off_is_fitted_on_the_pair(fidelity):
    """`smetric calibrate --from OBSERVATIONS --handoff ROUTER` on the real PD pair: the
    prefill from the engine's own timings, the hand-off from first tokens through the router,
    scored on held-out lengths; the simulator takes the file."""
    from stack.core.cost_model import load_hardware

    path = Path(fidelity["calibration_pd"])
    doc = yaml.safe_load(path.read_text())
    ho = doc["calibration"]["handoff"]
    assert ho["through"].startswith("http://") and ho["holdout_points"] >= 1, ho
    assert math.isfinite(ho["ttft_holdout_mape"]) and math.isfinite(ho["residual_holdout_mape"]), ho
    hw = load_hardware(str(path))
    assert hw.handoff.bootstrap_s >= 0 and hw.handoff.transfer_gbps >= 0
    assert not hw.handoff.off  # a real PD pair's first token never comes for free
    assert hw.handoff_s(512) > 0
    assert fidelity["sim_without_handoff"]["requests"] == fidelity["sim"]["requests"]


def test_the_pair_is_calibrated_under_its_traffic(fidelity):
    """`--fit-under-load` on the real PD pair: a replay of other sessions recorded by the router;
    the prefill fitted from its lone prefills' engine timings, the hand-off from its recorded
    first tokens (`calibrate --from --handoff-from`); the simulator takes the file."""
    from stack.core.cost_model import load_hardware

    doc = yaml.safe_load(Path(fidelity["calibration_load"]).read_text())
    ho = doc["calibration"]["handoff"]
    assert ho["from_recording"].endswith("fit-recording.jsonl"), ho
    assert ho["train_points"] >= 2 and math.isfinite(ho["residual_train_mape"]), ho
    lines = [json.loads(x) for x in (fidelity["out"] / "fit-recording.jsonl").read_text().splitlines()]
    timed = [x for x in lines if x.get("prefill_forward_s") is not None]
    # the streamed PD requests of the fitting run carry the prefill worker's own timing (one
    # whose prefill half answered after the request ended is written without it)
    assert lines and len(timed) >= 0.8 * len(lines), lines[:2]
    assert all(x["ttft_ms"] / 1000 > x["prefill_forward_s"] for x in timed)
    hw = load_hardware(fidelity["calibration_load"])
    assert hw.handoff_s(512) > 0 and hw.cost.cost(512, 512) > 0
    assert hw.handoff.between_forwards  # SGLang's PD prefill loop hands over between forwards
    assert fidelity["sim_fitted_under_load"]["requests"] > 0
    assert "sim, fitted under load" in fidelity["table"]


def test_the_simulator_gets_the_prompts_as_sent(fidelity):
    """The replay's chat template adds tokens to each turn: the simulated trace carries them."""
    import gzip

    def lengths(name: str) -> list[int]:
        with gzip.open(fidelity["out"] / name, "rt") as fh:
            return [json.loads(x)["input_length"] for x in fh if x.strip()]

    nominal, sent = lengths("sessions.jsonl.gz"), lengths("sessions-as-sent.jsonl.gz")
    assert len(nominal) == len(sent) and all(b > a for a, b in zip(nominal, sent, strict=True))


def test_a_saved_invocation_resimulates_to_the_same_figures(fidelity, tmp_path):
    """`--resimulate DIR`: the saved fitting run fitted again and simulated on the saved trace
    and SLO, with no engine run, gives the invocation's own simulated figures."""
    argv = [sys.executable, str(ROOT / "benchmarks" / "sglang_fidelity.py"), "--out", str(tmp_path)]
    argv += ["--resimulate", str(fidelity["out"])]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    r = subprocess.run(argv, capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert r.returncode == 0, (r.stdout[-3000:], r.stderr[-3000:])
    again = json.loads((tmp_path / "fidelity.json").read_text())
    for k in KEYS:
        assert again["sim_fitted_under_load"][k] == fidelity["sim_fitted_under_load"][k], k
        assert again["sim"][k] == fidelity["sim"][k], k


def test_replay_completes_every_request(fidelity):
    [run] = fidelity["real"]
    assert run["errors"] == 0, (run["error_kinds"], run["error_examples"])
    assert run["requests"] > 0 and run["requests_total"] == run["requests_sent"], run


def test_both_sides_figures_present(fidelity):
    [run] = fidelity["real"]
    sim = fidelity["sim"]
    for k in KEYS:
        assert run.get(k) is not None and sim.get(k) is not None, (k, run.get(k), sim.get(k))
    assert sim["requests"] > 0
    for k in ("ttft_p50", "ttft_p90", "prefill_tps_within_slo"):
        assert k in fidelity["table"]
