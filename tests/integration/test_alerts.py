"""The alerting rules (deploy/prometheus/alerts.yaml) under Prometheus's own tool: `promtool check
rules` accepts them, `promtool test rules` passes deploy/prometheus/alerts_test.yaml, and that
file holds, for every alert, a time it must fire (labels and annotations given) and a time or
series it must stay quiet for. Whether the rules load and read metrics a live stack declares:
tests/e2e/test_dashboard.py. promtool comes with Debian's prometheus (.ci/install-system.sh)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from stack.launch.prometheus import ALERTS

TESTS = ALERTS.with_name("alerts_test.yaml")
K8S_SCRAPE = ALERTS.with_name("prometheus-k8s.yaml")


def _promtool(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    tool = shutil.which("promtool")
    if tool is None:
        raise RuntimeError("promtool is not on PATH (bash .ci/install-system.sh installs prometheus)")
    return subprocess.run([tool, *args], capture_output=True, text=True, timeout=120, cwd=cwd)


def _alerts() -> list[dict]:
    return [r for g in yaml.safe_load(ALERTS.read_text())["groups"] for r in g["rules"] if "alert" in r]


def _cases() -> list[tuple[str, list]]:
    """(alertname, expected alerts) of every alert_rule_test in the unit tests."""
    doc = yaml.safe_load(TESTS.read_text())
    return [
        (c["alertname"], c.get("exp_alerts") or [])
        for t in doc["tests"]
        for c in t.get("alert_rule_test", [])
    ]


def test_promtool_checks_the_rules():
    r = _promtool("check", "rules", str(ALERTS))
    assert r.returncode == 0, r.stdout + r.stderr
    assert (
        f"SUCCESS: {sum(len(g['rules']) for g in yaml.safe_load(ALERTS.read_text())['groups'])} rules found"
        in r.stdout
    )


def test_promtool_unit_tests_pass():
    r = _promtool("test", "rules", TESTS.name, cwd=TESTS.parent)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "SUCCESS" in r.stdout


@pytest.mark.parametrize("alert", [a["alert"] for a in _alerts()])
def test_every_alert_has_a_firing_and_a_quiet_case(alert):
    cases = [exp for name, exp in _cases() if name == alert]
    assert any(cases), f"{alert}: no unit test where it fires"
    assert any(not exp for exp in cases), f"{alert}: no unit test where it stays quiet"
    for exp in filter(None, cases):
        for a in exp:  # labels and annotations are compared whole: both must be written out
            assert a["exp_labels"]["severity"] in ("critical", "warning") and a["exp_annotations"]["summary"]


def test_every_alert_says_what_to_do():
    for a in _alerts():
        assert a["labels"]["severity"] in ("critical", "warning"), a["alert"]
        assert a["annotations"]["summary"] and len(a["annotations"]["description"]) > 40, a["alert"]


def test_a_broken_rule_fails_its_unit_test(tmp_path):
    """The unit tests bite: the same tests against rules whose fast-burn threshold is off fail."""
    (tmp_path / ALERTS.name).write_text(ALERTS.read_text().replace("> 14.4 * 0.05", "> 14.4 * 0.07"))
    (tmp_path / TESTS.name).write_text(TESTS.read_text())
    r = _promtool("test", "rules", TESTS.name, cwd=tmp_path)
    assert r.returncode != 0 and "SMetricSLOBurnRateFast" in r.stdout + r.stderr


def test_the_kubernetes_scrape_config_is_valid():
    """deploy/prometheus/prometheus-k8s.yaml (scrape jobs and relabelling for the manifests of
    stack/launch/k8s.py) passes `promtool check config`, with the rules it loads."""
    r = _promtool("check", "config", K8S_SCRAPE.name, cwd=K8S_SCRAPE.parent)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "SUCCESS" in r.stdout + r.stderr


def test_every_shipped_scrape_renames_sglangs_escaped_names_back(tmp_path):
    """SGLang 0.5.23's prometheus_client escapes ``sglang:x`` to ``sglang_x`` for a Prometheus
    2.x scrape: the worker job of every scrape config we ship renames it back (the local one
    passes `promtool check config` too)."""
    import re

    import yaml

    from stack.launch.prometheus import WORKER_JOB, scrape_config

    local = yaml.safe_load(scrape_config({WORKER_JOB: ["127.0.0.1:1"]}))
    k8s = yaml.safe_load(K8S_SCRAPE.read_text())
    for cfg in (local, k8s):
        (job,) = [j for j in cfg["scrape_configs"] if j["job_name"] == WORKER_JOB]
        (rule,) = job["metric_relabel_configs"]
        assert rule["source_labels"] == ["__name__"] and rule["target_label"] == "__name__"
        # the rename, as Prometheus applies it (an anchored RE2 match)
        m = re.fullmatch(rule["regex"], "sglang_num_running_reqs")
        assert m and rule["replacement"].replace("$1", m.group(1)) == "sglang:num_running_reqs"
        assert re.fullmatch(rule["regex"], "sglang:num_running_reqs") is None  # Prometheus 3.x: left alone
    (tmp_path / "prometheus.yml").write_text(scrape_config({WORKER_JOB: ["127.0.0.1:1"]}))
    r = _promtool("check", "config", "prometheus.yml", cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
