"""The Grafana dashboard (deploy/grafana/stack-dashboard.json) against a real Prometheus: `smetric
up --prometheus` starts a small emulated PD stack (two router replicas sharing a Redis, the
Mooncake master as the global tier) with Prometheus scraping it every second and evaluating
deploy/prometheus/alerts.yaml, the test sends traffic (streamed and collected chats over several
sessions, a few malformed bodies), then every panel's queries, Grafana's variables substituted,
must return data from router, worker or Mooncake master metrics. Negative checks: a renamed
metric, a constant query and a selector matching nothing each fail the check. The alerting rules
load and evaluate there, and every metric they read is one the stack declares. The same panels
against real SGLang workers: tests/e2e/test_sglang_cpu.py (the CPU tier)."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import yaml

from stack import dashboard
from stack.launch.prometheus import ALERTS, api_get, require_prometheus

pytestmark = pytest.mark.timeout(180)

#: metrics another change of issue 29 adds; a panel reading only these is skipped while they are
#: missing. LEAD: remove this entry once the router.auth branch (item 1: the per-key request
#: counter) is merged; the "Requests by API key" panel must then pass like the others.
PENDING_METRICS: dict[str, str] = {}  # metric -> why a panel on it may have no data yet (none now)
KEY = "sk-dashboard-test-key"

DASH = dashboard.load()
TITLES = [q.panel for q in dashboard.queries(DASH)]
TITLES = list(dict.fromkeys(TITLES))

CONFIG = """
model: {name: tiny, page_size: 16, context_length: 32768}
router: {policy: smetric, global_tier: mooncake, health_interval_s: 0.5, auth: {keys_file: KEYS_FILE}}
launch:
  engine: emulate
  tokenizer: tiny
  prefill: {count: 2, workers_per_process: 2}
  decode: {count: 1}
  emulator: {time_factor: 0.01, stream_interval: 1, kv_transport: http}
  prometheus: {scrape_interval_s: 1}
  router: {replicas: 2}
"""


def _smetric(*args: str, timeout: float = 90) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "stack.cli", *args], capture_output=True, text=True, timeout=timeout
    )


def _traffic(routers: list[str], seconds: float) -> dict[int, int]:
    """Chats from 6 sessions (growing histories: sticks and local hits), streamed and not, plus
    a malformed body now and then, the sessions spread over the router replicas; returns the
    count of each status."""
    statuses: dict[int, int] = {}
    lock = threading.Lock()
    stop = time.monotonic() + seconds

    def session(i: int) -> None:
        msgs = [{"role": "system", "content": f"You are coding agent {i}."}]
        router = routers[i % len(routers)]
        with httpx.Client(base_url=router, timeout=30, headers={"Authorization": f"Bearer {KEY}"}) as c:
            n = 0
            while time.monotonic() < stop:
                n += 1
                msgs.append({"role": "user", "content": f"session {i} turn {n}: fix module_{i}.py " * 20})
                if n % 7 == 0:  # malformed: counted as an error of kind bad_request
                    r = c.post(
                        "/v1/chat/completions", content=b"{oops", headers={"content-type": "application/json"}
                    )
                else:
                    body = {"model": "tiny", "messages": msgs, "max_tokens": 8, "stream": n % 3 != 0}
                    r = c.post("/v1/chat/completions", json=body)
                    msgs.append({"role": "assistant", "content": f"done {n}"})
                with lock:
                    statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
                time.sleep(0.05)

    threads = [threading.Thread(target=session, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return statuses


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    """(Prometheus URL, window start, window end, results by panel title, `smetric up`'s JSON line)
    after the traffic."""
    require_prometheus()
    tmp = tmp_path_factory.mktemp("dash")
    cfg = tmp / "stack.yaml"
    keys = tmp / "keys.yaml"
    keys.write_text(f"keys:\n  - {{name: dashboard, key: {KEY}}}\n")
    cfg.write_text(CONFIG.replace("KEYS_FILE", str(keys)))
    run_dir = tmp / "run"
    up = _smetric(
        "up", "--config", str(cfg), "--prometheus", "--ports", "auto", "--run-dir", str(run_dir), "--detach"
    )
    try:
        assert up.returncode == 0, up.stderr[-3000:]
        info = json.loads(up.stdout.strip().splitlines()[-1])
        prom = info["prometheus_url"]
        assert prom and len(info["router_urls"]) == 2
        start = time.time()
        statuses = _traffic(info["router_urls"], seconds=8.0)
        assert statuses.get(200, 0) > 50 and statuses.get(400, 0) > 0, statuses
        time.sleep(2.5)  # the last scrapes
        end = time.time()
        results = dashboard.check(DASH, prom, start, end, step_s=1.0, scrape_s=1.0, pending=PENDING_METRICS)
        yield prom, start, end, {r.panel: r for r in results}, info
    finally:
        _smetric("down", "--run-dir", str(run_dir), timeout=60)


@pytest.mark.parametrize("title", TITLES)
def test_panel_returns_data_from_router_worker_or_mooncake_metrics(live, title):
    r = live[3][title]
    if r.skipped:
        pytest.skip("; ".join(r.reasons))
    assert r.ok, "\n".join(r.reasons)
    assert r.metrics and all(m.startswith(("smetric_", "sglang:", "master_")) for m in r.metrics)


def _one_panel(title: str, expr_of) -> dict:
    """A copy of the dashboard with only panel ``title``, its queries rewritten by ``expr_of``."""
    d = copy.deepcopy(DASH)
    d["panels"] = [p for p in d["panels"] if p.get("title") == title]
    for t in d["panels"][0]["targets"]:
        t["expr"] = expr_of(t["expr"])
    return d


@pytest.mark.parametrize(
    "title, rewrite, why",
    [
        (
            "TTFT quantiles (router)",
            lambda e: e.replace("smetric_ttft_seconds_bucket", "smetric_ttft_renamed_seconds_bucket"),
            "declared by no scraped target: smetric_ttft_renamed_seconds_bucket",
        ),
        (  # a misspelt counter in front of an `or` fallback: the fallback's zeros do not hide it
            "KV events applied and gaps",
            lambda e: e.replace("smetric_kv_event_gaps_total", "smetric_kv_event_gapz_total"),
            "declared by no scraped target: smetric_kv_event_gapz_total",
        ),
        (
            "Mooncake keys and clients",
            lambda e: e.replace("master_key_count", "master_keys_count"),
            "declared by no scraped target: master_keys_count",
        ),
        ("Request rate by endpoint", lambda e: "vector(1)", "selects no router, worker or Mooncake metric"),
        ("Queue depth", lambda e: e.replace('job="$router_job"', 'job="no-such-job"'), "no data"),
    ],
)
def test_the_check_fails_a_broken_panel(live, title, rewrite, why):
    prom, start, end, _, _ = live
    (r,) = dashboard.check(_one_panel(title, rewrite), prom, start, end, step_s=1.0, scrape_s=1.0)
    assert not r.ok and any(why in x for x in r.reasons), r.reasons


def test_the_dashboard_covers_what_operators_ask_for():
    want = [
        "Request rate",
        "Errors by kind and endpoint",
        "TTFT quantiles",
        "TPOT quantiles",
        "Prefill TPS within SLO",
        "Routing decisions by kind",
        "Hit ratios (local, global)",
        "Queue depth",
        "Queue wait",
        "Queue rejections",
        "per worker",
        "Worker health",
        "KV-event lag",
        "API key",
        "KV events applied and gaps",
        "Ejections and retries",
        "Upstream errors by role",
        "Mooncake store memory",
        "Mooncake requests",
    ]
    for w in want:
        assert any(w in t for t in TITLES), w
    for q in dashboard.queries(DASH):
        assert dashboard.METRIC.search(q.expr), q


def test_grafana_variables_are_substituted():
    v = {**dashboard.defaults(DASH), **dashboard.grafana_vars(step_s=15, scrape_s=5, range_s=900)}
    assert v["router_job"] == "smetric-router" and v["worker_job"] == "smetric-workers"
    assert v["mooncake_job"] == "smetric-mooncake"
    got = dashboard.substitute(
        'rate(x{job="$router_job",w="${worker_job}"}[$__rate_interval]) [[__interval]]', v
    )
    assert got == 'rate(x{job="smetric-router",w="smetric-workers"}[20000ms]) 15000ms'
    with pytest.raises(ValueError, match=r"\$nope"):
        dashboard.substitute('x{job="$nope"}', v)


def test_the_dashboard_is_valid_grafana_json():
    d = json.loads(Path(dashboard.DASHBOARD).read_text())
    ids = [p["id"] for p in d["panels"]]
    assert len(ids) == len(set(ids))
    for p in d["panels"]:
        assert {"type", "title", "gridPos"} <= set(p)
        if p["type"] != "row":
            assert p["datasource"]["uid"] == "${datasource}" and p["targets"]
            assert all(t["refId"] and t["expr"] for t in p["targets"])


def test_worker_series_carry_the_workers_url(live):
    """The scrape relabels every worker series with the worker's URL (the router's own label for
    it), the emulator's as SGLang's: the per-worker panels group by it."""
    prom, info = live[0], live[4]
    series = api_get(prom, "query", query='sglang:num_running_reqs{job="smetric-workers"}')["result"]
    got = {s["metric"].get("worker") for s in series}
    assert got == set(info["prefill"]) | set(info["decode"]), got
    # the emulator's own label (its name) is kept beside it
    assert {s["metric"].get("exported_worker") for s in series} == {"prefill-0", "prefill-1", "decode-0"}


def _alert_rules() -> list[dict]:
    return [r for g in yaml.safe_load(ALERTS.read_text())["groups"] for r in g["rules"]]


def test_alert_rules_load_and_evaluate_on_the_stack(live):
    """Prometheus beside `smetric up` loads deploy/prometheus/alerts.yaml and evaluates every rule
    without an error; none fires on a healthy stack but those that need hours of history."""
    prom = live[0]
    deadline = time.monotonic() + 10
    while True:
        groups = api_get(prom, "rules")["groups"]
        rules = [r for g in groups for r in g["rules"]]
        if rules and all(r.get("lastEvaluation", "").startswith("2") and r["health"] == "ok" for r in rules):
            break
        assert time.monotonic() < deadline, [(r["name"], r["health"], r.get("lastError")) for r in rules]
        time.sleep(0.5)
    want = {r.get("alert") or r.get("record") for r in _alert_rules()}
    assert {r["name"] for r in rules} == want
    firing = {a["labels"]["alertname"] for a in api_get(prom, "alerts")["alerts"] if a["state"] == "firing"}
    assert not firing & {
        "SMetricRouterDown",
        "SMetricSharedStateDown",
        "SMetricNoHealthyWorkers",
        "SMetricMooncakeMasterDown",
        "SMetricWorkerScrapeDown",
    }, firing


def test_alerts_read_metrics_the_stack_declares(live):
    """Every router, worker and Mooncake metric an alert reads is declared by a scraped target of
    the live stack (a misspelt name would make the alert silently never fire)."""
    known = dashboard.declared(live[0])
    for r in _alert_rules():
        used = set(dashboard.METRIC.findall(r["expr"]))
        assert used <= known, (r.get("alert") or r.get("record"), sorted(used - known))
