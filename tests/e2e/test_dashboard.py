"""The Grafana dashboard (deploy/grafana/stack-dashboard.json) against a real Prometheus: `smetric
up --prometheus` starts a small emulated PD stack with Prometheus scraping it every second, the
test sends traffic (streamed and collected chats over several sessions, a few malformed bodies),
then every panel's queries, Grafana's variables substituted, must return data from router or
worker metrics. Negative checks: a renamed metric, a constant query and a selector matching
nothing each fail the check."""

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

from stack import dashboard
from stack.launch.prometheus import require_prometheus

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
router: {policy: smetric, global_tier: written, health_interval_s: 0.5, auth: {keys_file: KEYS_FILE}}
launch:
  engine: emulate
  tokenizer: tiny
  prefill: {count: 2, workers_per_process: 2}
  decode: {count: 1}
  mooncake_master: null
  emulator: {time_factor: 0.01, stream_interval: 1, kv_transport: http}
  prometheus: {scrape_interval_s: 1}
"""


def _smetric(*args: str, timeout: float = 90) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "stack.cli", *args], capture_output=True, text=True, timeout=timeout
    )


def _traffic(router: str, seconds: float) -> dict[int, int]:
    """Chats from 6 sessions (growing histories: sticks and local hits), streamed and not, plus
    a malformed body now and then; returns the count of each status."""
    statuses: dict[int, int] = {}
    lock = threading.Lock()
    stop = time.monotonic() + seconds

    def session(i: int) -> None:
        msgs = [{"role": "system", "content": f"You are coding agent {i}."}]
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
    """(Prometheus URL, window start, window end, results by panel title) after the traffic."""
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
        assert prom and info["router_url"]
        start = time.time()
        statuses = _traffic(info["router_url"], seconds=8.0)
        assert statuses.get(200, 0) > 50 and statuses.get(400, 0) > 0, statuses
        time.sleep(2.5)  # the last scrapes
        end = time.time()
        results = dashboard.check(DASH, prom, start, end, step_s=1.0, scrape_s=1.0, pending=PENDING_METRICS)
        yield prom, start, end, {r.panel: r for r in results}
    finally:
        _smetric("down", "--run-dir", str(run_dir), timeout=60)


@pytest.mark.parametrize("title", TITLES)
def test_panel_returns_data_from_router_or_worker_metrics(live, title):
    r = live[3][title]
    if r.skipped:
        pytest.skip("; ".join(r.reasons))
    assert r.ok, "\n".join(r.reasons)
    assert r.metrics and all(m.startswith(("smetric_", "sglang:")) for m in r.metrics)


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
            "unknown to Prometheus: smetric_ttft_renamed_seconds_bucket",
        ),
        ("Request rate by endpoint", lambda e: "vector(1)", "selects no router or worker metric"),
        ("Queue depth", lambda e: e.replace('job="$router_job"', 'job="no-such-job"'), "no data"),
    ],
)
def test_the_check_fails_a_broken_panel(live, title, rewrite, why):
    prom, start, end, _ = live
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
    ]
    for w in want:
        assert any(w in t for t in TITLES), w
    for q in dashboard.queries(DASH):
        assert dashboard.METRIC.search(q.expr), q


def test_grafana_variables_are_substituted():
    v = {**dashboard.defaults(DASH), **dashboard.grafana_vars(step_s=15, scrape_s=5, range_s=900)}
    assert v["router_job"] == "smetric-router" and v["worker_job"] == "smetric-workers"
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
