"""The main job at its default settings (8 prefill + 2 decode emulated workers in pools, real
mooncake_master, the knee rate the simulator chooses, time factor 0.1) has no errors: a
healthy run's errors are bugs. Shorter than the default run (200 modelled seconds of arrivals,
one policy) so that it fits the suite; the figures themselves are docs/research/fidelity.md's."""

from __future__ import annotations

import json

import pytest

from stack.launch.loopback import mooncake_skip_reason

_skip = mooncake_skip_reason()
pytestmark = [
    pytest.mark.slow,
    pytest.mark.mooncake,
    pytest.mark.timeout(420),
    pytest.mark.skipif(_skip is not None, reason=_skip or ""),
]


def test_default_main_job_has_no_errors(tmp_path):
    from stack.commands import demo_live

    out = tmp_path / "demo.json"
    argv = ["--policies", "lmetric", "--duration", "200", "--warmup", "50", "--no-sim"]
    assert demo_live.main([*argv, "--no-progress", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    s = res["settings"]
    assert (s["prefill"], s["decode"], s["workers_per_process"]) == (8, 2, 4)
    assert res["knee"]["rate"] == s["session_rate"] > 0
    (run,) = res["runs"]["lmetric"]
    assert run["requests"] > 0 and run["errors"] == 0, run.get("error_examples")
    assert run["model_clock"]["steps"] > 0
